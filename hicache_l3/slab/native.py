"""The C library ``hicache_l3._batch_io``: the one place its calls are declared (ctypes), and
its loader. Loaded on the first :func:`library` call, never at import, and self-tested then
against the Python references; required (docs/architecture.md, "The C library"): one not
built, built for another slab format (``hl3_abi``) or failing its self-test is an
ImportError naming the fix.

:class:`BatchIO` holds the page I/O calls (GIL released: a share of a batch per call, data,
marker records, their checks and XXH3 checksums), the io_uring and NIXL-row calls, and
:attr:`BatchIO.index`, the page table's, records' and eviction's calls (:class:`IndexCalls`).
A :class:`PageBatch` is built from per-page lists; :attr:`PageBatch.status` then holds one
code per page (:data:`OK`, :data:`SHORT`, :data:`HEADER`, :data:`CHECKSUM`, :data:`NOMEM` or
``-errno``).
"""

from __future__ import annotations

import array
import ctypes
import functools
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from itertools import accumulate, chain, repeat
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

import xxhash

from hicache_l3.common.integrity import key_fingerprint, page_checksum, xxh3_function
from hicache_l3.common.keys import BUILD_HINT
from hicache_l3.common.pages import Page
from hicache_l3.slab.format import (
    _GROUP_SHIFT,
    PUT,
    RECORD,
    RECORD_BYTES,
    Entry,
    Geometry,
    encode_markers,
    encode_puts,
    encode_record,
)


class PlannedRead(Protocol):
    """What :meth:`BatchIO.plan_read` reads of a :class:`~hicache_l3.slab.plan.GetPlan`."""

    count: int
    fds: array.array[int]
    data_offs: array.array[int]
    marker_offs: array.array[int]
    expect: bytearray
    csums: array.array[int]


OK, SHORT, HEADER, CHECKSUM, NOMEM = 0, 1, 2, 3, 4
AGAIN = 5  # a nowait read's page not (all) in the page cache: not read (BatchIO.read_plan)
ABI = 2  # hl3_abi() of a library this module can call (slab format 2)

_vp, _i32, _i64, _u64, _sz = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t
_int, _long, _str = ctypes.c_int, ctypes.c_long, ctypes.c_char_p
DIGEST_SEED = 0x6869636163686533  # the page table's digest seed ("hicache3"); never change it


