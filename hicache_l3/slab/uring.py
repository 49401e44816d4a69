"""Slot I/O through io_uring (``hicache_l3/native/uring_io.c``): a batch's pages in flight
at once, up to a queue depth, from one C call with the GIL released; for O_DIRECT pages
(:class:`UringTransport`) and the cold pages of a buffered read (:class:`ColdRingTransport`).
The rings open on first use (:class:`LazyRings`); where the kernel refuses one, one log line
and the blocking path. :func:`select_transport` picks every local slab transport.
"""

from __future__ import annotations

import array
import ctypes
import logging
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache_l3.slab import io, native

if TYPE_CHECKING:
    from hicache_l3.common.errors import Reason
    from hicache_l3.common.pages import Page
    from hicache_l3.slab.plan import GetPlan
    from hicache_l3.slab.store import SlabStore

log = logging.getLogger(__name__)

MAX_DEPTH = 4096  # (uring_io.c hl3_ring_open)


class Rings:
    """A read ring and a write ring of ``depth`` pages each (one call at a time on each;
    concurrent calls wait for it). Closed by :meth:`close`."""

    def __init__(self, depth: int) -> None:
        self.lib, self.depth = native.library(), depth
        self._read = self._open(depth)
        try:
            self._write = self._open(depth)
        except OSError:
            self.lib.ring_close(self._read)
            raise

    def _open(self, depth: int) -> int:
        ring = self.lib.ring_open(depth)
        if not ring:
            err = ctypes.get_errno()
            raise OSError(err, f"io_uring_setup of depth {depth}: {os.strerror(err)}")
        return int(ring)

    def read_plan(self, call: native.PlanRead, only: int = -1,
                  data_fds: array.array[int] | None = None) -> int:
        """The pages of a planned read (:meth:`~hicache_l3.slab.native.BatchIO.plan_read`)
        whose status is ``only`` (every page when -1), read through the ring: data from
        ``data_fds`` (the plan's descriptors when None), then each page's marker record from
        the plan's, checked as :meth:`~hicache_l3.slab.native.BatchIO.read_plan` does. The
        number not OK, or ``-errno`` when the ring failed (then the pages not read carry that
        code)."""
        a = call.args  # (fds, data and marker offsets, segs, at, expect, mlen, csums, xxh3, status)
        return int(self.lib.ring_read(self._read, 0, len(call.status), only, _addr(data_fds), *a[:8],
                                      self.lib.xxh3_at, a[9]))

    def write(self, pb: native.PageBatch, data_fds: array.array[int] | None, checksum: bool) -> int:
        """Write every page of ``pb`` (its marker record, then once that is written its data,
        to ``data_fds`` or ``pb.fds``), checksummed first when ``checksum``, as
        :meth:`~hicache_l3.slab.native.BatchIO.write`; the number not OK or ``-errno``."""
        fds, doffs, moffs, segs, at, markers = pb.addresses
        return int(self.lib.ring_write(self._write, 0, len(pb), _addr(data_fds), fds, doffs, moffs, segs, at,
                                    markers, pb.marker_len, int(checksum), pb.checksums_at, self.lib.xxh3_at,
                                    pb.status_at))

    def close(self) -> None:
        """Tear both rings down (once; no call may be running)."""
        read, write = self._read, self._write
        self._read = self._write = 0
        for ring in (read, write):
            if ring:
                self.lib.ring_close(ring)


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


