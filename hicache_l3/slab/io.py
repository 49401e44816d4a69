"""Slot transports: how a slot's bytes move, behind one interface (:class:`SlotTransport`).

A transport moves a batch of slots and reports one status code per page in the batch's
``status``: :data:`OK`; :data:`SHORT`, :data:`HEADER` (the marker record does not carry the
entry's generation and key fingerprint) or :data:`CHECKSUM` for a page that is not that
key's bytes; :data:`NOMEM`; :data:`UNREGISTERED`; ``-errno``; :data:`FAILED` with a
:class:`~hicache_l3.common.errors.Reason` in ``reasons``. A page left :data:`PENDING` counts
as an engine error. A write puts the marker record first, then the data; a read takes the
data first and the record last (slab format 2, :mod:`hicache_l3.slab.format`).

Here: the C batch library's transports (:class:`NativeTransport`, :class:`DirectTransport`
for O_DIRECT); io_uring's are in :mod:`hicache_l3.slab.uring`, NIXL's and 3FS USRBIO's
with their engines.
"""

from __future__ import annotations

import abc
import array
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

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
    expected_markers,
)
from hicache_l3.slab.native import CHECKSUM, HEADER, NOMEM, OK, SHORT
from hicache_l3.slab.records import write_markers
from hicache_l3.slab.slots import SlotColumns

if TYPE_CHECKING:
    from hicache_l3.slab.plan import GetPlan
    from hicache_l3.slab.store import SlabStore

UNREGISTERED, FAILED, PENDING = 5, 6, 7  # PENDING: not (yet) known to have moved
__all__ = ["CHECKSUM", "FAILED", "HEADER", "NOMEM", "OK", "PENDING", "SHORT", "UNREGISTERED", "ReadBatch",
           "SlotTransport", "WriteBatch", "explain", "verify"]


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
    #: Whether the plans it reads must hold O_DIRECT descriptors (``GetPlan.direct_fds``).
    plans_direct: bool = False

    def read_plan(self, plan: GetPlan, pages: Sequence[Page],
                  reasons: dict[int, Reason] | None = None) -> array.array[int]:
        """Read the ``plan.count`` planned pages into ``pages`` (page ``j`` for key
        ``plan.where[j]``) and verify them as :meth:`read` does; one status per page, and
        for a page left :data:`FAILED` its Reason in ``reasons[j]`` (as a
        :class:`ReadBatch`'s; absent: an engine error)."""
        raise NotImplementedError(f"{self.name} does not read get plans")


def read_page_batch(batch: ReadBatch) -> native.PageBatch:
    """The :class:`~hicache_l3.slab.native.PageBatch` of a read batch."""
    entries = [loc[1] for loc in batch.located]
    data_at, marker_at = batch.geometry.offsets(e[2] for e in entries)
    return native.PageBatch(RECORD_BYTES, [loc[0] for loc in batch.located], data_at, marker_at, batch.pages,
                            expected_markers(entries, batch.keys), [e[5] for e in entries], writing=False)


def write_page_batch(batch: WriteBatch) -> tuple[native.PageBatch, SlotColumns]:
    """The :class:`~hicache_l3.slab.native.PageBatch` of a write batch (its marker records
    made in one C call), and the batch's slot columns."""
    cols = SlotColumns.of(batch.slots)
    made = write_markers(batch.keys, cols.gens, cols.slots, batch.geometry)
    return native.PageBatch.for_write(RECORD_BYTES, cols.fds, made.data_offsets, made.marker_offsets,
                                      batch.pages, made.records), cols


def unaligned_pages(segments: bytes | array.array[int], at: Sequence[int], n: int) -> list[int]:
    """The pages ``j < n`` that O_DIRECT cannot move: a segment starts or ends off a 4 KiB
    boundary (``segments``: flat uint64 ``(address, length)`` pairs, page ``j``'s from pair
    ``at[j]`` to ``at[j + 1]``). One pass over the words when every page is aligned."""
    words = memoryview(segments).cast("B").cast("Q")
    if not any(w & (ALIGN - 1) for w in words):
        return []
    return [j for j in range(n) if any(w & (ALIGN - 1) for w in words[2 * at[j]: 2 * at[j + 1]])]


