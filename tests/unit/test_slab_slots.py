"""Reserved slots as columns (hicache_l3/slab/slots.py): a SlotColumns reads as the list
of Slots it stands for (items, slices, iteration, equality), columns of a list are that
list's, mismatched columns are refused; a store's reserve hands columns to the commit and
the commit publishes the same index either way."""

from __future__ import annotations

import array
import tempfile

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.slab.format import Geometry, Slot
from hicache_l3.slab.slots import SlotColumns
from hicache_l3.slab.store import SlabStore


def test_columns_read_as_the_list_of_slots() -> None:
    listed = [Slot(5, 0, 3, 10), Slot(6, 1, 0, 11), Slot(5, 0, 7, 1 << 40)]
    cols = SlotColumns.of(listed)
    assert list(cols.fds) == [5, 6, 5] and list(cols.slabs) == [0, 1, 0]
    assert list(cols.slots) == [3, 0, 7] and list(cols.gens) == [10, 11, 1 << 40]
    assert len(cols) == 3 and list(cols) == listed and cols == listed and cols[1] == listed[1]
    assert cols[-1] == listed[-1] and cols[1:] == listed[1:] and isinstance(cols[1:], SlotColumns)
    assert Slot(6, 1, 0, 11) in cols and cols.index(listed[2]) == 2
    assert cols != listed[:2] and cols != [*listed[:2], Slot(5, 0, 7, 0)]
    assert SlotColumns.of(cols) is cols and SlotColumns.of([]) == []
    with pytest.raises(IndexError):
        cols[3]
    with pytest.raises(ValueError, match="SlotColumns"):
        SlotColumns(array.array("i", [1]), array.array("Q"), array.array("Q", [1]), array.array("Q", [1]))
    with pytest.raises(ValueError, match="SlotColumns"):
        one = array.array("Q", [1])
        SlotColumns(array.array("q", [1]), one, one, one)


def test_commit_of_columns_equals_commit_of_slots() -> None:
    """The same batches committed from the reserve's columns and from a list of Slots
    give the same index and the same log."""
    ns = Namespace(model="cols", kv_dtype="uint8", layout="page_first", page_size=64, tag="t")
    stride = Geometry(64).stride
    logs, entries = [], []
    for as_list in (False, True):
        with tempfile.TemporaryDirectory() as root:
            store = SlabStore(root, ns, 64, capacity_bytes=6 * stride, slab_bytes=4 * stride)
            try:
                for batch in range(4):  # past capacity: evictions reuse slots, over two slabs
                    keys = [f"b{batch}-{i}" for i in range(4)]
                    plan = store.reserve_new(keys)
                    assert len(plan.slots) == 4 and not plan.full
                    assert isinstance(plan.slots, SlotColumns)
                    slots = list(plan.slots) if as_list else plan.slots
                    store.commit(keys, slots, array.array("Q", range(1, 5)), plan.digests)
                    published = [loc.entry for loc in store.lookup(keys) if loc is not None]
                    assert [(e.writer, e.slab, e.slot, e.gen, e.length) for e in published] == [
                        (store.me, s.slab, s.slot, s.gen, 64) for s in plan.slots]
                found = store.lookup([f"b{b}-{i}" for b in range(4) for i in range(4)])
                entries.append([loc.entry if loc is not None else None for loc in found])
                assert store.index.tails[store.me].offset > 0
                logs.append(store.stats()["own_pages"])
            finally:
                store.close()
    assert entries[0] == entries[1] and logs[0] == logs[1] == 6
    assert sum(e is not None for e in entries[0]) == 6
    assert [e.checksum for e in entries[0] if e is not None] == [3, 4, 1, 2, 3, 4]
