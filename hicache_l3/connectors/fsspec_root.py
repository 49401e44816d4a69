"""The file connector over an fsspec URL root (``s3://``, ``memory://``, ``file://``...):
one object per page, copied through Python bytes. The slab store's settings are ignored
here with a warning; environment variables keep the ``HICACHE_L3_FILE_`` prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Callable
from typing import Any, Literal

from hicache_l3.common.compression import COMPRESSION_HELP, PageCodec, read_stored
from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Capabilities, Connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
from hicache_l3.common.keys import Namespace
from hicache_l3.common.pages import Page, page_nbytes
from hicache_l3.common.parallel import BatchPool
from hicache_l3.common.safe_fs import private_root
from hicache_l3.slab.format import MARKER, START, START_MAGIC, encode_start

log = logging.getLogger("hicache_l3.fsspec")

# Settings of the slab file connector that an fsspec root has no use for.
SLAB_ONLY = ("capacity_bytes", "slab_bytes", "write_threads", "fsync", "o_direct")


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


@dataclasses.dataclass
class FsspecConfig(ConnectorConfig):
    """Settings of the file connector with an fsspec URL root (``HICACHE_L3_FILE_<FIELD>``)."""

    root: str = setting("", "fsspec URL holding the pages (s3://bucket/prefix, file:///path, ...)")
    io_threads: int = setting(2, "threads moving the pages of one batch in parallel")
    checksum: Literal["xxh3", "none"] = setting("xxh3", "page checksum verified on every get")
    compression: Literal["none", "zstd"] = setting("none", COMPRESSION_HELP)

    def validate(self) -> None:
        """Check values that types alone cannot."""
        super().validate()
        if "://" not in self.root:
            raise ConfigError(f"file connector (fsspec): root must be a URL such as s3://bucket/prefix, "
                              f"got {self.root!r}")
        if self.io_threads < 1:
            raise ConfigError(f"io_threads must be >= 1, got {self.io_threads}")


class FsspecConnector(Connector[FsspecConfig]):
    """One object per page at ``<root>/ns-<digest>/<fp[:2]>/<key>.page``: a 64-byte header
    (length, checksum of the stored bytes, key fingerprint), then the page or its frame.
    Written to a temporary name and moved into place.
    """

    name = "file"
    config_class = FsspecConfig

    @classmethod
    def open(cls, settings: dict[str, Any], namespace: Namespace) -> Connector[Any]:
        """Drop the slab store's settings with a warning naming them, then open."""
        wasted = sorted(set(settings) & set(SLAB_ONLY))
        if wasted:
            log.warning("file connector: %s mean nothing for an fsspec root (%r) and are ignored",
                        wasted, settings.get("root"))
            settings = {k: v for k, v in settings.items() if k not in SLAB_ONLY}
        return super().open(settings, namespace)

    def __init__(self, config: FsspecConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        try:
            import fsspec
        except ImportError as exc:
            raise EngineUnavailableError(
                "file connector with a URL root needs fsspec: pip install 'hicache-l3[fsspec]'"
            ) from exc
        try:
            self.fs, path = fsspec.core.url_to_fs(config.root)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"file connector: cannot open root {config.root!r}: {exc}") from None
        if "file" in _protocols(self.fs):  # a local root: private, as the slab path's
            private_root(path, f"{self.name} connector: root")
        self.base = f"{path.rstrip('/')}/ns-{namespace.digest()}"
        self.fs.makedirs(self.base, exist_ok=True)
        self._pool = BatchPool(config.io_threads, "hicache-fsspec", min_share=1)
        self._codec = PageCodec(config.compression, namespace.kv_dtype)

    @property
    def capabilities(self) -> Capabilities:
        """Persistent and shared (as the filesystem is); no eviction of its own."""
        return Capabilities(
            persistent=True,
            shared_across_processes=True,
            detects_corruption=self.config.checksum != "none",
            evicts=False,
            compresses=True,
        )

    def _path(self, key: str) -> str:
        return f"{self.base}/{key_fingerprint(key).hex()[:2]}/{key}.page"

    def _each(self, n: int, one: Callable[[int], Reason]) -> list[Reason]:
        """``one(i)`` for every ``i`` below ``n``, spread over the I/O threads."""
        out = [Reason.OK] * n

        def run(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                out[i] = one(i)

        self._pool.map(run, n)
        return out

    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        return self._each(len(keys), lambda i: self._write(keys[i], pages[i]))

    def _write(self, key: str, page: Page) -> Reason:
        """Store ``page`` under ``key`` unless it is there: written to a temporary name, then
        moved into place."""
        path = self._path(key)
        views = self.regions.views(page)
        if views is None:
            return Reason.UNREGISTERED
        try:
            if self.fs.exists(path):
                return Reason.OK
            frame = self._codec.encode(views)
            body: list[Any] = views if frame is None else [frame]
            csum = buffer_checksum(body) if self.config.checksum != "none" else 0
            nbytes = page_nbytes(page) if frame is None else len(frame)
            head = encode_start(0, nbytes, csum, key_fingerprint(key))
            tmp = f"{path}.tmp-{uuid.uuid4().hex}"
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            self.fs.pipe_file(tmp, b"".join([head, *body]))
            self.fs.mv(tmp, path)
        except Exception as exc:
            self._log.warning("set-io", "file(fsspec): write of %s failed: %s", key, exc)
            return Reason.ENGINE_ERROR
        return Reason.OK

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        return self._each(len(keys), lambda i: self._read(keys[i], pages[i]))

    def _read(self, key: str, page: Page) -> Reason:
        """Page ``key`` checked against its header, then copied (or its frame decoded) into ``page``."""
        try:
            blob = self.fs.cat_file(self._path(key))
        except FileNotFoundError:
            return Reason.MISS
        except Exception as exc:
            self._log.warning("get-io", "file(fsspec): read of %s failed: %s", key, exc)
            return Reason.ENGINE_ERROR
        if len(blob) < MARKER:
            return Reason.CORRUPT
        magic, _, _, _, length, csum, fp = START.unpack_from(blob)
        body = memoryview(blob)[MARKER:]
        if (magic != START_MAGIC or fp != key_fingerprint(key) or len(body) != length
                or (csum and buffer_checksum([body]) != csum)):
            return Reason.CORRUPT
        views = self.regions.views(page)
        return Reason.UNREGISTERED if views is None else read_stored(body, views)

    def _exists(self, keys: list[str]) -> list[Reason]:
        return self._each(len(keys),
                          lambda i: Reason.OK if self.fs.exists(self._path(keys[i])) else Reason.MISS)

    def _delete(self, keys: list[str]) -> list[Reason]:
        out = []
        for key in keys:
            try:
                self.fs.rm_file(self._path(key))
                out.append(Reason.OK)
            except FileNotFoundError:
                out.append(Reason.MISS)
        return out

    def _clear(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.base, recursive=True)
        self.fs.makedirs(self.base, exist_ok=True)

    def _close(self) -> None:
        self._pool.shutdown()

    def _engine_stats(self) -> dict[str, Any]:
        return {"root": self.config.root, "path": "fsspec (copying)"}