def direct_fds(store: SlabStore, metrics: Any, pb: native.PageBatch,
               where: Sequence[tuple[int, int]]) -> array.array[int]:
    """The descriptors page ``j`` of ``pb`` moves its data through: the O_DIRECT one of slab
    ``where[j]`` (writer, slab), else, for an :func:`unaligned_pages` page, ``pb.fds[j]``
    (counted ``direct_fallback``). SGLang's ``page_first`` pages (a K and a V segment) are
    aligned."""
    out = array.array("i", pb.fds)
    unaligned = set(unaligned_pages(pb.segments, pb.at, len(out)))
    direct: dict[tuple[int, int], int] = {}  # a batch's pages sit in a few slabs
    for j in range(len(out)):
        if j not in unaligned:
            fd = direct.get(where[j])
            if fd is None:
                fd = direct[where[j]] = store.fd(where[j][0], where[j][1], direct=True)
            out[j] = fd
    if unaligned:
        metrics.count("direct_fallback", len(unaligned))
    return out


def plan_data_fds(plan: GetPlan, call: native.PlanRead, metrics: Any) -> array.array[int]:
    """The descriptors a planned O_DIRECT read (``call``, of ``plan``: made with its
    ``direct_fds``) moves page ``j``'s data through, as :func:`direct_fds`: the O_DIRECT one,
    else ``plan.fds[j]`` for an :func:`unaligned_pages` page (counted ``direct_fallback``)."""
    direct = plan.direct_fds
    if direct is None:
        raise ValueError("a plan made without O_DIRECT descriptors")
    segments = cast("bytes | array.array[int]", call.keep[0])  # (keep: segments, at, plan)
    unaligned = unaligned_pages(segments, cast("array.array[int]", call.keep[1]), plan.count)
    if not unaligned:
        return direct
    out = array.array("i", direct)
    for j in unaligned:
        out[j] = plan.fds[j]
    metrics.count("direct_fallback", len(unaligned))
    return out


class NativeTransport(SlotTransport):
    """The C batch library (:mod:`hicache_l3.slab.native`): a batch in chunks of pages, one
    call with the GIL released each, claimed by whichever I/O thread is free; with
    ``cold_threads`` > 1, pages not in the page cache are read apart, that many at once."""

    name = "native batch I/O (C)"
    reads_plans = True

    def __init__(self, lib: native.BatchIO, metrics: Any, io_threads: int, write_threads: int,
                 cold_threads: int = 0) -> None:
        self.lib, self.metrics = lib, metrics
        self._pool = self.read_pool = BatchPool(io_threads, "hicache-file")
        self._write_pool = BatchPool(write_threads, "hicache-file-w")
        self._cold_pool = BatchPool(cold_threads, "hicache-file-cold") if cold_threads > 1 else None

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """One :class:`~hicache_l3.slab.native.PageBatch`, its shares written in parallel."""
        pb, lib, checksum = write_page_batch(batch)[0], self.lib, batch.checksum
        _run_batch(lib, self._write_pool, len(pb), batch.geometry.slot_bytes,
                   lambda share, ns: lib.share_write(share, pb, ns, checksum),
                   lambda lo, hi: lib.write(pb, lo, hi, checksum), guided=False)
        batch.status, batch.checksums = pb.status, pb.checksums

    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """One :class:`~hicache_l3.slab.native.PageBatch`, its shares read in parallel."""
        pb, lib = read_page_batch(batch), self.lib
        n = len(pb)
        self._pool.run_chunks(lambda lo, hi: lib.read(pb, lo, hi), n,
                              _pages_per_call(self._pool, n, n * batch.geometry.slot_bytes))
        batch.status = pb.status

    def read_plan(self, plan: GetPlan, pages: Sequence[Page],
                  reasons: dict[int, Reason] | None = None) -> array.array[int]:
        """The planned pages read straight from the plan's arrays (no per-page Python), its
        shares in parallel; cold pages (with ``cold_threads``) by :meth:`_read_cold`."""
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
        """The pages a nowait read left AGAIN, by blocking calls on the cold pool: runs of
        adjacent pages, cut so that every thread has some."""
        assert self._cold_pool is not None
        status, again = call.status, native.AGAIN
        cold = [j for j in range(len(status)) if status[j] == again]
        self.metrics.count("cold_pages", len(cold))
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
        """Stop the I/O threads."""
        for pool in (self._pool, self._write_pool, self._cold_pool):
            if pool is not None:
                pool.shutdown()


