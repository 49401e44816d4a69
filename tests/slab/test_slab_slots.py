"""Reserved slots as columns (hicache_l3/slab/slots.py): a SlotColumns reads as the list
of Slots it stands for (items, slices, iteration, equality), columns of a list are that
list's, mismatched columns are refused; a store's reserve hands columns to the commit and
the commit publishes the same index either way."""

from __future__ import annotations

import array
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _highest_reference(slabs: list[int], slots: list[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
    highest: dict[int, int] = {}
    spans: list[tuple[int, int]] = []
    for slab, slot in zip(slabs, slots):
        highest[slab] = max(highest.get(slab, -1), slot)
        if spans and spans[-1][0] == slab:
            spans[-1] = (slab, spans[-1][1] + 1)
        else:
            spans.append((slab, 1))
    return highest, spans


@settings(max_examples=300, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 40), st.integers(1, 9),
                               st.booleans()), min_size=1, max_size=7))
def test_a_reserves_slabs_and_highest_slots_are_the_loops(runs: list[tuple[int, int, int, bool]]) -> None:
    """The reserve's per-slab highest slot and its spans of one slab (found with a count
    per span where the slabs come in few spans, as an eviction's do) are the per-slot
    loop's: for runs of slots in order or not, one or more spans of a slab, interleaved."""
    from hicache_l3.slab.store import _highest_slots

    slabs: list[int] = []
    slots: list[int] = []
    for slab, first, count, ordered in runs:
        part = list(range(first, first + count))
        slabs += [slab] * count
        slots += part if ordered else part[::-1]
    got = _highest_slots(array.array("Q", slabs), array.array("Q", slots))
    assert got == _highest_reference(slabs, slots)