def _bind(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> Any:
    """``lib``'s function ``name``, typed."""
    f = getattr(lib, name)
    f.restype, f.argtypes = restype, list(argtypes)
    return f


_XXH3_ROLES = ("one", "create", "free", "reset", "update", "digest")  # the C struct's order


class _XXH3(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _XXH3_ROLES]


def _xxh3_entry_points() -> ctypes.Structure:
    """The xxhash wheel's XXH3 entry points as the C library's ``struct hl3_xxh3`` (it holds
    no XXH3 of its own: its checksums are the wheel's)."""
    return _XXH3(*(ctypes.cast(xxh3_function(role), ctypes.c_void_p).value for role in _XXH3_ROLES))


def address_of(buf: array.array | bytearray) -> int:
    """The address of ``buf``'s first byte (0 when it is empty), valid while it lives."""
    if isinstance(buf, array.array):
        return buf.buffer_info()[0] if buf else 0
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


def _bytes_address(data: bytes) -> int:
    """The address of ``data``'s bytes (valid while ``data`` lives; the C calls only read
    them)."""
    return ctypes.cast(ctypes.c_char_p(data), _vp).value or 0


class PageBatch:
    """The flat arrays one native call walks, built once per batch from per-page lists.

    Page ``j``'s data are the segments ``pages[j]`` at file offset ``data_offsets[j]`` of
    ``fds[j]``; its marker record (``marker_len`` bytes) is at ``marker_offsets[j]``
    (slab format 2: :mod:`hicache_l3.slab.format`). For a read (``writing`` false),
    ``markers[j]`` is the record the slot must carry, ``checksums[j]`` (0 = none) the XXH3
    its segments must hash to, and the records read land in scratch space. For a write,
    ``markers[j]`` is the record to write before the data (its checksum field is filled in
    when checksumming, and the checksum lands in :attr:`checksums`). :attr:`status` holds
    one code per page once a call has covered it.
    """

    def __init__(self, marker_len: int, fds: list[int], data_offsets: list[int],
                 marker_offsets: list[int], pages: Sequence[Page], markers: list[bytes],
                 checksums: list[int] | None = None, *, writing: bool) -> None:
        n = len(fds)
        if not (len(data_offsets) == len(marker_offsets) == len(pages) == len(markers) == n):
            raise ValueError("PageBatch: fds, offsets, pages and markers differ in length")
        self.marker_len, self.writing = marker_len, writing
        self.fds = array.array("i", fds)
        self.data_offsets = array.array("q", data_offsets)
        self.marker_offsets = array.array("q", marker_offsets)
        self.segments, self.at = flat_segments(pages)
        self.checksums = array.array("Q", checksums if checksums is not None else bytes(8 * n))
        joined = bytearray(b"".join(markers))
        if len(joined) != n * marker_len:
            raise ValueError(f"PageBatch: every marker record must be {marker_len} bytes")
        # a write sends `markers`; a read lands the records in `markers` and compares `expect`
        self.markers, self.expect = (joined, bytearray()) if writing else (bytearray(len(joined)), joined)
        self._addressed()

    def __len__(self) -> int:
        return len(self.fds)

    @classmethod
    def for_write(cls, marker_len: int, fds: array.array[int], data_offsets: array.array[int],
                  marker_offsets: array.array[int], pages: Sequence[Page], markers: bytearray) -> PageBatch:
        """A write batch from arrays already in the C layout (``fds`` int32, offsets int64,
        ``markers`` the records back to back), taken as they are (the write fills the
        records' checksum fields in)."""
        n = len(fds)
        if not (len(data_offsets) == len(marker_offsets) == len(pages) == n) \
                or len(markers) != n * marker_len or (fds.typecode, data_offsets.typecode,
                                                      marker_offsets.typecode) != ("i", "q", "q"):
            raise ValueError("PageBatch.for_write: arrays differ in length or type")
        self = cls.__new__(cls)
        self.marker_len, self.writing = marker_len, True
        self.fds, self.data_offsets, self.marker_offsets = fds, data_offsets, marker_offsets
        self.segments, self.at = flat_segments(pages)
        self.checksums = array.array("Q", bytes(8 * n))
        self.markers, self.expect = markers, bytearray()
        return self._addressed()

    def _addressed(self) -> PageBatch:
        """A status per page and the addresses the C calls take (the arrays never grow)."""
        self.status = array.array("i", bytes(4 * len(self.fds)))
        self.addresses = (address_of(self.fds), address_of(self.data_offsets),
                          address_of(self.marker_offsets), address_of(self.segments), address_of(self.at),
                          address_of(self.markers))
        self.expect_at = address_of(self.expect)
        self.checksums_at, self.status_at = address_of(self.checksums), address_of(self.status)
        return self


def flat_segments(pages: Sequence[Page]) -> tuple[array.array[int], array.array[int]]:
    """``(segments, at)`` of ``pages`` as the C calls walk them: every segment as flat
    uint64 ``(address, length)`` pairs, and each page's first segment index (``n + 1``
    int32 bounds)."""
    n = len(pages)
    flat = getattr(pages, "segments", None)
    if flat is not None and len(flat) == 16 * pages.per * n:  # type: ignore[attr-defined]
        per = pages.per  # type: ignore[attr-defined]
        segments = array.array("Q")
        segments.frombytes(flat)
        return segments, array.array("i", range(0, per * n + 1, per))
    return (array.array("Q", chain.from_iterable(chain.from_iterable(pages))),
            array.array("i", accumulate(map(len, pages), initial=0)))


@functools.lru_cache(maxsize=64)
def _uniform_at(per: int, n: int) -> array.array[int]:
    """The ``at`` bounds of ``n`` pages of ``per`` segments each, once per shape."""
    return array.array("i", range(0, per * n + 1, per))


def plan_segments(pages: Sequence[Page]) -> tuple[bytes | array.array[int], array.array[int]]:
    """:func:`flat_segments` without a copy where it can: a
    :class:`~hicache_l3.common.pages.FlatPages`' segments as they are."""
    flat = getattr(pages, "segments", None)
    if flat is not None and len(flat) == 16 * pages.per * len(pages):  # type: ignore[attr-defined]
        return flat, _uniform_at(pages.per, len(pages))  # type: ignore[attr-defined]
    return flat_segments(pages)


class PlanRead(NamedTuple):
    """One planned read's call (:meth:`BatchIO.plan_read`): its status array, the C call's
    arguments after ``lo, hi``, and the objects whose memory they address."""

    status: array.array[int]
    args: array.array[int]  # int64 addresses and lengths
    keep: tuple[object, ...]


class Share:
    """One batch shared by threads (``struct hl3_share``): ``pages`` pages claimed in chunks by
    whichever thread calls next, ``chunk`` pages at a time or, with ``parts``, what is left
    / ``parts`` and at least ``chunk``. Every thread that may call into it must hold a
    reference to it until its call returned."""

    __slots__ = ("_state", "address", "chunk", "pages", "parts")

    def __init__(self, pages: int, chunk: int, parts: int = 0) -> None:
        if pages < 1 or chunk < 1 or parts < 0:
            raise ValueError(f"a share of {pages} pages in chunks of at least {chunk} ({parts} parts)")
        self.pages, self.chunk, self.parts = pages, chunk, parts
        self._state = array.array("q", (0, 0, pages, chunk, parts, 0))
        self.address = self._state.buffer_info()[0]

    @property
    def done(self) -> int:
        """Pages of the chunks finished so far."""
        return self._state[1]

    @property
    def spins(self) -> int:
        """Loops of the calling thread's wait (its cost, for benchmarks)."""
        return self._state[5]


class BatchIO:
    """The loaded C library (see module docstring); one instance per process."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path, use_errno=True)  # (errno: a ring refused, hl3_ring_open)
        abi = getattr(lib, "hl3_abi", None)
        if abi is None or abi() != ABI:
            raise RuntimeError(f"{path} was built for another slab format (hl3_abi "
                               f"{'missing' if abi is None else abi()}, want {ABI}): rebuild it "
                               "(pip install ., or setup.py build_ext --inplace)")
        # the arguments after each call's own: a batch's descriptors to its status
        read_tail, plan_tail = [*[_vp] * 7, _i64, *[_vp] * 3], [*[_vp] * 6, _i64, *[_vp] * 3]
        write_tail = [*[_vp] * 6, _i64, _i32, *[_vp] * 3]
        self._read = _bind(lib, "hl3_read_pages", _int, _i32, _i32, *read_tail)
        self._write = _bind(lib, "hl3_write_pages", _int, _i32, _i32, *write_tail)
        self._read_apart = _bind(lib, "hl3_read_pages_apart", _int, _i32, _i32, _vp, *read_tail)
        self._write_apart = _bind(lib, "hl3_write_pages_apart", _int, _i32, _i32, _vp, *write_tail)
        self._read_plan = _bind(lib, "hl3_read_plan", _int, _i32, _i32, *plan_tail)
        self._read_plan_nowait = _bind(lib, "hl3_read_plan_nowait", _int, _i32, _i32, *plan_tail)
        # one batch shared by threads, joined in C
        self._share_read_plan = _bind(lib, "hl3_share_read_plan", _int, _vp, _i64, _i32, *plan_tail)
        self._share_write = _bind(lib, "hl3_share_write_pages", _int, _vp, _i64, *write_tail)
        self._share_stop = _bind(lib, "hl3_share_stop", None, _vp)
        self.markers = _bind(lib, "hl3_markers", _int, _i32, _i32, _i32, _vp, _vp, _vp, _vp, _i64, _vp)
        # io_uring (slab/uring.py)
        self.ring_open = _bind(lib, "hl3_ring_open", _vp, _int)
        self.ring_close = _bind(lib, "hl3_ring_close", None, _vp)
        self.ring_read = _bind(lib, "hl3_ring_read", _int, _vp, _i32, _i32, _i32, *[_vp] * 7, _i64,
                               *[_vp] * 3)
        self.ring_write = _bind(lib, "hl3_ring_write", _int, _vp, _i32, _i32, *[_vp] * 7, _i64, _i32,
                                *[_vp] * 3)
        # NIXL file mode's rows and checksums (connectors/nixl/batch_lib.py)
        self.join_rows = _bind(lib, "hl3_join_rows", _i64, _int, *[_vp] * 6, _i64)
        self.check_sums = _bind(lib, "hl3_check_sums", _int, _int, _int, *[_vp] * 5)
        self._xxh3 = _xxh3_entry_points()
        self.xxh3_at = ctypes.addressof(self._xxh3)
        self.index = IndexCalls(path)

    def read(self, batch: PageBatch, lo: int, hi: int, data_fds: array.array[int] | None = None) -> int:
        """Read pages ``lo..hi-1`` of a read batch (data, then marker records, then the
        checks), page ``j``'s data from ``data_fds[j]`` when given (int32: an O_DIRECT
        descriptor); the number not OK (0 for an empty share)."""
        if not _share(batch, lo, hi, "read", not batch.writing):
            return 0
        tail = (*batch.addresses, batch.expect_at, batch.marker_len, batch.checksums_at, self.xxh3_at,
                batch.status_at)
        if data_fds is None:
            return int(self._read(lo, hi, *tail))
        return int(self._read_apart(lo, hi, address_of(data_fds), *tail))

    def write(self, batch: PageBatch, lo: int, hi: int, checksum: bool,
              data_fds: array.array[int] | None = None) -> int:
        """Write pages ``lo..hi-1`` of a write batch (marker records first, then the data,
        to ``data_fds[j]`` when given), checksumming them first when ``checksum``; the
        number not OK (0 for an empty share)."""
        if not _share(batch, lo, hi, "write", batch.writing):
            return 0
        if data_fds is None:
            return int(self._write(lo, hi, *self._write_tail(batch, checksum)))
        return int(self._write_apart(lo, hi, address_of(data_fds), *self._write_tail(batch, checksum)))

    def plan_read(self, plan: PlannedRead, pages: Sequence[Page]) -> PlanRead:
        """The call :meth:`read_plan` makes for ``plan``'s pages into ``pages`` (page ``j`` into
        ``pages[j]``), the plan's arrays taken as they are; ValueError when lengths differ."""
        n = plan.count
        segments, at = plan_segments(pages)
        if len(pages) != n or len(plan.fds) != n or len(plan.expect) != n * RECORD_BYTES:
            raise ValueError(f"read_plan: {len(pages)} pages for a plan of {n}")
        status = array.array("i", bytes(4 * n))
        args = (plan.fds.buffer_info()[0], plan.data_offs.buffer_info()[0], plan.marker_offs.buffer_info()[0],
                _bytes_address(segments) if isinstance(segments, bytes) else address_of(segments),
                at.buffer_info()[0], address_of(plan.expect), RECORD_BYTES, plan.csums.buffer_info()[0],
                self.xxh3_at, status.buffer_info()[0])
        return PlanRead(status, array.array("q", args), (segments, at, plan))

    def read_plan(self, call: PlanRead, lo: int, hi: int, nowait: bool = False) -> int:
        """The read and checks of :meth:`read` of pages ``lo..hi-1`` of ``call``
        (:meth:`plan_read`); the number not OK. With ``nowait`` only what the page cache
        holds is read: a page that would wait for the disk is left :data:`AGAIN` (counted)."""
        if lo == hi:
            return 0
        if not 0 <= lo < hi <= len(call.status):
            raise ValueError(f"read of pages [{lo}, {hi}) of a {len(call.status)}-page plan")
        fn = self._read_plan_nowait if nowait else self._read_plan
        return int(fn(lo, hi, *call.args))

    def share_read_plan(self, share: Share, call: PlanRead, wait_ns: int, nowait: bool = False) -> bool:
        """:meth:`read_plan` of every chunk of ``share`` this thread claims, then, when
        ``wait_ns`` > 0, a spin of up to that long (without the GIL) for the others' chunks.
        True when every chunk had finished on return."""
        if share.pages != len(call.status):
            raise ValueError(f"a share of {share.pages} pages for a {len(call.status)}-page plan")
        return bool(self._share_read_plan(share.address, wait_ns, int(nowait), *call.args))

    def share_write(self, share: Share, batch: PageBatch, wait_ns: int, checksum: bool) -> bool:
        """:meth:`write` of every chunk of ``share`` this thread claims
        (``hl3_share_write_pages``), then the wait of :meth:`share_read_plan`; same result."""
        if share.pages != len(batch) or not batch.writing:
            raise ValueError(f"a write share of {share.pages} pages for a {len(batch)}-page "
                             f"{'write' if batch.writing else 'read'} batch")
        return bool(self._share_write(share.address, wait_ns, *self._write_tail(batch, checksum)))

    def _write_tail(self, batch: PageBatch, checksum: bool) -> tuple[int, ...]:
        """The arguments every write call takes after its own (``lo, hi`` or the share's):
        the batch's descriptors to its status."""
        return (*batch.addresses, batch.marker_len, int(checksum), batch.checksums_at, self.xxh3_at,
                batch.status_at)

    def share_stop(self, share: Share) -> None:
        """No chunk of ``share`` is claimed after this (``hl3_share_stop``)."""
        self._share_stop(share.address)

    def write_markers(self, fds: Sequence[int], offsets: Sequence[int], markers: bytes,
                      length: int) -> array.array[int]:
        """``pwrite`` marker ``j`` (``markers[j * length : (j + 1) * length]``) at
        ``offsets[j]`` of ``fds[j]``, for every ``j``, in one call with the GIL released;
        one status per marker (:data:`OK`, :data:`SHORT` or ``-errno``)."""
        return self._marker_call(1, fds, offsets, bytearray(markers), None, length)

    def read_markers(self, fds: Sequence[int], offsets: Sequence[int], expect: bytes,
                     length: int) -> array.array[int]:
        """``pread`` marker ``j`` (``length`` bytes at ``offsets[j]`` of ``fds[j]``) for every
        ``j`` in one call with the GIL released, each compared with
        ``expect[j * length : (j + 1) * length]``; one status per marker (:data:`OK`,
        :data:`SHORT`, :data:`HEADER` when the bytes differ, or ``-errno``)."""
        return self._marker_call(0, fds, offsets, bytearray(len(expect)), bytearray(expect), length)

    def _marker_call(self, writing: int, fds: Sequence[int], offsets: Sequence[int], bufs: bytearray,
                     expect: bytearray | None, length: int) -> array.array[int]:
        n = len(fds)
        if len(offsets) != n or len(bufs) != n * length or length <= 0:
            raise ValueError(f"markers: {n} fds, {len(offsets)} offsets, {len(bufs)} bytes of "
                             f"{length}-byte markers")
        status = array.array("i", bytes(4 * n))
        if n:
            fd_arr, off_arr = array.array("i", fds), array.array("q", offsets)
            self.markers(writing, 0, n, address_of(fd_arr), address_of(off_arr), address_of(bufs),
                          address_of(expect) if expect is not None else None, length, address_of(status))
        return status


