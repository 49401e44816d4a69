"""The writer's own-page recency (hicache_l3/slab/clock.py): the batched CLOCK equals a
slot-by-slot reference CLOCK for any sequence of writes, reads, frees and evictions, and
evicts "least recently used in effect": with no reads, in the order pages were written;
a page read since the hand last passed it outlives every page that was not."""

from __future__ import annotations

import array
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.common.keys import Namespace
from hicache_l3.slab.clock import ABSENT, COLD, HOT, Clock, Clocks
from hicache_l3.slab.format import Geometry
from hicache_l3.slab.store import SlabStore, split_min_slots

SLABS, STRIDE = 3, 7


class ReferenceClock:
    """Second-chance CLOCK one slot at a time: the model."""

    def __init__(self, slots: int) -> None:
        self.state = [ABSENT] * slots
        self.hand = 0

    def evict(self, n: int) -> list[int]:
        out: list[int] = []
        n = min(n, sum(1 for s in self.state if s))
        while len(out) < n:
            s = self.state[self.hand]
            if s == HOT:
                self.state[self.hand] = COLD
            elif s == COLD:
                self.state[self.hand] = ABSENT
                out.append(self.hand)
            self.hand = (self.hand + 1) % len(self.state)
        return out


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, SLABS * STRIDE - 1), max_size=10, unique=True)),
    st.tuples(st.just("run"), st.integers(0, SLABS * STRIDE - 1), st.integers(1, STRIDE)),
    st.tuples(st.just("touch"), st.lists(st.integers(0, SLABS * STRIDE - 1), max_size=10)),
    st.tuples(st.just("touch_cols"), st.lists(st.integers(0, SLABS * STRIDE - 1), max_size=10)),
    st.tuples(st.just("touch_run"), st.integers(0, SLABS * STRIDE - 1), st.integers(1, STRIDE)),
    st.tuples(st.just("near_run"), st.integers(0, SLABS * STRIDE - 1), st.integers(3, STRIDE), st.booleans()),
    st.tuples(st.just("discard"), st.integers(0, SLABS * STRIDE - 1)),
    st.tuples(st.just("evict"), st.integers(0, 2 * SLABS * STRIDE)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_clock_equals_the_slot_by_slot_reference(program: list[tuple]) -> None:
    clock, ref = Clock(STRIDE), ReferenceClock(SLABS * STRIDE)
    clock.grow(SLABS)

    def where(i: int) -> tuple[int, int]:
        return divmod(i, STRIDE)

    for op in program:
        if op[0] == "add":
            clock.add([where(i) for i in op[1]])
            for i in op[1]:
                ref.state[i] = COLD
        elif op[0] == "run":  # a run of slots in one slab: the batched path of add
            slab, first = where(op[1])
            n = min(op[2], STRIDE - first)
            clock.add([(slab, s) for s in range(first, first + n)])
            for s in range(first, first + n):
                ref.state[slab * STRIDE + s] = COLD
        elif op[0] == "touch":
            clock.touch([where(i) for i in op[1]])
            for i in op[1]:
                if ref.state[i]:
                    ref.state[i] = HOT
        elif op[0] in ("touch_cols", "touch_run"):  # a planned get's columns (slice fast path)
            if op[0] == "touch_run":
                slab, first = where(op[1])
                ids = [slab * STRIDE + s for s in range(first, first + min(op[2], STRIDE - first))]
            else:
                ids = op[1]
            cols = array.array("Q", [where(i)[0] for i in ids]), array.array("Q", [where(i)[1] for i in ids])
            clock.touch_slots(*cols)
            for i in ids:
                if ref.state[i]:
                    ref.state[i] = HOT
        elif op[0] == "near_run":  # uint64 columns of a run but for one repeated slot
            slab, first = where(op[1])
            n = min(op[2], STRIDE - first)
            if n < 3:
                continue
            ids = [slab * STRIDE + s for s in range(first, first + n)]
            ids[1] = ids[0]  # first, first, first + 2, ...: ends where a run would
            cols = array.array("Q", [where(i)[0] for i in ids]), array.array("Q", [where(i)[1] for i in ids])
            if op[3]:
                clock.add_slots(*cols)
                for i in ids:
                    ref.state[i] = COLD
            else:
                clock.touch_slots(*cols)
                for i in ids:
                    if ref.state[i]:
                        ref.state[i] = HOT
        elif op[0] == "discard":
            assert clock.discard(*where(op[1])) == bool(ref.state[op[1]])
            ref.state[op[1]] = ABSENT
        else:
            assert clock.evict(op[1]) == [where(i) for i in ref.evict(op[1])]
            assert clock.hand % len(ref.state) == ref.hand % len(ref.state) or not clock.count
        assert list(clock.state) == ref.state
        assert clock.count == sum(1 for s in ref.state if s)


def test_clock_rejects_slots_outside_it() -> None:
    clock = Clock(4)
    clock.grow(2)
    with pytest.raises(ValueError, match="outside"):
        clock.add([(0, 4)])
    with pytest.raises(ValueError, match="outside"):
        clock.add([(2, 0)])
    assert (0, 4) not in clock and not clock.discard(5, 0)
    clock.touch([(9, 9), (0, 7)])  # ignored
    clock.touch_slots([9, 0, 0], [9, 7, 6])  # ignored
    clock.touch_slots([2, 2], [0, 1])  # a run past the array: ignored
    assert clock.count == 0 and clock.evict(3) == []


def open_store(root: str, slots: int) -> SlabStore:
    ns = Namespace(model="clock", kv_dtype="uint8", layout="page_first", page_size=64, tag="t")
    stride = Geometry(64).stride
    store = SlabStore(root, ns, 64, capacity_bytes=slots * stride, slab_bytes=4 * stride)
    assert store.max_slots == slots and store.slots_per_slab == 4
    return store


def put(store: SlabStore, keys: list[str]) -> None:
    plan = store.reserve_new(keys)
    assert not plan.full
    store.commit([keys[i] for i in plan.todo], plan.slots, [0] * len(plan.slots), plan.digests)


def test_store_evicts_least_recently_used_in_effect() -> None:
    with tempfile.TemporaryDirectory() as root:
        store = open_store(root, 10)
        try:
            put(store, [f"a{i}" for i in range(10)])  # full
            put(store, ["b0", "b1", "b2"])  # no reads: the three written first go
            assert store.contains([f"a{i}" for i in range(10)]) == [False] * 3 + [True] * 7
            read = [f"a{i}" for i in (3, 4, 5)]
            found = store.lookup(read)
            store.touch([(loc.entry.slab, loc.entry.slot) for loc in found if loc is not None])
            put(store, [f"c{i}" for i in range(4)])  # the read pages outlive the unread ones
            assert store.contains(read) == [True] * 3
            assert store.contains(["a6", "a7", "a8", "a9"]) == [False] * 4
            assert store.contains(["b0", "b1", "b2", "c0", "c3"]) == [True] * 5
            assert store.stats()["own_pages"] == 10 and store.evictions == 7
            assert store.stats()["lru_bytes"] <= 12  # one byte a slot (3 slabs of 4)
        finally:
            store.close()


def test_reopened_writer_evicts_its_oldest_pages_first() -> None:
    with tempfile.TemporaryDirectory() as root:
        store = open_store(root, 8)
        put(store, [f"a{i}" for i in range(8)])
        put(store, ["b0", "b1"])  # evicts a0, a1; b0, b1 in their slots
        store.close()
        store = open_store(root, 8)  # adopts the writer: the hand starts past the newest
        try:
            put(store, ["c0", "c1"])
            assert store.contains(["a2", "a3"]) == [False, False]
            assert store.contains(["b0", "b1", "c0", "c1", "a4"]) == [True] * 5
        finally:
            store.close()


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 300), st.integers(0, 40), st.lists(st.integers(0, 400), max_size=40))
def test_iota_and_is_run(first: int, n: int, other: list[int]) -> None:
    """iota is range(first, first + n) as an array('Q'); is_run says whether a column
    (array or list) is exactly that run."""
    from hicache_l3.slab.clock import iota, is_run

    run = iota(first, n)
    assert run.typecode == "Q" and list(run) == list(range(first, first + n))
    assert is_run(run, first, n) and is_run(list(run), first, n)
    col = array.array("Q", other)
    assert is_run(col, first, len(other)) == (other == list(range(first, first + len(other))))
    assert is_run(other, first, len(other)) == (other == list(range(first, first + len(other))))


