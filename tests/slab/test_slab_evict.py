"""The eviction take (hicache_l3/slab/evict.py, native/evict.c): a run of slots taken in
one C call equals the page table's take_at_many of the same slots (the reference), on the
C table and through the fallback; the CLOCK's runs never span two slabs and are a
slot-by-slot reference CLOCK's victims."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.slab import evict, native
from hicache_l3.slab.clock import COLD, HOT, Clock
from hicache_l3.slab.format import Entry
from hicache_l3.slab.table import NativePageTable, digest, native_library
from tests.reference.dict_table import DictPageTable
from tests.slab.test_slab_table import _on_image


def raw_library() -> native.IndexCalls:
    """The library itself, not its self-tested view: a C bug fails here, not skips."""
    spec = importlib.util.find_spec("hicache_l3._batch_io")
    if spec is None or spec.origin is None or native_library() is None:
        # CI builds it: an optional build that silently failed must not turn into a green run
        pytest.fail("hicache_l3._batch_io not built: reinstall with a C compiler (cc) present")
    return native.IndexCalls(spec.origin)


puts_st = st.lists(st.tuples(st.integers(0, 30), st.integers(0, 1), st.integers(0, 1), st.integers(0, 12)),
                   max_size=40)


@settings(max_examples=200, deadline=None)
@given(puts_st, st.integers(0, 1), st.integers(0, 1), st.integers(0, 12), st.integers(0, 8))
def test_a_run_taken_in_c_equals_take_at_many(puts: list[tuple[int, int, int, int]], writer: int, slab: int,
                                              first: int, count: int) -> None:
    lib, tables = raw_library(), native_library()
    assert tables is not None
    ours, ref, dict_ref = NativePageTable(tables), NativePageTable(tables), DictPageTable()
    for gen, (k, w, s, slot) in enumerate(puts, 1):
        for t in (ours, ref, dict_ref):
            t.put(digest(f"k{k}"), Entry(w, s, slot, gen, 64, k))
    wheres = [(writer, slab, slot) for slot in range(first, first + count)]
    expected = ref.take_at_many(wheres)
    assert lib.take_run(ours._t, writer, slab, first, count) == expected
    assert evict.take_run(dict_ref, writer, slab, first, count) == expected  # the fallback
    assert sorted(ours.select()) == sorted(ref.select()) == sorted(dict_ref.select())


@settings(max_examples=200, deadline=None)
@given(puts_st, st.integers(0, 40), st.integers(0, 1), st.integers(0, 1), st.integers(0, 12),
       st.integers(0, 8))
def test_a_run_taken_in_c_equals_take_at_many_over_two_layers_and_journals(
        puts: list[tuple[int, int, int, int]], based: int, writer: int, slab: int, first: int,
        count: int) -> None:
    """The same with the first ``based`` puts in a checkpoint image's base layer (the rest
    in the delta, superseding some of them) and a journal on: the take removes base pages
    too, and journals what take_at_many journals (replayed onto the table as it was
    before the take, both journals give the same table)."""
    lib = raw_library()
    pages = [(digest(f"k{k}"), Entry(w, s, slot, gen, 64, k)) for gen, (k, w, s, slot) in enumerate(puts, 1)]
    made = []
    for _ in range(4):  # ours, the reference, and the two tables the journals are replayed on
        t = _on_image(pages[:based])
        for d, e in pages[based:]:
            t.put(d, e)
        made.append(t)
    ours, ref, ours_replay, ref_replay = made
    for t in (ours, ref):
        t.journal_start()
    wheres = [(writer, slab, slot) for slot in range(first, first + count)]
    expected = ref.take_at_many(wheres)
    assert lib.take_run(ours._t, writer, slab, first, count) == expected
    assert sorted(ours.select()) == sorted(ref.select()) and ours.check() == 0
    ours.journal_take().apply(ours_replay)
    ref.journal_take().apply(ref_replay)
    assert sorted(ours_replay.select()) == sorted(ref_replay.select()) == sorted(ref.select())


def test_out_of_range_runs_take_the_reference_path() -> None:
    t = DictPageTable()
    t.put(digest("a"), Entry(0, 0, 1, 1, 64, 0))
    assert evict.take_run(t, -1, 0, 0, 3) == (b"", evict.array.array("Q"))
    ds, values = evict.take_run(t, 0, 0, 0, 3)
    assert ds == digest("a") and list(values) == [0, 0, 1, 1, 64, 0]


def reference_victims(state: list[int], hand: int, n: int) -> list[int]:
    """Second-chance CLOCK one slot at a time (as tests/slab/test_slab_clock.py's model)."""
    out: list[int] = []
    n = min(n, sum(1 for s in state if s))
    while len(out) < n:
        if state[hand] == HOT:
            state[hand] = COLD
        elif state[hand] == COLD:
            state[hand] = 0
            out.append(hand)
        hand = (hand + 1) % len(state)
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0, COLD, HOT]), min_size=12, max_size=12), st.integers(0, 11),
       st.integers(1, 14))
def test_clock_runs_stay_in_one_slab_and_are_the_reference_victims(state: list[int], hand: int,
                                                                   n: int) -> None:
    clock = Clock(4)
    clock.grow(3)
    clock.state[:] = bytes(state)
    clock.count = sum(1 for s in state if s)
    clock.hand = hand
    runs = clock.evict_runs(n)
    victims = reference_victims(list(state), hand, n)
    assert [slab * 4 + slot for slab, first, k in runs for slot in range(first, first + k)] == victims
    assert all(k >= 1 and first >= 0 and first + k <= 4 for _, first, k in runs)
    assert clock.count == sum(1 for s in state if s) - len(victims)
    assert all(clock.state[i] == 0 for i in victims)
