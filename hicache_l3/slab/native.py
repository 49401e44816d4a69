"""The C batch library (``hicache_l3._batch_io``): the slab connectors' hot path with the GIL
released once per share. Loaded lazily, on the first :func:`library` call, never at
import; required (docs/architecture.md, "The C library"): one that is not built, or built
for another slab format (no ``hl3_abi``, or another value), is an ImportError naming the
fix. ``hicache_l3/native/batch_io.c`` runs a whole share of a batch (the data and the
marker records, adjacent slots coalesced into one syscall, the record check and the XXH3
checksum) in one call, with the entry points of the ``xxhash`` wheel's own XXH3, so its
checksums are :func:`~hicache_l3.common.integrity.page_checksum`'s (checked at load).

Use: build a :class:`PageBatch` from per-page lists, then call
:meth:`BatchIO.read` or :meth:`BatchIO.write` on contiguous shares ``[lo, hi)`` of it, from
any threads; :attr:`PageBatch.status` then holds one code per page (:data:`OK`,
:data:`SHORT`, :data:`HEADER`, :data:`CHECKSUM`, :data:`NOMEM` or ``-errno``).
"""

from __future__ import annotations

import array
import ctypes
import functools
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from itertools import accumulate, chain
from typing import Generic, NamedTuple, Protocol, TypeVar

from hicache_l3.common.integrity import page_checksum, xxh3_function
from hicache_l3.common.keys import BUILD_HINT
from hicache_l3.common.pages import Page
from hicache_l3.slab.format import RECORD_BYTES


class PlannedRead(Protocol):
    """What :meth:`BatchIO.plan_read` reads of a :class:`~hicache_l3.slab.plan.GetPlan`
    (named by its fields here: slab/plan.py builds on the page table, which loads this
    module's library)."""

    count: int
    fds: array.array[int]
    data_offs: array.array[int]
    marker_offs: array.array[int]
    expect: bytearray
    csums: array.array[int]

OK, SHORT, HEADER, CHECKSUM, NOMEM = 0, 1, 2, 3, 4
AGAIN = 5  # a nowait read's page not (all) in the page cache: not read (BatchIO.read_plan)
ABI = 2  # hl3_abi() of a library this module can call (slab format 2)

_vp, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


_XXH3_ROLES = ("one", "create", "free", "reset", "update", "digest")  # the C struct's order


class _XXH3(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in _XXH3_ROLES]


def xxh3_entry_points() -> ctypes.Structure:
    """The xxhash wheel's XXH3 entry points as the C library's ``struct hl3_xxh3`` (pass its
    address to the calls that hash): the library holds no XXH3 of its own, so its
    checksums are the wheel's."""
    return _XXH3(*(ctypes.cast(xxh3_function(role), ctypes.c_void_p).value for role in _XXH3_ROLES))


def _address(buf: array.array | bytearray) -> int:
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
        self.segments = array.array("Q", chain.from_iterable(chain.from_iterable(pages)))
        self.at = array.array("i", accumulate(map(len, pages), initial=0))
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
    def for_read(cls, marker_len: int, fds: array.array[int], data_offsets: array.array[int],
                 marker_offsets: array.array[int], pages: Sequence[Page], expect: bytearray,
                 checksums: array.array[int]) -> PageBatch:
        """A read batch from arrays already in the C layout (a
        :class:`~hicache_l3.slab.plan.GetPlan`'s: ``fds`` int32, offsets int64,
        ``checksums`` uint64, ``expect`` the records back to back), taken as they are, not
        copied; only the segments of ``pages`` are flattened, in C-level passes, or taken
        as they are from a :class:`~hicache_l3.common.pages.FlatPages`."""
        n = len(fds)
        if not (len(data_offsets) == len(marker_offsets) == len(pages) == len(checksums) == n) \
                or len(expect) != n * marker_len or (fds.typecode, data_offsets.typecode,
                                                     marker_offsets.typecode, checksums.typecode) \
                != ("i", "q", "q", "Q"):
            raise ValueError("PageBatch.for_read: arrays differ in length or type")
        self = cls.__new__(cls)
        self.marker_len, self.writing = marker_len, False
        self.fds, self.data_offsets, self.marker_offsets = fds, data_offsets, marker_offsets
        self.segments, self.at = flat_segments(pages)
        self.checksums, self.markers, self.expect = checksums, bytearray(len(expect)), expect
        return self._addressed()


    @classmethod
    def for_write(cls, marker_len: int, fds: array.array[int], data_offsets: array.array[int],
                  marker_offsets: array.array[int], pages: Sequence[Page], markers: bytearray) -> PageBatch:
        """A write batch from arrays already in the C layout (``fds`` int32, offsets int64,
        ``markers`` the records back to back, as
        :func:`~hicache_l3.slab.records.write_markers` makes them), taken as they are, not
        copied (the write fills the records' checksum fields in); only the segments of
        ``pages`` are flattened, in C-level passes, or taken as they are from a
        :class:`~hicache_l3.common.pages.FlatPages`."""
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
        """Finish a batch whose arrays are set: a status per page, and the addresses the C
        calls take (the arrays never grow after this, so they hold for the batch's life)."""
        self.status = array.array("i", bytes(4 * len(self.fds)))
        self.addresses = (_address(self.fds), _address(self.data_offsets), _address(self.marker_offsets),
                          _address(self.segments), _address(self.at), _address(self.markers))
        self.expect_at = _address(self.expect)
        self.checksums_at, self.status_at = _address(self.checksums), _address(self.status)
        return self