# ---- Clocks: the even slabs' CLOCK and the odd slabs', victims from both ---------------------
SPLIT_SLABS = 4

split_ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, SPLIT_SLABS * STRIDE - 1), max_size=12, unique=True)),
    st.tuples(st.just("touch"), st.lists(st.integers(0, SPLIT_SLABS * STRIDE - 1), max_size=10)),
    st.tuples(st.just("touch_cols"), st.lists(st.integers(0, SPLIT_SLABS * STRIDE - 1), max_size=12)),
    st.tuples(st.just("discard"), st.integers(0, SPLIT_SLABS * STRIDE - 1)),
    st.tuples(st.just("evict"), st.integers(0, 2 * SPLIT_SLABS * STRIDE)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(split_ops)
def test_clocks_are_one_reference_clock_per_slab_parity(program: list[tuple]) -> None:
    """Each of the two clocks is exactly the slot-by-slot CLOCK of its slabs (slab k is
    slab k // 2 of clock k % 2); an eviction takes ``n`` victims (fewer only when fewer
    pages exist), the even clock's share within one page of its part of the pages."""
    clocks = Clocks(STRIDE)
    clocks.grow(SPLIT_SLABS)
    refs = [ReferenceClock((SPLIT_SLABS // 2) * STRIDE) for _ in range(2)]

    def ref_of(i: int) -> tuple[ReferenceClock, int]:
        slab, slot = divmod(i, STRIDE)
        return refs[slab % 2], (slab // 2) * STRIDE + slot

    for op in program:
        if op[0] == "add":
            clocks.add([divmod(i, STRIDE) for i in op[1]])
            for i in op[1]:
                ref, j = ref_of(i)
                ref.state[j] = COLD
        elif op[0] in ("touch", "touch_cols"):
            if op[0] == "touch":
                clocks.touch([divmod(i, STRIDE) for i in op[1]])
            else:
                clocks.touch_slots(array.array("Q", [i // STRIDE for i in op[1]]),
                                   array.array("Q", [i % STRIDE for i in op[1]]))
            for i in op[1]:
                ref, j = ref_of(i)
                if ref.state[j]:
                    ref.state[j] = HOT
        elif op[0] == "discard":
            ref, j = ref_of(op[1])
            assert clocks.discard(*divmod(op[1], STRIDE)) == bool(ref.state[j])
            ref.state[j] = ABSENT
        else:
            pages = [sum(1 for s in ref.state if s) for ref in refs]
            got = clocks.evict(op[1])
            n = min(op[1], sum(pages))
            assert len(got) == n == len(set(got))
            k = sum(1 for slab, _ in got if slab % 2 == 0)
            if n:
                assert n * pages[0] / sum(pages) - 1 < k < n * pages[0] / sum(pages) + 1 or n - k == pages[1]
            want = [((slot // STRIDE) * 2 + p, slot % STRIDE)
                    for p, m in ((0, k), (1, n - k)) for slot in refs[p].evict(m)]
            assert got == want
        assert len(clocks) == sum(1 for ref in refs for s in ref.state if s)
        assert [list(c.state) for c in clocks.clocks] == [ref.state for ref in refs]


def test_clocks_hands_start_past_each_parity_newest_page() -> None:
    clocks = Clocks(4)
    clocks.grow(2)
    clocks.add([(0, 0), (0, 1), (1, 0), (1, 1)])
    clocks.start_past([(1, 1), (0, 0), (1, 0), (0, 1)])  # written in this order
    assert clocks.evict(2) == [(0, 0), (1, 1)]  # each clock's oldest: just past its newest


def test_a_store_at_capacity_takes_a_batch_from_two_slab_files() -> None:
    """A store of at least twice ``split_min_slots`` slots has two slabs or more, and a
    batch evicts the least recently written pages of each, in proportion: its slots lie in
    two files (which the lanes or threads write at once); a small store keeps one clock."""
    ns = Namespace(model="clock", kv_dtype="uint8", layout="page_first", page_size=64, tag="split")
    page = 64 << 10
    stride = Geometry(page).stride
    half = split_min_slots(stride)
    with tempfile.TemporaryDirectory() as root:
        store = SlabStore(root, ns, page, capacity_bytes=2 * half * stride)
        try:
            assert store.slots_per_slab == half and isinstance(store._clock, Clocks)
            keys = [f"a{i}" for i in range(2 * half)]
            for lo in range(0, 2 * half, 128):  # fresh: slab 0 fills first, then slab 1
                put(store, keys[lo:lo + 128])
            plan = store.reserve_new([f"b{i}" for i in range(128)])
            assert sorted(set(plan.slots.slabs)) == [0, 1]
            store.commit([f"b{i}" for i in plan.todo], plan.slots, [0] * 128, plan.digests)
            gone = keys[:64] + keys[half:half + 64]  # each slab's oldest 64
            assert store.contains(gone) == [False] * 128
            assert all(store.contains([k for k in keys if k not in set(gone)]))
            assert store.stats()["own_pages"] == 2 * half
        finally:
            store.close()
    with tempfile.TemporaryDirectory() as root:
        small = SlabStore(root, ns, page, capacity_bytes=(half + 5) * stride)
        try:
            assert small.slots_per_slab == half + 5 and isinstance(small._clock, Clock)
        finally:
            small.close()


@settings(max_examples=300, deadline=None)
@given(slabs=st.lists(st.integers(0, 4), max_size=30), most=st.integers(1, 5))
def test_slab_spans_are_the_runs_of_a_column_or_none(slabs: list[int], most: int) -> None:
    """slab_spans gives the column's runs of equal slabs in order, exactly when every slab's
    entries are together and there are at most ``most`` runs; None otherwise."""
    from hicache_l3.slab.clock import slab_spans

    runs: list[tuple[int, int, int]] = []
    for j, slab in enumerate(slabs):
        if runs and runs[-1][0] == slab:
            runs[-1] = (slab, runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((slab, j, 1))
    together = len({slab for slab, _, _ in runs}) == len(runs)
    want = runs if together and len(runs) <= most else None
    assert slab_spans(array.array("Q", slabs), most) == want
    assert slab_spans(slabs, most) == want
