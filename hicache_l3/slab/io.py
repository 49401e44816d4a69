"""Slot transports: how a slot's bytes move, behind one interface.

Every slab connector runs the same orchestration (:mod:`hicache_l3.slab.engine`); only
the transport differs. A transport moves a batch of slots and reports one status code per
page in the batch's ``status`` array:

* :data:`OK`; :data:`SHORT`, :data:`HEADER` (the marker record does not
  carry the entry's generation and key fingerprint: torn, stale, recycled) or
  :data:`CHECKSUM` for a page that is not that key's bytes; :data:`NOMEM`;
  :data:`UNREGISTERED`; ``-errno`` for a failed syscall; :data:`FAILED` with a
  :class:`~hicache_l3.common.errors.Reason` in the batch's ``reasons`` (engine errors,
  timeouts). A page left :data:`PENDING` counts as an engine error: a transport reports
  :data:`OK` only for pages it knows have moved.

A write puts the slot's marker record first, then the data; a read takes the data first
and the marker record last, and accepts the page only if the record is the one its
index entry implies (and, where the entry has one, the data match the checksum): the
torn-slot argument of :mod:`hicache_l3.slab.format` (format 2). The marker and the data
are not adjacent, so every write is two calls, marker first (the native transport
coalesces the markers, and the data, of adjacent slots into one call each).

Transports here: :class:`PythonTransport` (``preadv``/``pwritev``, the reference) and
:class:`NativeTransport` (the C batch library). :func:`select_transport` is the one
selection point (:func:`hicache_l3.slab.uring.select_transport` puts io_uring over it for
O_DIRECT and cold pages); a connector's ``transport.name`` says which one it uses. The NIXL
(:mod:`hicache_l3.connectors.nixl.file`) and 3FS USRBIO (:mod:`hicache_l3.connectors.hf3fs`)
transports live with their engines.
"""

from __future__ import annotations

import abc
import array
import errno
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import key_fingerprint, page_checksum
from hicache_l3.common.pages import Page
from hicache_l3.common.parallel import BatchPool
from hicache_l3.slab import native
from hicache_l3.slab.format import (
    ALIGN,
    RECORD_BYTES,
    Entry,
    Geometry,
    Located,
    Slot,
    check_marker,
    encode_marker,
    expected_markers,
)
from hicache_l3.slab.native import CHECKSUM, HEADER, NOMEM, OK, SHORT
from hicache_l3.slab.records import write_markers
from hicache_l3.slab.slots import SlotColumns

if TYPE_CHECKING:
    from hicache_l3.slab.plan import GetPlan
    from hicache_l3.slab.store import SlabStore

UNREGISTERED, FAILED, PENDING = 5, 6, 7  # PENDING: not (yet) known to have moved
_MAX_IOV = 1024  # IOV_MAX on Linux: iovecs one preadv/pwritev takes
__all__ = ["CHECKSUM", "FAILED", "HEADER", "NOMEM", "OK", "PENDING", "SHORT", "UNREGISTERED", "ReadBatch",
           "SlotTransport", "WriteBatch", "explain", "select_transport", "verify"]


class WriteBatch:
    """Pages to write into reserved slots: ``pages[j]`` of ``keys[j]`` into ``slots[j]``.

    The transport fills ``status[j]`` and, when ``checksum``, ``checksums[j]`` (the XXH3
    it wrote into the marker record)."""

    __slots__ = ("checksum", "checksums", "geometry", "held", "keys", "pages", "reasons", "slots", "status")

    def __init__(self, keys: list[str], pages: list[Page], slots: Sequence[Slot], geometry: Geometry,
                 checksum: bool) -> None:
        n = len(keys)
        self.keys, self.pages, self.slots = keys, pages, slots
        self.geometry, self.checksum = geometry, checksum
        self.status = array.array("i", [PENDING]) * n
        self.checksums: array.array[int] = array.array("Q", bytes(8 * n))
        self.reasons: dict[int, Reason] = {}
        self.held: set[int] = set()

    def fail(self, j: int, reason: Reason) -> None:
        """Page ``j`` failed for ``reason``."""
        self.status[j] = FAILED
        self.reasons[j] = reason