def _share(batch: PageBatch, lo: int, hi: int, op: str, fits: bool) -> bool:
    """True for a non-empty share ``[lo, hi)`` of a batch built for ``op`` (``fits``); False
    for an empty one; ValueError for a share out of range or a batch built for the other op."""
    if lo == hi and 0 <= lo <= len(batch):
        return False
    if not fits or not 0 <= lo < hi <= len(batch):
        raise ValueError(f"{op} of pages [{lo}, {hi}) of a {len(batch)}-page batch")
    return True


class SetMarkers(NamedTuple):
    """What a set batch writes before its data, in the C batch's layout: ``records`` (the
    128-byte marker records back to back, checksum fields 0), ``data_offsets`` and
    ``marker_offsets`` (int64, :meth:`~hicache_l3.slab.format.Geometry.offsets`)."""

    records: bytearray
    data_offsets: array.array[int]
    marker_offsets: array.array[int]


@functools.lru_cache(maxsize=16)
def marker_geometry(geometry: Geometry) -> array.array[int]:
    """The geometry array ``hl3_write_markers`` reads (never writes), once per geometry."""
    return array.array("q", (_GROUP_SHIFT, geometry.table, geometry.data_stride,
                             (1 << _GROUP_SHIFT) * geometry.data_stride, RECORD_BYTES))