def flat_segments(pages: Sequence[Page]) -> tuple[array.array[int], array.array[int]]:
    """``(segments, at)`` of ``pages`` as the C calls walk them: every segment as flat
    uint64 ``(address, length)`` pairs, and each page's first segment index (``n + 1``
    int32 bounds); a :class:`~hicache_l3.common.pages.FlatPages`' segments (flattened by
    the connector's check) are taken as they are, other pages flattened in C-level
    passes."""
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
    """The ``at`` bounds of ``n`` pages of ``per`` segments each (read, never written, by
    the C calls): built once per shape, not once per batch."""
    return array.array("i", range(0, per * n + 1, per))


def plan_segments(pages: Sequence[Page]) -> tuple[bytes | array.array[int], array.array[int]]:
    """:func:`flat_segments` without a copy where it can: a
    :class:`~hicache_l3.common.pages.FlatPages`' segments as they are (the C calls only
    read them) and its bounds shared by every batch of its shape."""
    flat = getattr(pages, "segments", None)
    if flat is not None and len(flat) == 16 * pages.per * len(pages):  # type: ignore[attr-defined]
        return flat, _uniform_at(pages.per, len(pages))  # type: ignore[attr-defined]
    return flat_segments(pages)


class PlanRead(NamedTuple):
    """One planned read's call (:meth:`BatchIO.plan_read`): its status array, the C
    call's arguments after ``lo, hi``, and the objects whose memory they address (held
    while the call may run)."""

    status: array.array[int]
    args: array.array[int]  # int64 addresses and lengths
    keep: tuple[object, ...]


