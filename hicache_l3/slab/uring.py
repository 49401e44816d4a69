"""Slot I/O through io_uring (``hicache_l3/native/uring_io.c``): a batch's pages in flight at
once, up to a queue depth, from one C call with the GIL released.

For pages that wait on the device, where a blocking call per page and thread gives the
device a queue of one or two: O_DIRECT pages (:class:`UringTransport`) and the cold pages
of a buffered read (:class:`ColdRingTransport`). The rings, one per direction, are made
when a transport first moves pages through them, and closed with it; nothing runs between
calls. Where the kernel refuses a ring (``io_uring_setup`` fails: ENOSYS, EPERM under a
seccomp profile or ``kernel.io_uring_disabled``), :class:`LazyRings` logs one line and the
transport keeps the blocking path.
"""

from __future__ import annotations

import array
import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache_l3.common.pages import Page
from hicache_l3.slab import io, native
from hicache_l3.slab.format import ALIGN, RECORD_BYTES, expected_markers
from hicache_l3.slab.records import write_markers
from hicache_l3.slab.slots import SlotColumns

if TYPE_CHECKING:
    from hicache_l3.slab.store import SlabStore

log = logging.getLogger(__name__)

_vp, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
MAX_DEPTH = 4096  # (uring_io.c hl3_ring_open)


