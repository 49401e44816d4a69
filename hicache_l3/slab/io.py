"""Slot transports: how a slot's bytes move, behind one interface.

Every slab connector runs the same orchestration (:mod:`hicache_l3.slab.engine`); only
the transport differs. A transport moves a batch of slots and reports one status code per
page in the batch's ``status`` array:

* :data:`OK`; :data:`SHORT`, :data:`HEADER` (the start header or end marker does not
  carry the entry's generation and key fingerprint: torn, stale, recycled) or
  :data:`CHECKSUM` for a page that is not that key's bytes; :data:`NOMEM`;
  :data:`UNREGISTERED`; ``-errno`` for a failed syscall; :data:`FAILED` with a
  :class:`~hicache_l3.common.errors.Reason` in the batch's ``reasons`` (engine errors,
  timeouts). A page left :data:`PENDING` counts as an engine error: a transport reports
  :data:`OK` only for pages it knows have moved.

A write puts the end marker first, then the start header and data, so that a reader
overlapping it sees a new end marker; a read takes header and data first and the end
marker last, and verifies both (and the checksum where the entry has one). A checksummed
write may instead put header, data and end marker in one vectored call (the local
transports do: one syscall per page instead of two): every reader verifies the checksum
of a checksummed entry, so an overlapped read of a slot being rewritten is a miss
either way, and a write cut short leaves the old end marker after a new header.

Transports here: :class:`PythonTransport` (``preadv``/``pwritev``, the reference) and
:class:`NativeTransport` (the C batch library). :func:`select_transport` is the one
selection point; a connector's ``transport.name`` says which one it uses. The NIXL
(:mod:`hicache_l3.connectors.nixl.file`) and 3FS USRBIO (:mod:`hicache_l3.connectors.hf3fs`)
transports live with their engines.
"""

from __future__ import annotations

import abc
import array
import errno
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import key_fingerprint, page_checksum
from hicache_l3.common.pages import Page
from hicache_l3.common.parallel import BatchPool
from hicache_l3.slab import native
from hicache_l3.slab.format import (
    ALIGN,
    END,
    END_MAGIC,
    FORMAT_VERSION,
    HEADER_BLOCK,
    MARKER,
    START,
    START_MAGIC,
    Entry,
    Geometry,
    Located,
    Slot,
    check_slot,
    encode_end,
    encode_start,
)
from hicache_l3.slab.native import CHECKSUM, HEADER, NOMEM, OK, SHORT

if TYPE_CHECKING:
    from hicache_l3.slab.store import SlabStore

UNREGISTERED, FAILED, PENDING = 5, 6, 7  # PENDING: not (yet) known to have moved
_MAX_IOV = 1024  # IOV_MAX on Linux: iovecs one preadv/pwritev takes
__all__ = ["CHECKSUM", "FAILED", "HEADER", "NOMEM", "OK", "PENDING", "SHORT", "UNREGISTERED", "ReadBatch",
           "SlotTransport", "WriteBatch", "explain", "select_transport", "verify"]