class ReadBatch:
    """Slots to read: ``located[j]`` (descriptor and entry) of ``keys[j]`` into
    ``pages[j]``; every entry's length is ``geometry.slot_bytes``. The transport fills
    ``status[j]``."""

    __slots__ = ("geometry", "keys", "located", "pages", "reasons", "status")

    def __init__(self, keys: list[str], pages: list[Page], located: list[Located],
                 geometry: Geometry) -> None:
        self.keys, self.pages, self.located, self.geometry = keys, pages, located, geometry
        self.status = array.array("i", [PENDING]) * len(keys)
        self.reasons: dict[int, Reason] = {}

    def fail(self, j: int, reason: Reason) -> None:
        """Page ``j`` failed for ``reason``."""
        self.status[j] = FAILED
        self.reasons[j] = reason


def verify(record: bytes | memoryview, entry: Entry, key: str, page: Page | None) -> int:
    """Status of a slot whose data, then marker ``record``, were read: :data:`HEADER`
    unless the record carries the entry and key, :data:`CHECKSUM` when ``page`` is given
    and the entry's checksum differs."""
    if not check_marker(record, entry, key_fingerprint(key)):
        return HEADER
    if page is not None and entry.checksum and page_checksum(page) != entry.checksum:
        return CHECKSUM
    return OK


def explain(status: int) -> str:
    """Words for a failed page's status code."""
    if status < 0:
        return os.strerror(-status)
    return {SHORT: "short transfer", HEADER: "marker record mismatch",
            CHECKSUM: "checksum mismatch", NOMEM: "out of memory for a checksum state",
            UNREGISTERED: "page outside registered memory", PENDING: "not moved",
            }.get(status, f"status {status}")


class SlotTransport(abc.ABC):
    """How one connector moves slot bytes (module docstring). Thread-safe."""

    name: str = "transport"

    def stats(self) -> dict[str, Any]:
        """Counters of this transport for the connector's stats (none by default)."""
        return {}

    @abc.abstractmethod
    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """Write every page of ``batch`` into its slot (marker record first, then the data);
        fill its status and checksums."""

    @abc.abstractmethod
    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """Read every slot of ``batch`` into its page and verify it; fill its status."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release threads and engine resources (the store closes the files)."""

    #: Whether :meth:`read_plan` reads a :class:`~hicache_l3.slab.plan.GetPlan` (the native
    #: transport); the others take :meth:`read` of a :class:`ReadBatch`.
    reads_plans: bool = False

    def read_plan(self, plan: GetPlan, pages: Sequence[Page],
                  reasons: dict[int, Reason] | None = None) -> array.array[int]:
        """Read the ``plan.count`` planned pages into ``pages`` (page ``j`` for key
        ``plan.where[j]``) and verify them as :meth:`read` does; one status per page, and
        for a page left :data:`FAILED` its Reason in ``reasons[j]`` (as a
        :class:`ReadBatch`'s; absent: an engine error)."""
        raise NotImplementedError(f"{self.name} does not read get plans")


