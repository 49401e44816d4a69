"""The file connector: pages in preallocated slab files on any POSIX path.

Our answer to SGLang's ``HiCacheFile`` (a file per page, written through a staging copy):

* zero-copy: ``preadv``/``pwritev`` move bytes straight between registered host memory
  and the slab file; no staging buffer, no per-page allocation of page bytes;
* each share of a batch (``io_threads`` for reads, ``write_threads`` for writes) is moved
  by one call of the C batch library (:class:`~hicache_l3.slab.io.NativeTransport`:
  syscalls, header check and XXH3 with the GIL released once), or, where that library is
  not built or ``native_io=false``, by the pure-Python path
  (:class:`~hicache_l3.slab.io.PythonTransport`: ``os.preadv``/``os.pwritev`` and a
  ctypes XXH3 per page), which writes and reads the same bytes;
* pages live in the shared slab store (:mod:`hicache_l3.slab`): a few large
  preallocated files per writer process, reused under a byte capacity with LRU
  eviction, instead of millions of files in one directory;
* a torn, stale, recycled or (with checksums, the default) corrupted slot is a miss;
* ``exists`` is answered from the shared index and sees other processes' pages.

``o_direct=true`` moves page data with O_DIRECT (bypassing the page cache) when a page
is one segment whose address and length are 4 KiB aligned; other pages take the
buffered path (counted as ``direct_fallback``). ``fsync``: ``none`` (default; pages
survive a process crash, not a power loss), ``data`` (slabs are synced before a batch's
index records are published), ``always`` (the index log is synced too).

Roots that are URLs (``s3://``, ``gcs://``, ``memory://``, ``file://``...) go through
fsspec instead (:class:`FsspecConnector`): one object per page, read and written with a
copy through Python bytes. That path is slower by design and documented as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid
from pathlib import Path
from typing import Any, Literal

from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Capabilities, Connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
from hicache_l3.common.keys import Namespace
from hicache_l3.common.pages import Page, page_nbytes
from hicache_l3.common.parallel import BatchPool
from hicache_l3.common.safe_fs import private_root
from hicache_l3.slab.engine import SlabConnector
from hicache_l3.slab.format import ALIGN, MARKER, START, START_MAGIC, encode_start
from hicache_l3.slab.io import select_transport
from hicache_l3.slab.store import SlabStore


@dataclasses.dataclass
class FileConfig(ConnectorConfig):
    """Settings of the file connector (``HICACHE_L3_FILE_<FIELD>`` in the environment)."""

    root: str = setting("", "directory holding the pages (or an fsspec URL: slower copying path)")
    capacity_bytes: int = setting(
        0, "slab bytes this process may fill before evicting its LRU pages; "
        "0 = half the free space of the filesystem at open", size=True,
    )
    slab_bytes: int = setting(256 << 20, "size of one preallocated slab file", size=True)
    io_threads: int = setting(2, "threads reading the pages of one batch in parallel")
    write_threads: int = setting(
        2, "threads writing the pages of one batch (with native_io; the Python path measured "
        "slower with more than one, and uses one)")
    checksum: Literal["xxh3", "none"] = setting(
        "xxh3", "page checksum written on set, verified on every get; with xxh3 a page another "
        "writer stored without one (checksum=none, nixl file mode's default) is a miss "
        "(unverified) and is stored again, checksummed")
    fsync: Literal["none", "data", "always"] = setting("none", "durability policy (see docs)")
    o_direct: bool = setting(False, "move aligned pages with O_DIRECT, bypassing the page cache")
    native_io: bool = setting(
        True, "move each share of a batch in one call of the C batch library (hicache_l3._batch_io) "
        "when it is built; false: the pure-Python path (the reference; ~2x slower on 64 KiB pages). "
        "The one switch: in the environment, HICACHE_L3_FILE_NATIVE_IO / HICACHE_L3_HF3FS_NATIVE_IO")

    def validate(self) -> None:
        """Check values that types alone cannot."""
        super().validate()
        if not self.root:
            raise ConfigError(
                "file connector: set root to a directory (e.g. root=/mnt/nvme/hicache) "
                "or an fsspec URL (s3://bucket/prefix)"
            )
        if self.io_threads < 1 or self.write_threads < 1:
            raise ConfigError(
                f"io_threads and write_threads must be >= 1, got {self.io_threads}, {self.write_threads}"
            )
        if self.slab_bytes < ALIGN:
            raise ConfigError(f"slab_bytes must be >= {ALIGN}, got {self.slab_bytes}")


def open_file_connector(settings: dict[str, Any], namespace: Namespace) -> Connector[Any]:
    """Registry factory: slab-backed :class:`FileConnector` for paths, fsspec for URLs."""
    config = FileConfig.load("file", settings)
    if "://" in config.root:
        return FsspecConnector(config, namespace)
    return FileConnector(config, namespace)


class FileConnector(SlabConnector, Connector[FileConfig]):
    """Pages in slab files under a local (or mounted) directory; see module docstring."""

    name = "file"
    config_class = FileConfig

    def __init__(self, config: FileConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self.checksum_writes = config.checksum != "none"
        self.transport = select_transport(
            self.regions, self.metrics, self._log, native_io=config.native_io,
            direct=config.o_direct, io_threads=config.io_threads,
            write_threads=config.write_threads, label=self.name,
        )
        try:
            if config.o_direct:
                _probe_o_direct(private_root(config.root, f"{self.name} connector: root"))
            self._init_slab_root(config.root, config.capacity_bytes)
        except BaseException:
            self.transport.close()
            raise

    @property
    def capabilities(self) -> Capabilities:
        """Persistent, shared across processes, evicting; detects corruption with checksums."""
        return Capabilities(
            persistent=True,
            shared_across_processes=True,
            detects_corruption=self.config.checksum != "none",
            evicts=True,
        )

    def _make_store(self, slot_bytes: int) -> SlabStore:
        return SlabStore(
            self.root, self.namespace, slot_bytes,
            capacity_bytes=self.capacity_bytes, slab_bytes=self.config.slab_bytes,
            fsync=self.config.fsync, direct=self.config.o_direct,
        )

    def _engine_stats(self) -> dict[str, Any]:
        return self._slab_stats()


def _probe_o_direct(root: Path) -> None:
    probe = root / f".o_direct_probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(
            f"file connector: o_direct=true but the filesystem of {root} refuses O_DIRECT "
            f"({exc.strerror}); use o_direct=false"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


class FsspecConnector(Connector[FileConfig]):
    """The file connector over an fsspec URL: one object per page, copied through
    Python bytes (slower than the slab path; for roots that are not local paths).

    Object layout: ``<root>/ns-<digest>/<fp[:2]>/<key>.page``, each a 64-byte header
    (the slab start header: length, checksum, key fingerprint) then the page bytes.
    Writes go to a temporary name and are moved into place, so a reader never sees a
    partial object where the filesystem's move is atomic (local and ``file://``; on
    object stores a single PUT is atomic already).
    """

    name = "file"
    config_class = FileConfig

    def __init__(self, config: FileConfig, namespace: Namespace) -> None:
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

    @property
    def capabilities(self) -> Capabilities:
        """Persistent and shared (as the filesystem is); no eviction of its own."""
        return Capabilities(
            persistent=True,
            shared_across_processes=True,
            detects_corruption=self.config.checksum != "none",
            evicts=False,
        )

    def _path(self, key: str) -> str:
        return f"{self.base}/{key_fingerprint(key).hex()[:2]}/{key}.page"

    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        reasons = [Reason.OK] * len(keys)

        def write(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                path = self._path(keys[i])
                views = self.regions.views(pages[i])
                if views is None:
                    reasons[i] = Reason.UNREGISTERED
                    continue
                try:
                    if self.fs.exists(path):
                        continue
                    csum = buffer_checksum(views) if self.config.checksum != "none" else 0
                    head = encode_start(0, page_nbytes(pages[i]), csum, key_fingerprint(keys[i]))
                    tmp = f"{path}.tmp-{uuid.uuid4().hex}"
                    self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
                    self.fs.pipe_file(tmp, b"".join([head, *views]))
                    self.fs.mv(tmp, path)
                except Exception as exc:
                    self._log.warning("set-io", "file(fsspec): write of %s failed: %s", keys[i], exc)
                    reasons[i] = Reason.ENGINE_ERROR

        self._pool.map(write, len(keys))
        return reasons

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        reasons = [Reason.OK] * len(keys)

        def read(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                try:
                    blob = self.fs.cat_file(self._path(keys[i]))
                except FileNotFoundError:
                    reasons[i] = Reason.MISS
                    continue
                except Exception as exc:
                    self._log.warning("get-io", "file(fsspec): read of %s failed: %s", keys[i], exc)
                    reasons[i] = Reason.ENGINE_ERROR
                    continue
                nbytes = page_nbytes(pages[i])
                if len(blob) < MARKER:
                    reasons[i] = Reason.CORRUPT
                    continue
                magic, _, _, _, length, csum, fp = START.unpack_from(blob)
                body = memoryview(blob)[MARKER:]
                if magic != START_MAGIC or fp != key_fingerprint(keys[i]) or len(body) != length:
                    reasons[i] = Reason.CORRUPT
                    continue
                if length != nbytes:
                    reasons[i] = Reason.SIZE_MISMATCH
                    continue
                if csum and buffer_checksum([body]) != csum:
                    reasons[i] = Reason.CORRUPT
                    continue
                views = self.regions.views(pages[i])
                if views is None:
                    reasons[i] = Reason.UNREGISTERED
                    continue
                pos = 0
                for v in views:
                    v[:] = body[pos : pos + len(v)]
                    pos += len(v)

        self._pool.map(read, len(keys))
        return reasons

    def _exists(self, keys: list[str]) -> list[Reason]:
        out = [Reason.MISS] * len(keys)

        def check(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                if self.fs.exists(self._path(keys[i])):
                    out[i] = Reason.OK

        self._pool.map(check, len(keys))
        return out

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