class IndexCalls:
    """The page table's, records' and eviction's calls (``page_table.c``, ``records.c``,
    ``evict.c``...) through ``ctypes.PyDLL``: the GIL stays held during each (short) call, so
    threads see every call as atomic. The ``build_*`` calls, :attr:`free`,
    :attr:`write_image` and :attr:`write_spans` run without it, on tables no other thread
    uses. The methods return None where C does not take their input (the caller's
    reference path then)."""

    def __init__(self, path: str) -> None:
        if sys.byteorder != "little" or ctypes.sizeof(ctypes.c_size_t) != 8:
            raise RuntimeError("the C index calls need a 64-bit little-endian host")
        held, free = ctypes.PyDLL(path), ctypes.CDLL(path)
        self.new = _bind(held, "hl3_pt_new", _vp)
        self.len = _bind(held, "hl3_pt_len", _sz, _vp)
        self.nbytes = _bind(held, "hl3_pt_nbytes", _sz, _vp)
        self.reserve = _bind(held, "hl3_pt_reserve", _int, _vp, _u64)
        self.expect = _bind(held, "hl3_pt_expect", None, _vp, _u64)
        self.check = _bind(held, "hl3_pt_check", _int, _vp)
        self.put_many = _bind(held, "hl3_pt_put_many", _int, _vp, _sz, _str, _vp)
        self.get_many = _bind(held, "hl3_pt_get_many", _sz, _vp, _sz, _str, _vp, _vp)
        self.pop_many = _bind(held, "hl3_pt_pop_many", _sz, _vp, _sz, _str)
        self.pop = _bind(held, "hl3_pt_pop", _int, _vp, _str, _vp)
        self.at = _bind(held, "hl3_pt_at", _int, _vp, _u64, _u64, _u64, _vp)
        self.at_many = _bind(held, "hl3_pt_at_many", _sz, _vp, _sz, _vp, _vp, _vp)
        self.select = _bind(held, "hl3_pt_select", _sz, _vp, _i64, _i64, _vp, _vp, _sz)
        self.slots = _bind(held, "hl3_pt_slots", _sz, _vp, _vp, _vp, _sz)
        self.live_puts = _bind(held, "hl3_pt_live_puts", _long, _vp, _str, _sz, _u64, _vp, _vp, _vp, _sz)
        self.plan_get = _bind(held, "hl3_pt_plan_get", _long, _vp, _sz, _str, _sz, _u64, _vp, _vp, _int,
                              *[_vp] * 10)
        self.plan_fds = _bind(held, "hl3_plan_fds", None, _sz, _vp, _vp, _vp, _vp)
        self.delta_len = _bind(held, "hl3_pt_delta_len", _sz, _vp)
        self.shared_nbytes = _bind(held, "hl3_pt_shared_nbytes", _sz, _vp)
        self.attach = _bind(held, "hl3_pt_attach", _int, _vp, _int, _u64, _u64)
        self.rebase = _bind(held, "hl3_pt_rebase", _int, _vp, _int, _u64, _u64)
        self.image_bytes = _bind(held, "hl3_pt_image_bytes", _sz, _vp)
        self.fork = _bind(held, "hl3_pt_fork", _vp, _vp)
        self.journal_start = _bind(held, "hl3_pt_journal_start", _int, _vp)
        self.journal_stop = _bind(held, "hl3_pt_journal_stop", None, _vp)
        self.journal_replay = _bind(held, "hl3_pt_journal_replay", _int, _vp, _vp)
        self.journal_len = _bind(held, "hl3_pt_journal_len", _sz, _vp)
        self.journal_has = _bind(held, "hl3_pt_journal_has", _int, _vp)
        self.journal_take = _bind(held, "hl3_pt_journal_take", _vp, _vp)
        self.journal_free = _bind(held, "hl3_pt_journal_free", None, _vp)
        self.build_put_many = _bind(free, "hl3_pt_put_many", _int, _vp, _sz, _str, _vp)
        self.build_reserve = _bind(free, "hl3_pt_reserve", _int, _vp, _u64)
        self.write_image = _bind(free, "hl3_pt_write_image", _int, _vp, _int, _u64)
        self.build_rebase = _bind(free, "hl3_pt_rebase", _int, _vp, _int, _u64, _u64)
        self.build_flatten = _bind(free, "hl3_pt_flatten", _vp, _vp, _sz, _str, _vp)
        self.build_journal_apply = _bind(free, "hl3_pt_journal_apply", _int, _vp, _vp)
        self.free = _bind(free, "hl3_pt_free", None, _vp)  # (unmapping a big base need not hold the GIL)
        self.build_attach = _bind(free, "hl3_pt_attach", _int, _vp, _int, _u64, _u64)
        self.build_live_puts = _bind(free, "hl3_pt_live_puts", _long, _vp, _str, _sz, _u64, *[_vp] * 3, _sz)
        self.write_spans = _bind(free, "hl3_write_spans", _long, _int, _str, _vp, _vp, _sz)
        self._encode = _bind(held, "hl3_encode_puts", _long, _sz, _str, _vp, _vp, _vp, _sz)
        self._encode_nl = _bind(held, "hl3_encode_puts_nl", _long, _sz, _str, _sz, _vp, _vp, _sz)
        self._markers = _bind(held, "hl3_write_markers", _long, _sz, _str, _sz, *[_vp] * 3, _u64, *[_vp] * 4)
        self._digests = _bind(held, "hl3_key_digests", _long, _sz, _str, _sz, _vp, _u64, _vp)
        self._take_run = _bind(held, "hl3_pt_take_run", _sz, _vp, _u64, _u64, _u64, _sz, _vp, _vp)
        self.seeded128 = ctypes.cast(xxh3_function("seeded128"), _vp).value

    def encode_puts(self, keys: Sequence[str], values: array.array[int]) -> bytes | None:
        """The PUT records of ``keys`` with the entries ``values`` (``array('Q')``, six each):
        :func:`~hicache_l3.slab.format.encode_puts`'s bytes, or None."""
        n = len(keys)
        if len(values) != 6 * n or values.typecode != "Q":
            return None
        blob = "".join(keys).encode()
        if len(blob) == sum(map(len, keys)):  # all ASCII: one encode
            ends = array.array("Q", accumulate(map(len, keys)))
        else:
            kbs = [k.encode() for k in keys]
            blob = b"".join(kbs)
            ends = array.array("Q", accumulate(map(len, kbs)))
        cap = RECORD.size * n + len(blob)
        out = ctypes.create_string_buffer(cap)
        got = self._encode(n, blob, ends.buffer_info()[0], values.buffer_info()[0], out, cap)
        return out.raw if got == cap else None

    def encode_lines(self, keys: Sequence[str], values: array.array[int]) -> bytes | None:
        """:meth:`encode_puts` with the keys passed as ``\\n``-ended lines (None also where a
        key holds a newline)."""
        n, blob = len(keys), _lines(keys)
        if blob is None or len(values) != 6 * n or values.typecode != "Q":
            return None
        cap = RECORD.size * n + len(blob) - n
        out = ctypes.create_string_buffer(cap)
        got = self._encode_nl(n, blob, len(blob), values.buffer_info()[0], out, cap)
        return out.raw if got == cap else None

    def key_digests(self, keys: Sequence[str]) -> tuple[bytes, bool | None] | None:
        """The keys' table digests (seeded XXH3-128) back to back, and whether they are all
        different (None: not known); None where a key holds a newline or is not encodable."""
        blob = _lines(keys)
        if blob is None:
            return None
        out = bytearray(16 * len(keys))
        code = self._digests(len(keys), blob, len(blob), self.seeded128, DIGEST_SEED, address_of(out))
        return (bytes(out), (True, False, None)[code]) if code in (0, 1, 2) else None

    def write_markers(self, keys: Sequence[str], gens: array.array[int], slots: array.array[int],
                      geometry: Geometry) -> SetMarkers | None:
        """The marker records (checksum 0) and offsets of a set batch writing ``keys[j]``
        into slot ``slots[j]`` with generation ``gens[j]`` (``array('Q')``); None where a key
        is not ASCII or holds a newline."""
        n = len(keys)
        try:
            blob = ("\n".join(keys) + "\n").encode("ascii")
        except UnicodeEncodeError:
            return None
        if len(gens) != n or len(slots) != n or gens.typecode != "Q" or slots.typecode != "Q":
            return None
        out = SetMarkers(bytearray(RECORD_BYTES * n), array.array("q", bytes(8 * n)),
                         array.array("q", bytes(8 * n)))
        if self._markers(n, blob, len(blob), self.seeded128, gens.buffer_info()[0], slots.buffer_info()[0],
                         geometry.slot_bytes, marker_geometry(geometry).buffer_info()[0],
                         address_of(out.records), out.data_offsets.buffer_info()[0],
                         out.marker_offsets.buffer_info()[0]) != 0:
            return None
        return out

    def take_run(self, table: int, writer: int, slab: int, first: int,
                 count: int) -> tuple[bytes, array.array[int]]:
        """Remove the pages of slots ``first .. first + count - 1`` of (``writer``, ``slab``)
        from table handle ``table``: their digests back to back and entries six values each."""
        ds = ctypes.create_string_buffer(16 * count)
        values = array.array("Q", bytes(48 * count))
        hits = self._take_run(table, writer, slab, first, count, ds,
                              values.buffer_info()[0] if count else None)
        if hits < count:
            del values[6 * hits:]
        return ds.raw[: 16 * hits], values