class PythonTransport(SlotTransport):
    """``os.pwritev``/``os.preadv`` straight between registered memory and the slab
    files, a ctypes XXH3 per page; the reference path. ``direct`` moves pages of one
    aligned segment with O_DIRECT (others count ``direct_fallback``); ``write_threads``
    threads write a batch's pages."""

    def __init__(self, regions: Any, metrics: Any, io_threads: int, *, direct: bool = False,
                 name: str = "Python I/O", write_threads: int = 1) -> None:
        self.regions, self.metrics, self.direct, self.name = regions, metrics, direct, name
        self._pool = self.read_pool = BatchPool(io_threads, "hicache-file")
        # one writer thread unless told: the Python write path holds the GIL between syscalls
        self._write_pool = BatchPool(write_threads, "hicache-file-w")

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """Each page: its marker record (``pwrite``), then its data (``pwritev``). With
        ``direct``, the batch's markers all go first, then its data: a buffered write holds
        the file an O_DIRECT write waits for, so interleaving them would serialize the data."""
        geometry = batch.geometry
        nbytes = geometry.slot_bytes
        keys, pages, slots = batch.keys, batch.pages, batch.slots
        status, checksums, checksum, direct = batch.status, batch.checksums, batch.checksum, self.direct
        views_of, pwrite, pwritev = self.regions.views, os.pwrite, os.pwritev
        cut = self.regions.batch_views(pages)  # the common case, cut at once
        data_at, marker_at = geometry.offsets(s[2] for s in slots)
        me = store.me or 0  # reserve made this process a writer
        marked = [False] * len(keys)

        def mark(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                fd, _slab, _slot, gen = slots[j]
                page = pages[j]
                if (cut[j] if cut is not None else views_of(page)) is None:
                    status[j] = UNREGISTERED
                    continue
                csum = page_checksum(page) if checksum else 0
                record = encode_marker(gen, nbytes, csum, key_fingerprint(keys[j]))
                try:
                    if pwrite(fd, record, marker_at[j]) != RECORD_BYTES:
                        status[j] = SHORT
                        continue
                except OSError as exc:
                    status[j] = -(exc.errno or errno.EIO)
                    continue
                checksums[j] = csum
                marked[j] = True

        def move(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                if not marked[j]:
                    continue
                fd, slab, _slot, _gen = slots[j]
                page = pages[j]
                views = cut[j] if cut is not None else views_of(page)
                assert views is not None  # mark() saw them
                try:
                    if direct and _aligned(page):
                        ok = pwritev(store.fd(me, slab, direct=True), views, data_at[j]) == nbytes
                    else:
                        if direct:
                            self.metrics.count("direct_fallback")
                        ok = pwritev(fd, views, data_at[j]) == nbytes
                except OSError as exc:
                    status[j] = -(exc.errno or errno.EIO)
                    continue
                status[j] = OK if ok else SHORT

        def write(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                mark(j, j + 1)
                move(j, j + 1)

        if direct:
            self._write_pool.map(mark, len(keys))
            self._write_pool.map(move, len(keys))
        else:
            self._write_pool.map(write, len(keys))

    def read(self, store: SlabStore, batch: ReadBatch, work: Sequence[int] | None = None) -> None:
        """Each page (or those of ``work``): its data (``preadv``), then its marker record
        (``pread``), then verified."""
        self.read_some(store, batch, range(len(batch.keys)) if work is None else work)

    def read_some(self, store: SlabStore, batch: ReadBatch, work: Sequence[int]) -> None:
        """:meth:`read` of the pages ``work`` of ``batch`` only."""
        geometry = batch.geometry
        nbytes = geometry.slot_bytes
        direct = self.direct
        keys, pages, located, status = batch.keys, batch.pages, batch.located, batch.status
        views_of, preadv = self.regions.views, os.preadv
        cut = self.regions.batch_views([pages[j] for j in work])  # the common case, cut at once
        data_at, marker_at = geometry.offsets(located[j][1][2] for j in work)
        fingerprint, checksum_of = key_fingerprint, page_checksum

        def read(lo: int, hi: int) -> None:
            record = memoryview(bytearray(RECORD_BYTES))
            for k in range(lo, hi):
                j = work[k]
                fd, entry = located[j]
                page = pages[j]
                views = cut[k] if cut is not None else views_of(page)
                if views is None:
                    status[j] = UNREGISTERED
                    continue
                fp, csum = fingerprint(keys[j]), entry.checksum
                try:
                    if direct and _aligned(page):
                        dfd = store.fd(entry.writer, entry.slab, direct=True)
                        ok = preadv(dfd, views, data_at[k]) == nbytes
                    else:
                        ok = preadv(fd, views, data_at[k]) == nbytes
                    ok = ok and preadv(fd, [record], marker_at[k]) == RECORD_BYTES  # after the data
                    ok = ok and check_marker(record, entry, fp)
                except OSError as exc:
                    status[j] = -(exc.errno or errno.EIO)
                    continue
                if not ok:
                    status[j] = HEADER
                elif csum and checksum_of(page) != csum:
                    status[j] = CHECKSUM
                else:
                    status[j] = OK

        self._pool.map(read, len(work))

    def close(self) -> None:
        """Stop the I/O threads."""
        self._pool.shutdown()
        self._write_pool.shutdown()


class NativeTransport(SlotTransport):
    """The C batch library (:mod:`hicache_l3.slab.native`): a batch in chunks of pages, one
    call with the GIL released each, claimed by whichever I/O thread is free; within a
    chunk, the marker records of adjacent slots move in one call, and so do their data."""

    name = "native batch I/O (C)"

    def __init__(self, lib: native.BatchIO, python: PythonTransport, write_threads: int,
                 cold_threads: int = 0) -> None:
        self.lib, self.python = lib, python
        self._pool = python.read_pool
        self._write_pool = BatchPool(write_threads, "hicache-file-w")
        # pages not in the page cache wait on the disk: read many at once (its queue
        # depth), by threads started only when a batch has some
        self._cold_pool = BatchPool(cold_threads, "hicache-file-cold") if cold_threads > 1 else None

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """One :class:`~hicache_l3.slab.native.PageBatch` (its marker records and offsets
        made in one C call: :func:`~hicache_l3.slab.records.write_markers`; the segments
        of a :class:`~hicache_l3.common.pages.FlatPages` taken as they are), its shares
        written in parallel."""
        cols, lib = SlotColumns.of(batch.slots), self.lib  # the reserve's columns, as they are
        made = write_markers(batch.keys, cols.gens, cols.slots, batch.geometry)
        pb = native.PageBatch.for_write(RECORD_BYTES, cols.fds, made.data_offsets, made.marker_offsets,
                                        batch.pages, made.records)
        checksum = batch.checksum
        _run_batch(lib, self._write_pool, len(pb), batch.geometry.slot_bytes,
                   lambda share, ns: lib.share_write(share, pb, ns, checksum),
                   lambda lo, hi: lib.write(pb, lo, hi, checksum), guided=False)
        batch.status, batch.checksums = pb.status, pb.checksums

    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """One :class:`~hicache_l3.slab.native.PageBatch`, its shares read in parallel."""
        located, lib = batch.located, self.lib
        entries = [loc[1] for loc in located]
        data_at, marker_at = batch.geometry.offsets(e[2] for e in entries)
        pb = native.PageBatch(
            RECORD_BYTES, [loc[0] for loc in located], data_at, marker_at, batch.pages,
            expected_markers(entries, batch.keys), [e[5] for e in entries], writing=False,
        )
        n = len(pb)
        self._pool.run_chunks(lambda lo, hi: lib.read(pb, lo, hi), n,
                              _pages_per_call(self._pool, n, n * batch.geometry.slot_bytes))
        batch.status = pb.status

    reads_plans = True

    def read_plan(self, plan: GetPlan, pages: Sequence[Page],
                  reasons: dict[int, Reason] | None = None) -> array.array[int]:
        """The planned pages read by ``hl3_read_plan`` straight from the plan's arrays and
        the batch's flat segments (:meth:`~hicache_l3.slab.native.BatchIO.plan_read`: no
        :class:`~hicache_l3.slab.native.PageBatch`, no per-page Python), its shares in
        parallel."""
        lib, n = self.lib, plan.count
        call = lib.plan_read(plan, pages)
        nowait = self._cold_pool is not None
        _run_batch(lib, self._pool, n, plan.slot_bytes,
                   lambda share, ns: lib.share_read_plan(share, call, ns, nowait),
                   lambda lo, hi: lib.read_plan(call, lo, hi, nowait), guided=True)
        if nowait and native.AGAIN in call.status:
            self._read_cold(call)
        return call.status

    def _read_cold(self, call: native.PlanRead) -> None:
        """The pages a nowait read left :data:`~hicache_l3.slab.native.AGAIN` (not in the
        page cache), read by blocking calls on the cold pool: one run of adjacent pages
        per call, cut so that every thread has some, so that the disk sees them at once
        instead of one or two at a time."""
        assert self._cold_pool is not None
        status, again = call.status, native.AGAIN
        cold = [j for j in range(len(status)) if status[j] == again]
        self.python.metrics.count("cold_pages", len(cold))
        most = max(1, len(cold) // self._cold_pool.threads)
        runs: list[tuple[int, int]] = []
        for j in cold:
            if runs and runs[-1][1] == j and j - runs[-1][0] < most:
                runs[-1] = (runs[-1][0], j + 1)
            else:
                runs.append((j, j + 1))
        lib = self.lib

        def read(lo: int, hi: int) -> None:
            for a, b in runs[lo:hi]:
                lib.read_plan(call, a, b)

        self._cold_pool.run_chunks(read, len(runs), 1)

    def close(self) -> None:
        """Stop the I/O threads (and the Python path's)."""
        self._write_pool.shutdown()
        if self._cold_pool is not None:
            self._cold_pool.shutdown()
        self.python.close()


def select_transport(regions: Any, metrics: Any, *, native_io: bool, direct: bool,
                     io_threads: int, write_threads: int, cold_threads: int = 0) -> SlotTransport:
    """The one selection point for local slab I/O: the C batch library (required: ImportError
    naming the fix when it is not built) unless ``native_io`` is off, the reference path the
    tests run, or ``direct`` is on (O_DIRECT pages take the Python path, each read or write
    waiting on the device: ``cold_threads`` of them at once, as for pages not in the page
    cache)."""
    if not native_io:
        return PythonTransport(regions, metrics, io_threads, direct=direct)
    if direct:
        depth = max(io_threads, write_threads, cold_threads)
        return PythonTransport(regions, metrics, depth, direct=True, name="Python I/O (o_direct)",
                               write_threads=depth)
    return NativeTransport(native.library(), PythonTransport(regions, metrics, io_threads), write_threads,
                           cold_threads)


PARALLEL_MIN_BYTES = 1 << 20
"""A native batch moving fewer bytes runs as one call on the caller's thread: handing shares
to another thread cost more than it saved on small pages; 64 KiB batches gain from the
second thread (docs/benchmarks.md, "Figures behind design choices")."""


def _pages_per_call(pool: BatchPool, n: int, nbytes: int) -> int:
    """Pages per native call of an ``n``-page batch moving ``nbytes`` (0: not known) on
    ``pool``: the whole batch in one call, on the caller's thread, with one thread or under
    :data:`PARALLEL_MIN_BYTES`; else :func:`_chunk`."""
    return n if pool.threads <= 1 or 0 < nbytes < PARALLEL_MIN_BYTES else _chunk(n)


SHARE_MIN_CHUNK_BYTES = 256 << 10  # (native/batch_io.c HL3_READ_RUN: one coalesced read)
SHARE_WAIT_MIN_NS, SHARE_WAIT_MAX_NS = 50_000, 2_000_000


def _run_batch(lib: native.BatchIO, pool: BatchPool, n: int, page_bytes: int,
               drain: Callable[[native.Share, int], bool], call: Callable[[int, int], object],
               guided: bool) -> None:
    """An ``n``-page native batch of ``page_bytes`` pages on ``pool``: one call on the
    caller's thread where :func:`_pages_per_call` says so; else shared by the threads,
    claimed and joined in C (``drain(share, wait_ns)``: :meth:`BatchPool.run_shared`;
    chunks ``guided`` or of ~1/8 of the batch); ``call(lo, hi)`` runs it on the caller's
    thread."""
    chunk = _pages_per_call(pool, n, n * page_bytes)
    if chunk < n:
        share, wait = _share(pool, n, page_bytes, 0 if guided else chunk)
        pool.run_shared(lambda ns: drain(share, ns), lambda: lib.share_stop(share),
                        -(-n // share.chunk), wait)
    else:
        pool.run_chunks(call, n, chunk)


def _share(pool: BatchPool, n: int, page_bytes: int, chunk: int = 0) -> tuple[native.Share, int]:
    """The :class:`~hicache_l3.slab.native.Share` of an ``n``-page batch of ``page_bytes``
    pages on ``pool``: ``chunk`` pages at a time, or (0) guided, what is left / (2 x the
    threads) (a quarter with two) and at least :data:`SHARE_MIN_CHUNK_BYTES`; and how long
    its calling thread waits, spinning, for the chunks other threads still run before it
    waits for them as a sleeper: the biggest chunk's time at 2 GB/s (the longest a chunk
    left runs when the page cache holds its pages), from 50 us to 2 ms (a chunk waiting for
    the disk: the sleep then, not a core spent spinning)."""
    least, parts = (chunk, 0) if chunk else (max(1, SHARE_MIN_CHUNK_BYTES // max(1, page_bytes)),
                                             2 * pool.threads)
    biggest = min(n, max(least, n // parts if parts else 0))  # the first chunk claimed
    wait = min(SHARE_WAIT_MAX_NS, max(SHARE_WAIT_MIN_NS, biggest * page_bytes // 2))
    return native.Share(n, least, parts), wait


def _chunk(n: int) -> int:
    """Pages per native call of an ``n``-page batch: about eight chunks, so that an I/O thread
    the scheduler starts late takes fewer of them (:meth:`BatchPool.run_chunks`), at least
    four pages so the call's own cost stays small."""
    return max(4, -(-n // 8))


def _aligned(page: Page) -> bool:
    return len(page) == 1 and page[0][0] % ALIGN == 0 and page[0][1] % ALIGN == 0
