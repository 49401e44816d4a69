"""NIXL file mode's batch helpers over the C library's calls (``native/nixl_rows.c`` and the
marker call of ``native/batch_io.c``): a batch's NIXL rows built and joined in one call
(:meth:`NixlBatchLib.rows`, as :func:`~hicache_l3.connectors.nixl.base.coalesce` joins
them), the marker records and the checksums of a batch in one call each.
"""

from __future__ import annotations

import array
import ctypes
import functools
import importlib
from typing import Any

from hicache_l3.connectors.nixl.base import Desc
from hicache_l3.slab import native
from hicache_l3.slab.format import RECORD_BYTES
from hicache_l3.slab.native import BatchIO, PageBatch, flat_segments

TUPLE_ROWS = 16  # rows(arrays=True) of at most this many rows are lists of tuples


def _at(buf: array.array[int] | bytearray) -> int:
    """Address of a non-empty buffer's first byte (0 for an empty one)."""
    if isinstance(buf, array.array):
        return buf.buffer_info()[0] if buf else 0
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


@functools.cache
def _numpy() -> Any:
    """numpy (a dependency of nixl itself, imported on first use), or None without it."""
    try:
        return importlib.import_module("numpy")
    except ImportError:
        return None


def _rows(flat: array.array[int], m: int) -> list[Desc]:
    """The first ``m`` rows of a flat ``(a, b, c)`` array as tuples (C-level passes)."""
    it = iter(flat[:3 * m])
    return list(zip(it, it, it))