class _Calls:
    """The ring calls of the C library."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path, use_errno=True)
        self.open = lib.hl3_ring_open
        self.open.restype, self.open.argtypes = _vp, [ctypes.c_int]
        self.close = lib.hl3_ring_close
        self.close.restype, self.close.argtypes = None, [_vp]
        self.read = lib.hl3_ring_read
        self.read.restype = ctypes.c_int
        self.read.argtypes = [_vp, _i32, _i32, _i32, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _vp]
        self.write = lib.hl3_ring_write
        self.write.restype = ctypes.c_int
        self.write.argtypes = [_vp, _i32, _i32, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _i32, _vp, _vp, _vp]


_calls = native.LoadedOnce(_Calls, lambda _calls: None, "hicache_l3._batch_io refused")


class Rings:
    """A read ring and a write ring of ``depth`` pages each (one call at a time on each;
    concurrent calls wait for it). Closed by :meth:`close`."""

    def __init__(self, depth: int) -> None:
        self.calls, self.depth = _calls.get(), depth
        self._xxh3 = native.xxh3_entry_points()
        self._xxh3_at = ctypes.addressof(self._xxh3)
        self._read = self._open(depth)
        try:
            self._write = self._open(depth)
        except OSError:
            self.calls.close(self._read)
            raise

    def _open(self, depth: int) -> int:
        ring = self.calls.open(depth)
        if not ring:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup of depth {depth}: {os.strerror(err)}")
        return int(ring)

    def read(self, pb: native.PageBatch, data_fds: array.array[int] | None, only: int = -1) -> int:
        """Read every page of ``pb`` (those whose status is ``only``, when >= 0): data from
        ``data_fds`` (``pb.fds`` when None), then each page's marker record, then checked,
        as :meth:`~hicache_l3.slab.native.BatchIO.read`. The number not OK, or ``-errno``
        when the ring failed (then the pages not read carry that code)."""
        fds, doffs, moffs, segs, at, _markers = pb.addresses
        return int(self.calls.read(self._read, 0, len(pb), only, _addr(data_fds), fds, doffs, moffs, segs, at,
                                   pb.expect_at, pb.marker_len, pb.checksums_at, self._xxh3_at, pb.status_at))

    def read_cold(self, call: native.PlanRead) -> int:
        """The pages of a planned read (:meth:`~hicache_l3.slab.native.BatchIO.plan_read`)
        left :data:`~hicache_l3.slab.native.AGAIN` by a nowait read, read through the ring
        (data and markers from the plan's descriptors); as :meth:`read`."""
        a = call.args  # (fds, data and marker offsets, segs, at, expect, mlen, csums, xxh3, status)
        return int(self.calls.read(self._read, 0, len(call.status), native.AGAIN, None, *a[:8],
                                   self._xxh3_at, a[9]))

    def write(self, pb: native.PageBatch, data_fds: array.array[int] | None, checksum: bool) -> int:
        """Write every page of ``pb`` (every marker record, then the data, to ``data_fds`` or
        ``pb.fds``), checksummed first when ``checksum``, as
        :meth:`~hicache_l3.slab.native.BatchIO.write`; the number not OK or ``-errno``."""
        fds, doffs, moffs, segs, at, markers = pb.addresses
        return int(self.calls.write(self._write, 0, len(pb), _addr(data_fds), fds, doffs, moffs, segs, at,
                                    markers, pb.marker_len, int(checksum), pb.checksums_at, self._xxh3_at,
                                    pb.status_at))

    def close(self) -> None:
        """Tear both rings down (once; no call may be running)."""
        read, write = self._read, self._write
        self._read = self._write = 0
        for ring in (read, write):
            if ring:
                self.calls.close(ring)


class LazyRings:
    """:class:`Rings` of ``depth``, opened by the first :meth:`get` (a connector that never
    moves a page through them maps no ring), or refused then: one log line naming ``what``,
    and :meth:`get` is None from then on (the caller's blocking path). Thread-safe."""

    def __init__(self, depth: int, what: str) -> None:
        self.depth, self.what = depth, what
        self._lock = threading.Lock()
        self._rings: Rings | None = None
        self._tried = self._closed = False

    def get(self) -> Rings | None:
        """The rings, or None where the kernel refused them (or after :meth:`close`)."""
        if self._tried:
            return self._rings
        with self._lock:
            if not self._tried and not self._closed:
                try:
                    self._rings = Rings(self.depth)
                except OSError as exc:
                    log.warning("%s: no io_uring (%s): pages move by blocking calls", self.what,
                                exc.strerror or exc)
                self._tried = True
            return self._rings

    def close(self) -> None:
        """Tear the rings down, if opened (no call may be running)."""
        with self._lock:
            self._closed = self._tried = True
            rings, self._rings = self._rings, None
        if rings is not None:
            rings.close()


def _addr(fds: array.array[int] | None) -> int | None:
    return fds.buffer_info()[0] if fds else None


def _aligned(page: Page) -> bool:
    return len(page) == 1 and page[0][0] % ALIGN == 0 and page[0][1] % ALIGN == 0


class UringTransport(io.SlotTransport):
    """O_DIRECT slot I/O through :class:`Rings`: a batch's aligned pages move with
    O_DIRECT, ``depth`` at a time, from one C call; a page that is not one aligned segment
    moves through the page cache in the same call (counted ``direct_fallback``). Should
    a ring fail, this and later batches take ``fallback`` (the blocking O_DIRECT path)."""

    name = "io_uring O_DIRECT (C)"
    reads_plans = False

    def __init__(self, rings: LazyRings, fallback: io.PythonTransport) -> None:
        self.rings, self.fallback, self.metrics = rings, fallback, fallback.metrics
        self._failed = False

    def stats(self) -> dict[str, Any]:
        """The ring's depth."""
        return {"io_uring_depth": self.rings.depth}

    def _ready(self) -> Rings | None:
        return None if self._failed else self.rings.get()

    def _data_fds(self, store: SlabStore, fds: Sequence[int], where: Sequence[tuple[int, int]],
                  pages: Sequence[Page]) -> array.array[int]:
        out = array.array("i", fds)
        unaligned = 0
        for j, page in enumerate(pages):
            if _aligned(page):
                out[j] = store.fd(where[j][0], where[j][1], direct=True)
            else:
                unaligned += 1
        if unaligned:
            self.metrics.count("direct_fallback", unaligned)
        return out

    def _broke(self, err: int) -> None:
        if not self._failed:
            self._failed = True
            log.warning("io_uring failed (%s): O_DIRECT pages move by blocking calls from now on",
                        os.strerror(-err))

    def write(self, store: SlabStore, batch: io.WriteBatch) -> None:
        """Every marker record, then every page's data, through the write ring."""
        rings = self._ready()
        if rings is None:
            self.fallback.write(store, batch)
            return
        cols = SlotColumns.of(batch.slots)
        made = write_markers(batch.keys, cols.gens, cols.slots, batch.geometry)
        pb = native.PageBatch.for_write(RECORD_BYTES, cols.fds, made.data_offsets, made.marker_offsets,
                                        batch.pages, made.records)
        me = store.me or 0
        data_fds = self._data_fds(store, cols.fds, [(me, s) for s in cols.slabs], batch.pages)
        self.metrics.count("io_uring_pages", len(pb))
        bad = rings.write(pb, data_fds, batch.checksum)
        if bad < 0:  # the ring failed: the whole batch again, by blocking calls
            self._broke(bad)
            self.fallback.write(store, batch)
            return
        batch.status, batch.checksums = pb.status, pb.checksums

    def read(self, store: SlabStore, batch: io.ReadBatch) -> None:
        """Every page's data, each followed by its marker record, through the read ring."""
        rings = self._ready()
        if rings is None:
            self.fallback.read(store, batch)
            return
        located = batch.located
        entries = [loc[1] for loc in located]
        data_at, marker_at = batch.geometry.offsets(e[2] for e in entries)
        fds = [loc[0] for loc in located]
        pb = native.PageBatch(RECORD_BYTES, fds, data_at, marker_at, batch.pages,
                              expected_markers(entries, batch.keys), [e[5] for e in entries], writing=False)
        data_fds = self._data_fds(store, fds, [(e[0], e[1]) for e in entries], batch.pages)
        self.metrics.count("io_uring_pages", len(pb))
        bad = rings.read(pb, data_fds)
        if bad < 0:  # the ring failed: the whole batch again, by blocking calls
            self._broke(bad)
            self.fallback.read(store, batch)
            return
        batch.status = pb.status

    def close(self) -> None:
        """Tear the rings down and stop the fallback's threads."""
        self.rings.close()
        self.fallback.close()


COLD_RING_MIN_BYTES = 256 << 10
"""Pages of at least this size that a buffered read finds outside the page cache go through
the ring; smaller ones stay with the cold threads, which read them as fast or faster
(docs/benchmarks.md, "Beyond memory": 64 KiB 0.85-1.0x, 1 MiB 2.2x with the ring)."""


class ColdRingTransport(io.NativeTransport):
    """:class:`~hicache_l3.slab.io.NativeTransport` whose cold pages (those a nowait read
    found outside the page cache) of :data:`COLD_RING_MIN_BYTES` or more are read through
    the read ring, ``depth`` at a time from one call, instead of by the cold threads (which
    read smaller ones, and all of them once a ring failed)."""

    def __init__(self, rings: LazyRings, lib: native.BatchIO, python: io.PythonTransport, write_threads: int,
                 cold_threads: int) -> None:
        super().__init__(lib, python, write_threads, max(2, cold_threads))
        self.rings = rings
        self._failed = False

    def stats(self) -> dict[str, Any]:
        """The ring's depth (the name stays the C library's: pages in the page cache are its)."""
        return {"io_uring_depth": self.rings.depth}

    def _read_cold(self, call: native.PlanRead) -> None:
        page_bytes = getattr(call.keep[-1], "slot_bytes", 0)  # (keep: ..., the plan)
        rings = self.rings.get() if not self._failed and page_bytes >= COLD_RING_MIN_BYTES else None
        if rings is not None:
            cold = call.status.count(native.AGAIN)
            self.python.metrics.count("cold_pages", cold)
            self.python.metrics.count("io_uring_pages", cold)
            bad = rings.read_cold(call)
            if bad >= 0:
                return
            self._failed = True
            log.warning("io_uring failed (%s): cold pages are read by blocking calls from now on",
                        os.strerror(-bad))
            status = call.status  # the pages the ring did not finish, again by blocking calls
            for j in range(len(status)):
                if status[j] == bad:
                    status[j] = native.AGAIN
        super()._read_cold(call)

    def close(self) -> None:
        """Tear the rings down and stop the threads."""
        self.rings.close()
        super().close()


def select_transport(regions: Any, metrics: Any, *, native_io: bool, direct: bool, io_threads: int,
                     write_threads: int, cold_threads: int, ring_depth: int, what: str) -> io.SlotTransport:
    """:func:`~hicache_l3.slab.io.select_transport`, with io_uring where ``ring_depth`` > 0:
    with ``direct``, :class:`UringTransport`; else, where cold pages are read apart
    (``cold_threads`` > 1), :class:`ColdRingTransport`. Their rings open on first use
    (:class:`LazyRings`; ``what`` names the connector in the log line of a refusal), after
    which a refused ring leaves the blocking path."""
    if not (native_io and ring_depth > 0 and (direct or cold_threads > 1)):
        return io.select_transport(regions, metrics, native_io=native_io, direct=direct,
                                   io_threads=io_threads, write_threads=write_threads,
                                   cold_threads=cold_threads)
    rings = LazyRings(ring_depth, what)
    if direct:
        depth = max(io_threads, write_threads, cold_threads)
        blocking = io.PythonTransport(regions, metrics, depth, direct=True, name="Python I/O (o_direct)",
                                      write_threads=depth)
        return UringTransport(rings, blocking)
    return ColdRingTransport(rings, native.library(), io.PythonTransport(regions, metrics, io_threads),
                             write_threads, cold_threads)
