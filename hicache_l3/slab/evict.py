"""The writer's eviction take: a run of one own slab's slots removed from the page table in
one C call (``hl3_pt_take_run``, ``native/evict.c``)."""

from __future__ import annotations

import array

from hicache_l3.slab.native import library
from hicache_l3.slab.table import NativePageTable, PageTable


def take_run(table: PageTable, writer: int, slab: int, first: int,
             count: int) -> tuple[bytes, array.array[int]]:
    """``table.take_at_many`` of slots ``(writer, slab, first + k)`` for ``k < count``: the
    pages there removed, their digests concatenated and entries six values each, in slot
    order; one C call on the C table."""
    if not isinstance(table, NativePageTable) or min(writer, slab, first, count) < 0 \
            or max(writer, slab, first + count) > 0xFFFFFFFF:
        return table.take_at_many([(writer, slab, slot) for slot in range(first, first + count)])
    return library().index.take_run(table._t, writer, slab, first, count)