def _lines(keys: Sequence[str]) -> bytes | None:
    """The keys as UTF-8, each followed by a newline, or None when one cannot be encoded."""
    try:
        return ("\n".join(keys) + "\n").encode()
    except UnicodeEncodeError:
        return None


def _self_test(io: BatchIO) -> None:
    """Every view of the library against its Python reference (RuntimeError on a
    disagreement)."""
    _check_io(io)
    _check_index(io.index)
    local, remote = array.array("Q", bytes(72)), array.array("Q", bytes(72))
    segs = array.array("Q", (4096, 100, 4196, 60, 9000, 8))  # pages 0 and 1 continue each other
    at, fds = array.array("i", (0, 1, 2, 3)), array.array("i", (7, 7, 7))
    offs = array.array("q", (0, 100, 500))
    got = io.join_rows(3, *map(address_of, (segs, at, fds, offs, local, remote)), 1 << 20)
    if got != 2 or list(local[:6]) != [4096, 160, 0, 9000, 8, 0] \
            or list(remote[:6]) != [0, 160, 7, 500, 8, 7]:
        raise RuntimeError("hl3_join_rows disagrees with the reference")


def _check_index(ix: IndexCalls) -> None:
    keys = ["a", "key-é", "", "x" * 300]
    entries = [Entry(0, 1, 2, 3, 4, 5), Entry(7, 0, 9, 1 << 40, 65536, (1 << 64) - 1),
               Entry(0, 0, 0, 0, 0, 0), Entry(0xFFFFFFFE, 0xFFFFFFFF, 5, 6, 7, 8)]
    values = array.array("Q", chain.from_iterable(entries))
    if not ix.encode_puts(keys, values) == ix.encode_lines(keys, values) == encode_puts(keys, entries):
        raise RuntimeError("the C record encoder disagrees with the reference")
    want = b"".join(xxhash.xxh3_128_digest(k.encode(), DIGEST_SEED) for k in keys)
    twice = ix.key_digests([*keys, keys[0]])
    if ix.key_digests(keys) != (want, True) or twice is None or twice[1] is not False:
        raise RuntimeError("the C key digests disagree with the reference")
    ascii_keys, geometry = ["a", "", "k" * 300, "m:0123abcd"], Geometry(20000)
    gens, slots = array.array("Q", [1, 2, 1 << 40, 7]), array.array("Q", [0, 1, 300, 70000])
    data_at, marker_at = geometry.offsets(slots)
    ref = SetMarkers(bytearray(b"".join(encode_markers(gens, repeat(20000), repeat(0),
                                                       map(key_fingerprint, ascii_keys)))),
                     array.array("q", data_at), array.array("q", marker_at))
    if ix.write_markers(ascii_keys, gens, slots, geometry) != ref:
        raise RuntimeError("the C marker records disagree with the reference")
    t = ix.new()
    try:  # b supersedes a in slot (1, 2, 3); slots 4 and 6 of slab 2 hold c and d
        ds = [xxhash.xxh3_128_digest(k.encode(), DIGEST_SEED) for k in "abcd"]
        put = [Entry(1, 2, 3, 1, 64, 0), Entry(1, 2, 3, 2, 64, 0), Entry(1, 2, 4, 3, 64, 0),
               Entry(1, 2, 6, 4, 64, 0)]
        put_values = array.array("Q", chain.from_iterable(put))
        ix.put_many(t, 4, b"".join(ds), put_values.buffer_info()[0])
        at = bytearray(16)
        log = encode_record(PUT, "a", put[0]) + encode_record(PUT, "b", put[1])
        spans = array.array("Q", bytes(32))
        if ix.len(t) != 3 or not ix.at(t, 1, 2, 3, address_of(at)) or bytes(at) != ds[1] or ix.live_puts(
                t, log, len(log), DIGEST_SEED, ix.seeded128, address_of(spans), address_of(spans) + 16,
                2) != 1 \
                or list(spans) != [len(log) // 2, 0, len(log), 0]:
            raise RuntimeError("the C page table disagrees with the reference")
        if ix.take_run(t, 1, 2, 3, 3) != (ds[1] + ds[2], array.array("Q", chain(put[1], put[2]))) \
                or ix.len(t) != 1:
            raise RuntimeError("the C eviction take disagrees with the reference")
    finally:
        ix.free(t)


def _check_io(io: BatchIO) -> None:
    """Two pages written and read back through a temporary file, checksums the Python
    path's."""
    import tempfile

    data = bytearray(os.urandom(3 * 4096))
    base = address_of(data)
    pages: list[Page] = [((base, 4096),), ((base + 4096, 1000), (base + 8192, 3000))]
    records = [bytes(range(64)) * 2, bytes(range(64, 128)) * 2]
    with tempfile.TemporaryFile() as f:
        fd = f.fileno()
        w = PageBatch(128, [fd, fd], [8192, 12288], [0, 128], pages, records, writing=True)
        if io.write(w, 0, len(pages), True) or list(w.checksums) != [page_checksum(p) for p in pages]:
            raise RuntimeError("native batch write disagrees with the Python path")
        if os.pread(fd, 4096, 8192) != bytes(data[:4096]) or os.pread(fd, 256, 0) != bytes(w.markers):
            raise RuntimeError("native batch write put bytes elsewhere than asked")
        r = PageBatch(128, [fd, fd], [8192, 12288], [0, 128], pages,
                      [bytes(w.markers[:128]), bytes(w.markers[128:])], list(w.checksums), writing=False)
        if io.read(r, 0, len(pages)) or list(r.status) != [OK, OK]:
            raise RuntimeError("native batch read disagrees with the Python path")


T = TypeVar("T")


class LoadedOnce(Generic[T]):
    """One view of the ``hicache_l3._batch_io`` library (``make(path)``: the batch I/O
    calls, the page table's, ...), built and self-tested (``self_test(view)`` raises
    RuntimeError on a disagreement with the reference) on the first :meth:`get`, from any
    thread, never at import. The library is required: :meth:`get` raises ImportError
    naming the fix when it is not built, built for another ABI or refused (``refused``
    prefixes the reason)."""

    def __init__(self, make: Callable[[str], T], self_test: Callable[[T], None], refused: str) -> None:
        self._make, self._self_test, self._refused = make, self_test, refused
        self._lock = threading.Lock()
        self._loaded: T | ImportError | None = None

    def get(self) -> T:
        """The view; ImportError (naming the fix) when the library is missing or refused."""
        loaded = self._loaded
        if loaded is None:
            with self._lock:
                if self._loaded is None:
                    self._loaded = self._load()
                loaded = self._loaded
        if isinstance(loaded, ImportError):
            raise ImportError(str(loaded), name="hicache_l3._batch_io")
        return loaded

    def _load(self) -> T | ImportError:
        spec = importlib.util.find_spec("hicache_l3._batch_io")
        if spec is None or spec.origin is None:
            return ImportError(f"hicache_l3._batch_io is not built: {BUILD_HINT}")
        try:
            view = self._make(spec.origin)
            self._self_test(view)
        except (OSError, AttributeError, RuntimeError) as exc:  # (AttributeError: another build's calls)
            return ImportError(f"{self._refused} ({spec.origin}): {exc}; {BUILD_HINT}")
        return view


_batch_io = LoadedOnce(BatchIO, _self_test, "hicache_l3._batch_io refused")


def library() -> BatchIO:
    """The library, loaded and self-tested on first call (nothing happens at import);
    ImportError naming the fix when it is not built or failed its self-test."""
    return _batch_io.get()