class WriteBatch:
    """Pages to write into reserved slots: ``pages[j]`` of ``keys[j]`` into ``slots[j]``.

    The transport fills ``status[j]`` and, when ``checksum``, ``checksums[j]`` (the XXH3
    it wrote into the start header)."""

    __slots__ = ("checksum", "checksums", "geometry", "held", "keys", "pages", "reasons", "slots", "status")

    def __init__(self, keys: list[str], pages: list[Page], slots: list[Slot], geometry: Geometry,
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


def verify(start: bytes | memoryview, end: bytes | memoryview, entry: Entry, key: str,
           page: Page | None) -> int:
    """Status of a slot read whole: :data:`HEADER` unless header and marker carry the
    entry, :data:`CHECKSUM` when ``page`` is given and the entry's checksum differs."""
    if not check_slot(start, end, entry, key_fingerprint(key)):
        return HEADER
    if page is not None and entry.checksum and page_checksum(page) != entry.checksum:
        return CHECKSUM
    return OK


def explain(status: int) -> str:
    """Words for a failed page's status code."""
    if status < 0:
        return os.strerror(-status)
    return {SHORT: "short transfer", HEADER: "header or end marker mismatch",
            CHECKSUM: "checksum mismatch", NOMEM: "out of memory for a checksum state",
            UNREGISTERED: "page outside registered memory", PENDING: "not moved",
            }.get(status, f"status {status}")


class SlotTransport(abc.ABC):
    """How one connector moves slot bytes (module docstring). Thread-safe."""

    name: str = "transport"

    @abc.abstractmethod
    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """Write every page of ``batch`` into its slot (end marker first); fill its status
        and checksums."""

    @abc.abstractmethod
    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """Read every slot of ``batch`` into its page and verify it; fill its status."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release threads and engine resources (the store closes the files)."""


class PythonTransport(SlotTransport):
    """``os.pwritev``/``os.preadv`` straight between registered memory and the slab
    files, a ctypes XXH3 per page; the reference path. ``direct`` moves pages of one
    aligned segment with O_DIRECT (others count ``direct_fallback``)."""

    def __init__(self, regions: Any, metrics: Any, io_threads: int, *, direct: bool = False,
                 name: str = "Python I/O") -> None:
        self.regions, self.metrics, self.direct, self.name = regions, metrics, direct, name
        self._pool = self.read_pool = BatchPool(io_threads, "hicache-file")
        # one writer thread: the Python write path holds the GIL between syscalls
        self._write_pool = BatchPool(1, "hicache-file-w")

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """Each page: end marker (``pwrite``), then header and data (one ``pwritev``); when
        checksumming, header, data and end marker in one ``pwritev`` (module docstring)."""
        geometry = batch.geometry
        nbytes, stride = geometry.slot_bytes, geometry.stride
        head, tail = HEADER_BLOCK - MARKER, HEADER_BLOCK + nbytes
        whole = 2 * MARKER + nbytes
        keys, pages, slots = batch.keys, batch.pages, batch.slots
        status, checksums, checksum, direct = batch.status, batch.checksums, batch.checksum, self.direct
        views_of, pwrite, pwritev = self.regions.views, os.pwrite, os.pwritev
        cut = self.regions.batch_views(pages)  # the common case, cut at once
        me = store.me or 0  # reserve made this process a writer

        def write(lo: int, hi: int) -> None:
            for j in range(lo, hi):
                fd, slab, slot, gen = slots[j]
                page = pages[j]
                views = cut[j] if cut is not None else views_of(page)
                if views is None:
                    status[j] = UNREGISTERED
                    continue
                csum = page_checksum(page) if checksum else 0
                fp = key_fingerprint(keys[j])
                start = encode_start(gen, nbytes, csum, fp)
                base = slot * stride
                try:
                    if direct and _aligned(page):
                        pwrite(fd, encode_end(gen, fp), base + tail)
                        dfd = store.fd(me, slab, direct=True)
                        ok = pwritev(dfd, views, base + HEADER_BLOCK) == nbytes
                        ok = ok and pwrite(fd, start, base + head) == MARKER
                    elif checksum and len(views) < _MAX_IOV - 1:  # one call: the checksum covers it
                        if direct:
                            self.metrics.count("direct_fallback")
                        ok = pwritev(fd, [start, *views, encode_end(gen, fp)], base + head) == whole
                    else:
                        if direct:
                            self.metrics.count("direct_fallback")
                        pwrite(fd, encode_end(gen, fp), base + tail)
                        ok = pwritev(fd, [start, *views], base + head) == MARKER + nbytes
                except OSError as exc:
                    status[j] = -(exc.errno or errno.EIO)
                    continue
                status[j] = OK if ok else SHORT
                checksums[j] = csum

        self._write_pool.map(write, len(keys))

    def read(self, store: SlabStore, batch: ReadBatch, work: Sequence[int] | None = None) -> None:
        """Each page (or those of ``work``): header, data and end marker in one ``preadv``
        (header and data only when the checksum covers a torn read), then verified."""
        self.read_some(store, batch, range(len(batch.keys)) if work is None else work)

    def read_some(self, store: SlabStore, batch: ReadBatch, work: Sequence[int]) -> None:
        """:meth:`read` of the pages ``work`` of ``batch`` only."""
        geometry = batch.geometry
        nbytes, stride = geometry.slot_bytes, geometry.stride
        head = HEADER_BLOCK - MARKER
        expect, expect_data = 2 * MARKER + nbytes, MARKER + nbytes
        direct = self.direct
        keys, pages, located, status = batch.keys, batch.pages, batch.located, batch.status
        views_of, preadv = self.regions.views, os.preadv
        cut = self.regions.batch_views([pages[j] for j in work])  # the common case, cut at once
        pack_start, fingerprint, checksum_of = START.pack, key_fingerprint, page_checksum

        def read(lo: int, hi: int) -> None:
            scratch = memoryview(bytearray(2 * MARKER))
            start, end = scratch[:MARKER], scratch[MARKER:]
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
    call with the GIL released each, claimed by whichever I/O thread is free. Pages without
    a checksum need their end marker checked after the data: those go through ``python``,
    the same bytes either way."""

    name = "native batch I/O (C)"

    def __init__(self, lib: native.BatchIO, python: PythonTransport, write_threads: int) -> None:
        self.lib, self.python = lib, python
        self._pool = python.read_pool
        self._write_pool = BatchPool(write_threads, "hicache-file-w")

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """One :class:`~hicache_l3.slab.native.PageBatch`, its shares written in parallel."""
        geometry, slots, lib = batch.geometry, batch.slots, self.lib
        nbytes, stride = geometry.slot_bytes, geometry.stride
        head, tail = HEADER_BLOCK - MARKER, HEADER_BLOCK + nbytes
        fps = list(map(key_fingerprint, batch.keys))
        gens = [s[3] for s in slots]
        heads = [s[2] * stride + head for s in slots]
        pack_start, pack_end = START.pack, END.pack
        pb = native.PageBatch(
            MARKER, [s[0] for s in slots], heads, batch.pages,
            [pack_start(START_MAGIC, FORMAT_VERSION, 0, g, nbytes, 0, fp) for g, fp in zip(gens, fps)],
            ends=[pack_end(END_MAGIC, g, fp) for g, fp in zip(gens, fps)],
            end_offsets=[h + (tail - head) for h in heads],
        )
        checksum = batch.checksum
        n = len(pb)
        self._write_pool.run_chunks(lambda lo, hi: lib.write(pb, lo, hi, checksum), n, _chunk(n))
        batch.status, batch.checksums = pb.status, pb.checksums

    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """Checksummed pages through the library; the others through the Python path."""
        located = batch.located
        entries = [loc[1] for loc in located]
        sums = [e[5] for e in entries]
        if all(sums):  # the common batch: every page checksummed, all through the library
            work: Sequence[int] = range(len(located))
            fds, keys, pages = [loc[0] for loc in located], batch.keys, batch.pages
        else:
            plain = [j for j, c in enumerate(sums) if not c]
            self.python.read_some(store, batch, plain)
            if len(plain) == len(located):
                return
            work = [j for j, c in enumerate(sums) if c]
            entries, sums = [entries[j] for j in work], [sums[j] for j in work]
            fds = [located[j][0] for j in work]
            keys, pages = [batch.keys[j] for j in work], [batch.pages[j] for j in work]
        nbytes, stride = batch.geometry.slot_bytes, batch.geometry.stride
        head = HEADER_BLOCK - MARKER
        pack_start, lib = START.pack, self.lib
        pb = native.PageBatch(
            MARKER, fds, [e[2] * stride + head for e in entries], pages,
            [pack_start(START_MAGIC, FORMAT_VERSION, 0, e[3], nbytes, e[5], fp)
             for e, fp in zip(entries, map(key_fingerprint, keys))],
            sums,
        )
        self._pool.run_chunks(lambda lo, hi: lib.read(pb, lo, hi), len(pb), _chunk(len(pb)))
        if isinstance(work, range):
            batch.status = pb.status
            return
        status = batch.status
        for k, j in enumerate(work):
            status[j] = pb.status[k]

    def close(self) -> None:
        """Stop the I/O threads (and the Python path's)."""
        self._write_pool.shutdown()
        self.python.close()


def select_transport(regions: Any, metrics: Any, log: Any, *, native_io: bool, direct: bool,
                     io_threads: int, write_threads: int, label: str) -> SlotTransport:
    """The one selection point for local slab I/O: the C batch library when ``native_io``
    asks for it, it loads, and ``direct`` is off (O_DIRECT pages take the Python path);
    the Python path otherwise, named with the reason."""
    if not native_io:
        return PythonTransport(regions, metrics, io_threads, direct=direct)
    if direct:
        return PythonTransport(regions, metrics, io_threads, direct=True,
                               name="Python I/O (o_direct)")
    lib = native.library()
    if lib is None:
        log.warning("native-io", "%s: %s; moving pages through the Python path (about half as "
                    "fast on 64 KiB pages)", label, native.describe())
        return PythonTransport(regions, metrics, io_threads, name=native.describe())
    return NativeTransport(lib, PythonTransport(regions, metrics, io_threads), write_threads)


def _chunk(n: int) -> int:
    """Pages per native call of an ``n``-page batch: about eight chunks, so that an I/O thread
    the scheduler starts late takes fewer of them (:meth:`BatchPool.run_chunks`), at least
    four pages so the call's own cost stays small."""
    return max(4, -(-n // 8))


def _aligned(page: Page) -> bool:
    return len(page) == 1 and page[0][0] % ALIGN == 0 and page[0][1] % ALIGN == 0