class NixlBatchLib:
    """The helpers over ``lib`` (module docstring); thread-safe."""

    def __init__(self, lib: BatchIO) -> None:
        self._join, self._sums, self._markers = lib.join_rows, lib.check_sums, lib.markers
        self._xxh3_at = lib.xxh3_at

    def rows(self, segments: array.array[int] | bytes, at: array.array[int], fds: array.array[int],
             offsets: array.array[int], max_bytes: int, *, arrays: bool = False) -> tuple[Any, Any]:
        """The local (DRAM) and remote (FILE) rows moving ``n = len(fds)`` pages: page ``j`` is
        the ``(address, length)`` pairs ``segments[2 at[j] : 2 at[j + 1]]`` (uint64, or
        ``bytes`` of them) moved to or from ``offsets[j]`` (int64) of ``fds[j]`` (int32);
        rows that continue each other on both sides joined up to ``max_bytes`` (0: none), as
        :func:`~hicache_l3.connectors.nixl.base.coalesce` joins them. Lists of tuples; with
        ``arrays`` and more than :data:`TUPLE_ROWS` rows, two ``m x 3`` uint64 numpy arrays
        (where numpy imports)."""
        n = len(fds)
        if not n:
            return [], []
        pairs = len(segments) // 16 if isinstance(segments, bytes) else len(segments) // 2
        if not (len(offsets) == n and len(at) == n + 1 and pairs == at[n]) \
                or (getattr(segments, "typecode", "Q"), at.typecode, fds.typecode, offsets.typecode) \
                != ("Q", "i", "i", "q") or (isinstance(segments, bytes) and len(segments) % 16):
            raise ValueError("rows: arrays differ in length or type")
        room = at[n]
        local, remote = array.array("Q", bytes(24 * room)), array.array("Q", bytes(24 * room))
        m = int(self._join(n, segments if isinstance(segments, bytes) else _at(segments), _at(at), _at(fds),
                           _at(offsets), _at(local), _at(remote), max_bytes))
        numpy = _numpy() if arrays and m > TUPLE_ROWS else None
        if numpy is not None:
            return (numpy.frombuffer(local, numpy.uint64, 3 * m).reshape(m, 3),
                    numpy.frombuffer(remote, numpy.uint64, 3 * m).reshape(m, 3))
        return _rows(local, m), _rows(remote, m)

    def plan_markers(self, fds: array.array[int], offsets: array.array[int], expect: bytearray,
                     status: array.array[int], lo: int = 0, hi: int | None = None,
                     scratch: bytearray | None = None) -> int:
        """Read marker record ``j`` at ``offsets[j]`` (int64) of ``fds[j]`` (int32) for every
        ``j`` of ``lo..hi-1`` (default: all; a :class:`~hicache_l3.slab.plan.GetPlan`'s
        arrays, as they are) into scratch space (``scratch``, ``128 n`` bytes, when given:
        one buffer for every share of a batch), each compared with ``expect[128 j : 128 (j +
        1)]``, in one call with the GIL released, adjacent records in one syscall:
        ``status[j]`` becomes OK, SHORT, HEADER (differs) or ``-errno``, the others keep
        theirs; the number not OK in the range."""
        n = len(fds)
        hi = n if hi is None else hi
        if len(offsets) != n or len(status) != n or len(expect) != RECORD_BYTES * n \
                or (fds.typecode, offsets.typecode, status.typecode) != ("i", "q", "i"):
            raise ValueError("plan_markers: arrays differ in length or type")
        if not 0 <= lo <= hi <= n or (scratch is not None and len(scratch) != RECORD_BYTES * n):
            raise ValueError(f"marker records [{lo}, {hi}) of a {n}-page read")
        if lo == hi:
            return 0
        if scratch is None:
            scratch = bytearray(RECORD_BYTES * n)  # held by this frame until the call returns
        return int(self._markers(0, lo, hi, _at(fds), _at(offsets), _at(scratch), _at(expect), RECORD_BYTES,
                                 _at(status)))

    def plan_sums(self, segments: array.array[int] | bytes, at: array.array[int], csums: array.array[int],
                  status: array.array[int], lo: int, hi: int) -> int:
        """:meth:`check_sums` of pages ``lo..hi-1`` given as flat arrays (the segments and
        bounds of :func:`~hicache_l3.slab.native.plan_segments`, a plan's checksums, the
        read's status), taken as they are; the number not OK in the share."""
        n = len(status)
        pairs = len(segments) // 16 if isinstance(segments, bytes) else len(segments) // 2
        if len(csums) != n or len(at) != n + 1 or pairs != at[n] or not 0 <= lo <= hi <= n \
                or (csums.typecode, status.typecode, at.typecode) != ("Q", "i", "i"):
            raise ValueError(f"checksums of pages [{lo}, {hi}) of a {n}-page read")
        if lo == hi:
            return 0
        return int(self._sums(lo, hi, segments if isinstance(segments, bytes) else _at(segments), _at(at),
                              _at(csums), self._xxh3_at, _at(status)))

    def write_markers(self, fds: array.array[int], offsets: array.array[int],
                      records: bytearray) -> array.array[int]:
        """``pwrite`` record ``j`` (``records[128 j : 128 (j + 1)]``) at ``offsets[j]``
        (int64) of ``fds[j]`` (int32), every ``j`` in one call with the GIL released,
        adjacent records in one syscall; one status per record (OK, SHORT or -errno)."""
        n = len(fds)
        if len(offsets) != n or len(records) != RECORD_BYTES * n or (fds.typecode, offsets.typecode) \
                != ("i", "q"):
            raise ValueError("write_markers: arrays differ in length or type")
        status = array.array("i", bytes(4 * n))
        if n:
            self._markers(1, 0, n, _at(fds), _at(offsets), _at(records), None, RECORD_BYTES, _at(status))
        return status

    def check_sums(self, batch: PageBatch, lo: int, hi: int) -> int:
        """Pages ``lo..hi-1`` of read ``batch`` whose status is OK and whose checksum is
        not 0: CHECKSUM when their XXH3 differs (NOMEM when no hash state could be made);
        the number not OK in the share."""
        if not 0 <= lo <= hi <= len(batch):
            raise ValueError(f"checksums of pages [{lo}, {hi}) of a {len(batch)}-page batch")
        if lo == hi:
            return 0
        _fds, _data, _marks, segs, at, _buf = batch.addresses
        return int(self._sums(lo, hi, segs, at, batch.checksums_at, self._xxh3_at, batch.status_at))


flatten = flat_segments  # the batch library's spelling (rows take what a PageBatch walks)


@functools.cache
def library() -> NixlBatchLib:
    """The helpers; ImportError naming the fix when the library is not built or refused."""
    return NixlBatchLib(native.library())