class Share:
    """The state of one batch shared by threads (``struct hl3_share``, native/batch_io.c):
    ``pages`` pages claimed in chunks by whichever thread calls next, ``chunk`` pages at a
    time or, with ``parts``, what is left / ``parts`` and at least ``chunk`` pages (big
    chunks first, small last); and the count of pages of finished chunks. Every thread that
    may call into it must hold a reference to it until its call returned."""

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
        lib = ctypes.CDLL(path)
        abi = getattr(lib, "hl3_abi", None)
        if abi is None or abi() != ABI:
            raise RuntimeError(f"{path} was built for another slab format (hl3_abi "
                               f"{'missing' if abi is None else abi()}, want {ABI}): rebuild it "
                               "(pip install ., or setup.py build_ext --inplace)")
        self._read = lib.hl3_read_pages
        self._read.restype = ctypes.c_int
        self._read.argtypes = [_i32, _i32, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _vp]
        self._write = lib.hl3_write_pages
        self._write.restype = ctypes.c_int
        self._write.argtypes = [_i32, _i32, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _i32, _vp, _vp, _vp]
        self._read_apart, self._write_apart = lib.hl3_read_pages_apart, lib.hl3_write_pages_apart
        self._read_apart.restype = self._write_apart.restype = ctypes.c_int
        self._read_apart.argtypes = [_i32, _i32, _vp, *self._read.argtypes[2:]]
        self._write_apart.argtypes = [_i32, _i32, _vp, *self._write.argtypes[2:]]
        self._read_plan, self._read_plan_nowait = lib.hl3_read_plan, lib.hl3_read_plan_nowait
        for fn in (self._read_plan, self._read_plan_nowait):
            fn.restype = ctypes.c_int
            fn.argtypes = [_i32, _i32, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp, _vp, _vp]
        # one batch shared by threads, joined in C
        read, write, stop = lib.hl3_share_read_plan, lib.hl3_share_write_pages, lib.hl3_share_stop
        read.restype = write.restype = ctypes.c_int
        read.argtypes = [_vp, _i64, _i32, *[_vp] * 6, _i64, _vp, _vp, _vp]
        write.argtypes = [_vp, _i64, *[_vp] * 6, _i64, _i32, _vp, _vp, _vp]
        stop.restype, stop.argtypes = None, [_vp]
        self._share_read_plan, self._share_write, self._share_stop = read, write, stop
        self._markers = lib.hl3_markers
        self._markers.restype = ctypes.c_int
        self._markers.argtypes = [_i32, _i32, _i32, _vp, _vp, _vp, _vp, _i64, _vp]
        self._xxh3 = xxh3_entry_points()
        self._xxh3_at = ctypes.addressof(self._xxh3)

    def read(self, batch: PageBatch, lo: int, hi: int, data_fds: array.array[int] | None = None) -> int:
        """Read pages ``lo..hi-1`` of a read batch (data, then marker records, then the
        checks), page ``j``'s data from ``data_fds[j]`` when given (int32: an O_DIRECT
        descriptor); the number not OK (0 for an empty share)."""
        if not _share(batch, lo, hi, "read", not batch.writing):
            return 0
        tail = (*batch.addresses, batch.expect_at, batch.marker_len, batch.checksums_at, self._xxh3_at,
                batch.status_at)
        if data_fds is None:
            return int(self._read(lo, hi, *tail))
        return int(self._read_apart(lo, hi, _address(data_fds), *tail))

    def write(self, batch: PageBatch, lo: int, hi: int, checksum: bool,
              data_fds: array.array[int] | None = None) -> int:
        """Write pages ``lo..hi-1`` of a write batch (marker records first, then the data,
        to ``data_fds[j]`` when given), checksumming them first when ``checksum``; the
        number not OK (0 for an empty share)."""
        if not _share(batch, lo, hi, "write", batch.writing):
            return 0
        if data_fds is None:
            return int(self._write(lo, hi, *self._write_tail(batch, checksum)))
        return int(self._write_apart(lo, hi, _address(data_fds), *self._write_tail(batch, checksum)))

    def plan_read(self, plan: PlannedRead, pages: Sequence[Page]) -> PlanRead:
        """The call :meth:`read_plan` makes for ``plan``'s ``plan.count`` pages into
        ``pages`` (page ``j`` of the plan into ``pages[j]``): the plan's arrays taken as
        they are (no copy) and the segments of ``pages`` as :func:`plan_segments` gives
        them; ValueError when their lengths differ."""
        n = plan.count
        segments, at = plan_segments(pages)
        if len(pages) != n or len(plan.fds) != n or len(plan.expect) != n * RECORD_BYTES:
            raise ValueError(f"read_plan: {len(pages)} pages for a plan of {n}")
        status = array.array("i", bytes(4 * n))
        args = (plan.fds.buffer_info()[0], plan.data_offs.buffer_info()[0], plan.marker_offs.buffer_info()[0],
                _bytes_address(segments) if isinstance(segments, bytes) else _address(segments),
                at.buffer_info()[0], _address(plan.expect), RECORD_BYTES, plan.csums.buffer_info()[0],
                self._xxh3_at, status.buffer_info()[0])
        return PlanRead(status, array.array("q", args), (segments, at, plan))

    def read_plan(self, call: PlanRead, lo: int, hi: int, nowait: bool = False) -> int:
        """``hl3_read_plan`` of pages ``lo..hi-1`` of ``call`` (:meth:`plan_read`): the
        read and checks of :meth:`read` without a :class:`PageBatch` (the records read land
        in the C call's own scratch memory); the number not OK (0 for an empty share).
        With ``nowait`` (``hl3_read_plan_nowait``) only what the page cache holds is read:
        a page whose data would wait for the disk is left :data:`AGAIN` (and counted),
        for a blocking call."""
        if lo == hi:
            return 0
        if not 0 <= lo < hi <= len(call.status):
            raise ValueError(f"read of pages [{lo}, {hi}) of a {len(call.status)}-page plan")
        fn = self._read_plan_nowait if nowait else self._read_plan
        return int(fn(lo, hi, *call.args))

    def share_read_plan(self, share: Share, call: PlanRead, wait_ns: int, nowait: bool = False) -> bool:
        """:meth:`read_plan` of every chunk of ``share`` this thread claims (``hl3_share_read_plan``);
        then, when ``wait_ns`` > 0, a wait of up to that long (spinning, without the GIL)
        for the chunks other threads still run. True when every chunk had finished on
        return: none is running and none can start."""
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
        return (*batch.addresses, batch.marker_len, int(checksum), batch.checksums_at, self._xxh3_at,
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
            self._markers(writing, 0, n, _address(fd_arr), _address(off_arr), _address(bufs),
                          _address(expect) if expect is not None else None, length, _address(status))
        return status


def _share(batch: PageBatch, lo: int, hi: int, op: str, fits: bool) -> bool:
    """True for a non-empty share ``[lo, hi)`` of a batch built for ``op`` (``fits``); False
    for an empty one; ValueError for a share out of range or a batch built for the other op."""
    if lo == hi and 0 <= lo <= len(batch):
        return False
    if not fits or not 0 <= lo < hi <= len(batch):
        raise ValueError(f"{op} of pages [{lo}, {hi}) of a {len(batch)}-page batch")
    return True


def _self_test(io: BatchIO) -> None:
    """Write and read back two pages through a temporary file; checksums must match
    the Python path's (the library is refused otherwise)."""
    import tempfile

    data = bytearray(os.urandom(3 * 4096))
    base = _address(data)
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


def describe() -> str:
    """One line for logs and stats: the path pages move through."""
    library()
    return "native batch I/O (C)"
