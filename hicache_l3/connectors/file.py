"""The file connector: pages in preallocated slab files on any POSIX path.

Our answer to SGLang's ``HiCacheFile`` (a file per page, written through a staging copy):

* zero-copy: ``preadv``/``pwritev`` move bytes straight between registered host memory
  and the slab file; no staging buffer, no per-page allocation of page bytes;
* each share of a batch (``io_threads`` for reads, ``write_threads`` for writes) is moved
  by one call of the C batch library (:mod:`hicache_l3.common.batch_io`: syscalls, header
  check and XXH3 with the GIL released once), or, where that library is not built or
  ``native_io=false``, by the pure-Python path (``os.preadv``/``os.pwritev`` and a ctypes
  XXH3 per page), which writes and reads the same bytes;
* pages live in the shared slab store (:mod:`hicache_l3.common.slabs`): a few large
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

from hicache_l3.common import batch_io
from hicache_l3.common.batch_io import NATIVE, BatchIO, PageBatch
from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Capabilities, Connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint, page_checksum
from hicache_l3.common.keys import Namespace
from hicache_l3.common.pages import Page, page_nbytes
from hicache_l3.common.parallel import BatchPool
from hicache_l3.common.safe_fs import private_root
from hicache_l3.common.slabs import (
    ALIGN,
    FORMAT_VERSION,
    HEADER_BLOCK,
    MARKER,
    START,
    START_MAGIC,
    Entry,
    SlabStore,
    check_slot,
    encode_end,
    encode_start,
)
from hicache_l3.connectors.slab_backed import SlabBacked


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
    checksum: Literal["xxh3", "none"] = setting("xxh3", "page checksum verified on every get")
    fsync: Literal["none", "data", "always"] = setting("none", "durability policy (see docs)")
    o_direct: bool = setting(False, "move aligned pages with O_DIRECT, bypassing the page cache")
    native_io: bool = setting(
        True, "move each share of a batch in one call of the C batch library (hicache_l3._batch_io) "
        "when it is built; false: the pure-Python path (the reference; ~2x slower on 64 KiB pages)")

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


class FileConnector(SlabBacked, Connector[FileConfig]):
    """Pages in slab files under a local (or mounted) directory; see module docstring."""

    name = "file"
    config_class = FileConfig

    def __init__(self, config: FileConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self._pool = BatchPool(config.io_threads, "hicache-file")
        self._native = NATIVE if config.native_io else None
        if config.native_io and NATIVE is None and batch_io.WHY_NOT != batch_io.TURNED_OFF:
            self._log.warning("native-io", "%s: %s; moving pages through the Python path (about half "
                              "as fast on 64 KiB pages)", self.name, batch_io.describe())
        # the Python write path holds the GIL between syscalls: one thread measured fastest
        self._write_pool = BatchPool(config.write_threads if self._native else 1, "hicache-file-w")
        if config.o_direct:
            _probe_o_direct(private_root(config.root, f"{self.name} connector: root"))
        self._init_slab_root(config.root, config.capacity_bytes)

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

    # ---- hooks --------------------------------------------------------------------
    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        store, reasons, todo, slots = self._plan_writes(keys)
        if self._native is not None and not self.config.o_direct and todo:
            return self._set_native(self._native, keys, pages, store, reasons, todo, slots)
        geometry = store.geometry
        nbytes = geometry.slot_bytes  # == page_bytes: the base class checked every page
        stride, head, tail = geometry.stride, HEADER_BLOCK - MARKER, HEADER_BLOCK + nbytes
        checksum = self.config.checksum != "none"
        direct = self.config.o_direct
        views_of, pwrite, pwritev = self.regions.views, os.pwrite, os.pwritev
        batch = self.regions.batch_views([pages[i] for i in todo])  # the common case, cut at once

        def write(lo: int, hi: int) -> tuple[list[tuple[str, int, int, int, int, int]],
                                              list[tuple[int, int]]]:
            done, failed = [], []
            for j in range(lo, hi):
                i = todo[j]
                fd, slab, slot, gen = slots[j]
                page = pages[i]
                views = batch[j] if batch is not None else views_of(page)
                if views is None:
                    reasons[i] = Reason.UNREGISTERED
                    failed.append((slab, slot))
                    continue
                csum = page_checksum(page) if checksum else 0
                fp = key_fingerprint(keys[i])
                start = encode_start(gen, nbytes, csum, fp)
                base = slot * stride
                try:
                    # end marker first, then header+data: see slabs.py "Slots"
                    pwrite(fd, encode_end(gen, fp), base + tail)
                    if direct and _aligned(page):
                        dfd = store.fd(store.me, slab, direct=True)  # type: ignore[arg-type]
                        ok = pwritev(dfd, views, base + HEADER_BLOCK) == nbytes
                        ok = ok and pwrite(fd, start, base + head) == MARKER
                    else:
                        if direct:
                            self.metrics.count("direct_fallback")
                        ok = pwritev(fd, [start, *views], base + head) == MARKER + nbytes
                except OSError as exc:
                    reasons[i] = Reason.NO_SPACE if exc.errno == 28 else Reason.ENGINE_ERROR
                    self._log.warning("set-io", "file: write of %s failed: %s", keys[i], exc)
                    failed.append((slab, slot))
                    continue
                if ok:
                    done.append((keys[i], slab, slot, gen, nbytes, csum))
                else:
                    reasons[i] = Reason.ENGINE_ERROR
                    failed.append((slab, slot))
            return done, failed

        shares = self._write_pool.map(write, len(todo))
        store.commit([d for done, _ in shares for d in done])
        store.abort([f for _, failed in shares for f in failed])
        return reasons


    def _set_native(self, native: BatchIO, keys: list[str], pages: list[Page], store: SlabStore,
                    reasons: list[Reason], todo: list[int],
                    slots: list[tuple[int, int, int, int]]) -> list[Reason]:
        """:meth:`_set` through the C batch library: same slots, same bytes on disk. Pages
        lie in registered memory: the base class checked them."""
        geometry = store.geometry
        nbytes, stride = geometry.slot_bytes, geometry.stride
        head, tail = HEADER_BLOCK - MARKER, HEADER_BLOCK + nbytes
        fps = [key_fingerprint(keys[i]) for i in todo]
        batch = PageBatch(
            MARKER, [fd for fd, _, _, _ in slots], [slot * stride + head for _, _, slot, _ in slots],
            [pages[i] for i in todo],
            [encode_start(gen, nbytes, 0, fp) for (_, _, _, gen), fp in zip(slots, fps)],
            ends=[encode_end(gen, fp) for (_, _, _, gen), fp in zip(slots, fps)],
            end_offsets=[slot * stride + tail for _, _, slot, _ in slots],
        )
        checksum = self.config.checksum != "none"
        self._write_pool.map(lambda lo, hi: native.write(batch, lo, hi, checksum), len(batch))
        done, failed, status, csums = [], [], batch.status, batch.checksums
        for j, i in enumerate(todo):
            _, slab, slot, gen = slots[j]
            if status[j] == batch_io.OK:
                done.append((keys[i], slab, slot, gen, nbytes, csums[j]))
                continue
            reasons[i] = Reason.NO_SPACE if status[j] == -28 else Reason.ENGINE_ERROR
            self._log.warning("set-io", "file: write of %s failed: %s", keys[i], _explain(status[j]))
            failed.append((slab, slot))
        store.commit(done)
        store.abort(failed)
        return reasons

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        planned = self._plan_reads(keys)
        if planned is None:
            return [Reason.MISS] * len(keys)
        store, found, reasons = planned
        work = [i for i, f in enumerate(found) if f is not None]
        if self._native is not None and not self.config.o_direct:
            # pages without a checksum need their end marker checked: the Python path does that
            plain = [i for i in work if not found[i][1].checksum]  # type: ignore[index]
            work = [i for i in work if found[i][1].checksum] if plain else work  # type: ignore[index]
            hits = self._get_native(self._native, keys, pages, store, found, reasons, work)
            if plain:
                hits += self._get_python(keys, pages, store, found, reasons, plain)
        else:
            hits = self._get_python(keys, pages, store, found, reasons, work)
        store.touch(hits)
        return reasons

    def _get_native(self, native: BatchIO, keys: list[str], pages: list[Page], store: SlabStore,
                    found: list[tuple[int, Entry] | None], reasons: list[Reason],
                    work: list[int]) -> list[tuple[int, int]]:
        """Read the checksummed pages ``work`` through the C batch library; set their
        reasons; the (slab, slot) of this process's pages read, for the LRU. Pages lie in
        registered memory: the base class checked them."""
        nbytes, stride = store.geometry.slot_bytes, store.geometry.stride
        head = HEADER_BLOCK - MARKER
        fingerprint, pack_start = key_fingerprint, START.pack
        queued = []
        for i in work:
            if found[i][1].length != nbytes:  # type: ignore[index]
                reasons[i] = Reason.SIZE_MISMATCH
            else:
                queued.append(i)
        entries: list[Entry] = [found[i][1] for i in queued]  # type: ignore[index]
        batch = PageBatch(
            MARKER, [found[i][0] for i in queued], [e.slot * stride + head for e in entries],  # type: ignore[index]
            [pages[i] for i in queued],
            [pack_start(START_MAGIC, FORMAT_VERSION, 0, e.gen, nbytes, e.checksum, fingerprint(keys[i]))
             for i, e in zip(queued, entries)],
            [e.checksum for e in entries],
        )
        self._pool.map(lambda lo, hi: native.read(batch, lo, hi), len(batch))
        me, hits, status = store.me, [], batch.status
        for k, i in enumerate(queued):
            entry = entries[k]
            if status[k] == batch_io.OK:
                reasons[i] = Reason.OK
                if entry.writer == me:
                    hits.append((entry.slab, entry.slot))
            elif status[k] in (batch_io.SHORT, batch_io.HEADER, batch_io.CHECKSUM):
                reasons[i] = Reason.CORRUPT
                store.invalidate(keys[i], entry)
            else:
                reasons[i] = Reason.ENGINE_ERROR
                self._log.warning("get-io", "file: read of %s failed: %s", keys[i], _explain(status[k]))
        return hits

    def _get_python(self, keys: list[str], pages: list[Page], store: SlabStore,
                    found: list[tuple[int, Entry] | None], reasons: list[Reason],
                    work: list[int]) -> list[tuple[int, int]]:
        """Read pages ``work`` with ``os.preadv`` (the reference path); set their reasons;
        the (slab, slot) of this process's pages read, for the LRU."""
        geometry = store.geometry
        nbytes = geometry.slot_bytes  # == page_bytes: the base class checked every page
        stride, head = geometry.stride, HEADER_BLOCK - MARKER
        expect, expect_data = 2 * MARKER + nbytes, MARKER + nbytes
        direct = self.config.o_direct
        views_of, preadv = self.regions.views, os.preadv
        batch = self.regions.batch_views([pages[i] for i in work])  # the common case, cut at once

        me, pack_start, fingerprint, checksum_of = store.me, START.pack, key_fingerprint, page_checksum

        def read(lo: int, hi: int) -> list[tuple[int, int]]:
            scratch = memoryview(bytearray(2 * MARKER))
            start, end = scratch[:MARKER], scratch[MARKER:]
            hits = []
            for j in range(lo, hi):
                i = work[j]
                fd, entry = found[i]  # type: ignore[misc]
                page = pages[i]
                views = batch[j] if batch is not None else views_of(page)
                if views is None:
                    reasons[i] = Reason.UNREGISTERED
                    continue
                if entry.length != nbytes:
                    reasons[i] = Reason.SIZE_MISMATCH
                    continue
                fp, csum = fingerprint(keys[i]), entry.checksum
                try:
                    if direct and _aligned(page):
                        dfd = store.fd(entry.writer, entry.slab, direct=True)
                        ok = preadv(fd, [start], geometry.header_offset(entry.slot)) == MARKER
                        ok = ok and preadv(dfd, views, geometry.data_offset(entry.slot)) == nbytes
                        ok = ok and preadv(fd, [end], geometry.end_offset(entry.slot)) == MARKER
                        ok = ok and check_slot(start, end, entry, fp)
                    elif csum:  # the checksum catches a torn read: no end marker needed
                        ok = preadv(fd, [start, *views], entry.slot * stride + head) == expect_data
                        ok = ok and start == pack_start(START_MAGIC, FORMAT_VERSION, 0, entry.gen,
                                                        nbytes, csum, fp)
                    else:
                        ok = preadv(fd, [start, *views, end], entry.slot * stride + head) == expect
                        ok = ok and check_slot(start, end, entry, fp)
                except OSError as exc:
                    self._log.warning("get-io", "file: read of %s failed: %s", keys[i], exc)
                    reasons[i] = Reason.ENGINE_ERROR
                    continue
                if not ok or (csum and checksum_of(page) != csum):
                    reasons[i] = Reason.CORRUPT
                    store.invalidate(keys[i], entry)
                    continue
                reasons[i] = Reason.OK
                if entry.writer == me:
                    hits.append((entry.slab, entry.slot))
            return hits

        shares = self._pool.map(read, len(work))
        return [where for hits in shares for where in hits]

    def _close(self) -> None:
        self._pool.shutdown()
        self._write_pool.shutdown()
        self._close_store()

    def _engine_stats(self) -> dict[str, Any]:
        io = batch_io.describe() if self.config.native_io else "Python I/O"
        return {**self._slab_stats(), "io_path": io}


def _explain(status: int) -> str:
    """Words for a failed native batch status (``-errno`` or a short transfer)."""
    if status < 0:
        return os.strerror(-status)
    return {batch_io.SHORT: "short transfer", batch_io.NOMEM: "out of memory for a checksum state"}.get(
        status, f"status {status}")


def _probe_o_direct(root: Path) -> None:
    probe = root / f".o_direct_probe.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as exc:
        raise ConfigError(
            f"file connector: o_direct=true but the filesystem of {root} refuses O_DIRECT "
            f"({exc.strerror}); use o_direct=false"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()


def _aligned(page: Page) -> bool:
    return len(page) == 1 and page[0][0] % ALIGN == 0 and page[0][1] % ALIGN == 0


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
        from hicache_l3.common.slabs import START, START_MAGIC

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
