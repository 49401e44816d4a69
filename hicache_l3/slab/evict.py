"""The writer's eviction take in one C call per run of slots (``hl3_pt_take_run``,
``hicache_l3/native/evict.c`` in ``hicache_l3._batch_io``): the pages of slots ``first ..
first + count - 1`` of one own slab, as :meth:`~hicache_l3.slab.clock.Clock.evict_runs`
hands them out, removed from the C page table with their digests and entries, instead of
a ``(writer, slab, slot)`` tuple per page for
:meth:`~hicache_l3.slab.table.PageTable.take_at_many` (the reference, and the path of the
dict table and of a library without the call). Checked against the reference when it
loads (:class:`~hicache_l3.slab.native.LoadedOnce`).
"""

from __future__ import annotations

import array
import ctypes

from hicache_l3.slab.format import Entry
from hicache_l3.slab.native import LoadedOnce
from hicache_l3.slab.table import NativePageTable, PageTable, digest, native_library

_u64, _sz, _vp = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p


class _Library:
    """``hl3_pt_take_run``, typed once. The GIL stays held (PyDLL): the call takes
    microseconds, under the index lock, on a table no other thread touches meanwhile."""

    def __init__(self, path: str) -> None:
        lib = ctypes.PyDLL(path)
        self.take_run = lib.hl3_pt_take_run
        self.take_run.restype = _sz
        self.take_run.argtypes = [_vp, _u64, _u64, _u64, _sz, _vp, _vp]


def take_run(table: PageTable, writer: int, slab: int, first: int,
             count: int) -> tuple[bytes, array.array[int]]:
    """``table.take_at_many`` of slots ``(writer, slab, first + k)`` for ``k < count``: the
    pages there were removed, their digests concatenated and entries six values each, in
    slot order; one C call on the C table."""
    if not isinstance(table, NativePageTable) or min(writer, slab, first, count) < 0 \
            or max(writer, slab, first + count) > 0xFFFFFFFF:
        return table.take_at_many([(writer, slab, slot) for slot in range(first, first + count)])
    return _native_take(_native.get(), table, writer, slab, first, count)


def _native_take(lib: _Library, table: NativePageTable, writer: int, slab: int, first: int,
                 count: int) -> tuple[bytes, array.array[int]]:
    ds = ctypes.create_string_buffer(16 * count)
    values = array.array("Q", bytes(48 * count))
    hits = lib.take_run(table._t, writer, slab, first, count, ds, values.buffer_info()[0] if count else None)
    if hits < count:
        del values[6 * hits:]
    return ds.raw[: 16 * hits], values


def _self_test(lib: _Library) -> None:
    tables = native_library()
    made = []
    for _ in range(2):
        t = NativePageTable(tables)
        t.put_many([digest(f"k{i}") for i in range(6)],
                   [Entry(1, 2, slot, 10 + slot, 64, slot) for slot in (0, 1, 3, 4, 5, 9)])
        made.append(t)
    ours = _native_take(lib, made[0], 1, 2, 1, 5)
    ref = made[1].take_at_many([(1, 2, slot) for slot in range(1, 6)])
    if ours != ref or sorted(made[0].select()) != sorted(made[1].select()):
        raise RuntimeError("the C eviction take disagrees with the reference")


_native = LoadedOnce(_Library, _self_test, "hicache_l3._batch_io has no usable eviction take")