class UringTransport(io.DirectTransport):
    """O_DIRECT slot I/O through :class:`Rings`, ``depth`` pages in flight from one C call:
    sets (data descriptors as :func:`~hicache_l3.slab.io.direct_fds`) and planned gets.
    Where the ring is refused or fails, this and later batches take the blocking calls of
    :class:`~hicache_l3.slab.io.DirectTransport` (as do located gets: :meth:`read`)."""

    name = "io_uring O_DIRECT (C)"
    plans_direct = True

    def __init__(self, rings: LazyRings, lib: native.BatchIO, metrics: Any, threads: int) -> None:
        super().__init__(lib, metrics, threads)
        self.rings = rings
        self._failed = False
        self.reads_plans = True  # until the ring is refused or fails

    def stats(self) -> dict[str, Any]:
        """The ring's depth."""
        return {"io_uring_depth": self.rings.depth}

    def _ready(self) -> Rings | None:
        rings = None if self._failed else self.rings.get()
        if rings is None:
            self.reads_plans = False  # the blocking calls read located batches
        return rings

    def _broke(self, err: int) -> None:
        self.reads_plans = False
        if not self._failed:
            self._failed = True
            log.warning("io_uring failed (%s): O_DIRECT pages move by blocking calls from now on",
                        os.strerror(-err))

    def read_plan(self, plan: GetPlan, pages: Sequence[Page],
                  reasons: dict[int, Reason] | None = None) -> array.array[int]:
        """The planned pages through the read ring from their O_DIRECT descriptors
        (:func:`~hicache_l3.slab.io.plan_data_fds`), each page's marker record after its
        data, checked. Where the ring is refused or fails, the batch is read again by one
        blocking call through the page cache (later batches take :meth:`read`)."""
        call = self.lib.plan_read(plan, pages)
        rings = self._ready()
        if rings is not None:
            self.metrics.count("io_uring_pages", plan.count)
            bad = rings.read_plan(call, -1, io.plan_data_fds(plan, call, self.metrics))
            if bad >= 0:
                return call.status
            self._broke(bad)
        self.lib.read_plan(call, 0, plan.count)
        return call.status

    def write(self, store: SlabStore, batch: io.WriteBatch) -> None:
        """Every page's marker record, then its data, through the write ring (a page's data
        goes once its own record is in, while later pages are still being hashed)."""
        rings = self._ready()
        if rings is not None:
            pb, data_fds = self._write_batch(store, batch)
            self.metrics.count("io_uring_pages", len(pb))
            bad = rings.write(pb, data_fds, batch.checksum)
            if bad >= 0:
                batch.status, batch.checksums = pb.status, pb.checksums
                return
            self._broke(bad)  # the ring failed: the whole batch again, by blocking calls
        super().write(store, batch)

    def close(self) -> None:
        """Tear the rings down and stop the threads."""
        self.rings.close()
        super().close()


COLD_RING_MIN_BYTES = 256 << 10
"""Pages of at least this size that a buffered read finds outside the page cache go through
the ring; smaller ones stay with the cold threads (docs/benchmarks.md, "Beyond memory")."""


class ColdRingTransport(io.NativeTransport):
    """:class:`~hicache_l3.slab.io.NativeTransport` whose cold pages of
    :data:`COLD_RING_MIN_BYTES` or more are read through the read ring, ``depth`` at a time
    from one call (smaller ones, and all once a ring failed, by the cold threads)."""

    def __init__(self, rings: LazyRings, lib: native.BatchIO, metrics: Any, io_threads: int,
                 write_threads: int, cold_threads: int) -> None:
        super().__init__(lib, metrics, io_threads, write_threads, max(2, cold_threads))
        self.rings = rings
        self._failed = False

    def stats(self) -> dict[str, Any]:
        """The ring's depth."""
        return {"io_uring_depth": self.rings.depth}

    def _read_cold(self, call: native.PlanRead) -> None:
        page_bytes = getattr(call.keep[-1], "slot_bytes", 0)  # (keep: ..., the plan)
        rings = self.rings.get() if not self._failed and page_bytes >= COLD_RING_MIN_BYTES else None
        if rings is not None:
            cold = call.status.count(native.AGAIN)
            self.metrics.count("cold_pages", cold)
            self.metrics.count("io_uring_pages", cold)
            bad = rings.read_plan(call, native.AGAIN)
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


def select_transport(metrics: Any, *, direct: bool, io_threads: int, write_threads: int, cold_threads: int,
                     ring_depth: int, what: str) -> io.SlotTransport:
    """The one selection point for local slab I/O, all of it in the C library (ImportError
    naming the fix when it is not built): with ``direct``, :class:`UringTransport` (with
    ``ring_depth`` 0, :class:`~hicache_l3.slab.io.DirectTransport`), on max(threads)
    threads; else :class:`ColdRingTransport` where ``ring_depth`` > 0 and cold pages are read
    apart (``cold_threads`` > 1), else :class:`~hicache_l3.slab.io.NativeTransport`. Rings open
    on first use; ``what`` names the connector in the log line of a refusal."""
    lib = native.library()
    if direct:
        threads = max(io_threads, write_threads, cold_threads)
        if ring_depth > 0:
            return UringTransport(LazyRings(ring_depth, what), lib, metrics, threads)
        return io.DirectTransport(lib, metrics, threads)
    if ring_depth > 0 and cold_threads > 1:
        return ColdRingTransport(LazyRings(ring_depth, what), lib, metrics, io_threads, write_threads,
                                 cold_threads)
    return io.NativeTransport(lib, metrics, io_threads, write_threads, cold_threads)
