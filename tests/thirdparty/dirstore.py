"""A tiny third-party connector, as someone outside this project would write one: pages as
files in a directory (one file per page, written to a temporary name and renamed), so that
every process opening the same root shares them. It is registered by the test module
(``register_connector``) or by an entry point (see test_thirdparty.py), never built in."""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import uuid
from pathlib import Path

from hicache_l3 import Capabilities, Connector, Namespace, Reason
from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.pages import Page, page_nbytes


@dataclasses.dataclass
class DirConfig(ConnectorConfig):
    """Settings of the dirstore connector."""

    root: str = setting("", "directory holding one subdirectory per namespace")


def page_path(root: str, namespace: Namespace, key: str) -> Path:
    """Where the page of ``key`` lives (key hashed: valid keys may exceed NAME_MAX)."""
    return Path(root) / namespace.digest() / hashlib.sha256(key.encode()).hexdigest()


class DirConnector(Connector[DirConfig]):
    """One file per page under ``root``; persistent and shared across processes."""

    name = "dirstore"
    config_class = DirConfig

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(persistent=True, shared_across_processes=True,
                            detects_corruption=False, evicts=False)

    def _path(self, key: str) -> Path:
        return page_path(self.config.root, self.namespace, key)

    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        for key, page in zip(keys, pages):
            path = self._path(key)
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
            tmp.write_bytes(b"".join(ctypes.string_at(a, n) for a, n in page))
            os.replace(tmp, path)
        return [Reason.OK] * len(keys)

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        reasons = []
        for key, page in zip(keys, pages):
            try:
                value = self._path(key).read_bytes()
            except FileNotFoundError:
                reasons.append(Reason.MISS)
                continue
            if len(value) != page_nbytes(page):
                reasons.append(Reason.SIZE_MISMATCH)
                continue
            offset = 0
            for address, length in page:
                ctypes.memmove(address, value[offset:offset + length], length)
                offset += length
            reasons.append(Reason.OK)
        return reasons

    def _exists(self, keys: list[str]) -> list[Reason]:
        return [Reason.OK if self._path(k).exists() else Reason.MISS for k in keys]

    def _delete(self, keys: list[str]) -> list[Reason]:
        reasons = []
        for key in keys:
            try:
                self._path(key).unlink()
                reasons.append(Reason.OK)
            except FileNotFoundError:
                reasons.append(Reason.MISS)
        return reasons

    def _clear(self) -> None:
        shutil.rmtree(Path(self.config.root) / self.namespace.digest(), ignore_errors=True)

    def _close(self) -> None:
        pass
