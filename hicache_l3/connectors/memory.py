"""The reference connector: pages as ``bytes`` in a dict of this process, the smallest
complete connector. Connectors of one process naming the same ``store`` and namespace
share its pages, dropped when the last one closes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from typing import Any, Literal

from hicache_l3.common.compression import COMPRESSION_HELP, PageCodec, read_stored
from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Capabilities, Connector
from hicache_l3.common.errors import Reason
from hicache_l3.common.keys import Namespace
from hicache_l3.common.pages import Page


@dataclasses.dataclass
class MemoryConfig(ConnectorConfig):
    """Settings of the memory connector (``HICACHE_L3_MEMORY_<FIELD>`` in the environment)."""

    store: str = setting("default", "name of the in-process store; connectors naming the same "
                                    "store and namespace share pages")
    compression: Literal["none", "zstd"] = setting("none", COMPRESSION_HELP)


class _Pages:
    """The pages of one (store, namespace): key -> bytes, and how many connectors use it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}
        self.users = 0


_STORES: dict[tuple[str, str], _Pages] = {}
_STORES_LOCK = threading.Lock()


def stored_pages(store: str, namespace: Namespace) -> dict[str, bytes] | None:
    """The live dict (key -> page bytes) of a (store, namespace) while open, else None."""
    pages = _STORES.get((store, namespace.digest()))
    return None if pages is None else pages.data


class MemoryConnector(Connector[MemoryConfig]):
    """Pages in a dict of this process."""

    name = "memory"
    config_class = MemoryConfig

    def __init__(self, config: MemoryConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self._id = (config.store, namespace.digest())
        self._codec = PageCodec(config.compression, namespace.kv_dtype)
        with _STORES_LOCK:
            self._pages = _STORES.setdefault(self._id, _Pages())
            self._pages.users += 1

    @property
    def capabilities(self) -> Capabilities:
        """Not persistent, not shared across processes, no checksums, no eviction."""
        return Capabilities(persistent=False, shared_across_processes=False,
                            detects_corruption=False, evicts=False, compresses=True)

    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        for key, page in zip(keys, pages):
            with self._pages.lock:
                if key in self._pages.data:
                    continue  # same key, same bytes: keep the stored page
            value = b"".join(ctypes.string_at(address, length) for address, length in page)
            value = self._codec.encode([memoryview(value)]) or value
            with self._pages.lock:
                self._pages.data.setdefault(key, value)
        return [Reason.OK] * len(keys)

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        reasons = []
        for key, page in zip(keys, pages):
            with self._pages.lock:
                value = self._pages.data.get(key)
            views = self.regions.views(page)
            reasons.append(Reason.MISS if value is None else Reason.UNREGISTERED if views is None
                           else read_stored(value, views))  # the page, or its frame decoded
        return reasons

    def _exists(self, keys: list[str]) -> list[Reason]:
        with self._pages.lock:
            data = self._pages.data
            return [Reason.OK if k in data else Reason.MISS for k in keys]

    def _delete(self, keys: list[str]) -> list[Reason]:
        with self._pages.lock:
            data = self._pages.data
            return [Reason.MISS if data.pop(k, None) is None else Reason.OK for k in keys]

    def _clear(self) -> None:
        with self._pages.lock:
            self._pages.data.clear()

    def _close(self) -> None:
        with _STORES_LOCK:
            self._pages.users -= 1
            if self._pages.users == 0:
                del _STORES[self._id]

    def _engine_stats(self) -> dict[str, Any]:
        with self._pages.lock:
            return {"store": self.config.store, "pages": len(self._pages.data)}