class DirectTransport(SlotTransport):
    """O_DIRECT slot I/O by blocking C calls, ``threads`` shares of a batch at once: an
    aligned page's data move through the slab's O_DIRECT descriptor, other pages' through
    the page cache (:func:`direct_fds`); marker records always through the page cache."""

    name = "native O_DIRECT (C)"

    def __init__(self, lib: native.BatchIO, metrics: Any, threads: int) -> None:
        self.lib, self.metrics = lib, metrics
        self.read_pool = BatchPool(threads, "hicache-file")
        self._write_pool = BatchPool(threads, "hicache-file-w")

    def _write_batch(self, store: SlabStore, batch: WriteBatch) -> tuple[native.PageBatch, array.array[int]]:
        pb, cols = write_page_batch(batch)
        me = store.me or 0  # reserve made this process a writer
        return pb, direct_fds(store, self.metrics, pb, [(me, s) for s in cols.slabs])

    def _read_batch(self, store: SlabStore, batch: ReadBatch) -> tuple[native.PageBatch, array.array[int]]:
        pb = read_page_batch(batch)
        return pb, direct_fds(store, self.metrics, pb, [(e[0], e[1]) for _fd, e in batch.located])

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """Each share: its marker records, then its data."""
        pb, data = self._write_batch(store, batch)
        self._write_pool.map(lambda lo, hi: self.lib.write(pb, lo, hi, batch.checksum, data), len(pb))
        batch.status, batch.checksums = pb.status, pb.checksums

    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """Each share: its data, then its marker records, then checked."""
        pb, data = self._read_batch(store, batch)
        self.read_pool.map(lambda lo, hi: self.lib.read(pb, lo, hi, data), len(pb))
        batch.status = pb.status

    def close(self) -> None:
        """Stop the I/O threads."""
        self.read_pool.shutdown()
        self._write_pool.shutdown()


PARALLEL_MIN_BYTES = 1 << 20
"""A native batch moving fewer bytes runs as one call on the caller's thread (handing
shares to another thread costs more than it saves on small batches)."""


def _pages_per_call(pool: BatchPool, n: int, nbytes: int) -> int:
    """Pages per native call of an ``n``-page batch moving ``nbytes`` on ``pool``: the whole
    batch with one thread or under :data:`PARALLEL_MIN_BYTES`; else about an eighth of it,
    at least four pages."""
    return n if pool.threads <= 1 or 0 < nbytes < PARALLEL_MIN_BYTES else max(4, -(-n // 8))


SHARE_MIN_CHUNK_BYTES = 256 << 10  # (native/batch_io.c HL3_READ_RUN: one coalesced read)
SHARE_WAIT_MIN_NS, SHARE_WAIT_MAX_NS = 50_000, 2_000_000


def _run_batch(lib: native.BatchIO, pool: BatchPool, n: int, page_bytes: int,
               drain: Callable[[native.Share, int], bool], call: Callable[[int, int], object],
               guided: bool) -> None:
    """An ``n``-page native batch on ``pool``: ``call(lo, hi)`` on the caller's thread where
    :func:`_pages_per_call` says one call; else a :class:`~hicache_l3.slab.native.Share`
    claimed and joined in C (``drain(share, wait_ns)``), in chunks ``guided`` or fixed."""
    chunk = _pages_per_call(pool, n, n * page_bytes)
    if chunk < n:
        share, wait = _share(pool, n, page_bytes, 0 if guided else chunk)
        pool.run_shared(lambda ns: drain(share, ns), lambda: lib.share_stop(share),
                        -(-n // share.chunk), wait)
    else:
        pool.run_chunks(call, n, chunk)


def _share(pool: BatchPool, n: int, page_bytes: int, chunk: int = 0) -> tuple[native.Share, int]:
    """The share of an ``n``-page batch: ``chunk`` pages at a time, or (0) guided (what is
    left / 2x the threads, at least :data:`SHARE_MIN_CHUNK_BYTES`); and how long the calling
    thread spins for the others' chunks: the biggest chunk's time at 2 GB/s, clamped."""
    least, parts = (chunk, 0) if chunk else (max(1, SHARE_MIN_CHUNK_BYTES // max(1, page_bytes)),
                                             2 * pool.threads)
    biggest = min(n, max(least, n // parts if parts else 0))  # the first chunk claimed
    wait = min(SHARE_WAIT_MAX_NS, max(SHARE_WAIT_MIN_NS, biggest * page_bytes // 2))
    return native.Share(n, least, parts), wait
