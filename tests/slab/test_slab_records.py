"""The writer's batch paths against their references: the C PUT-record encoder
(hicache_l3/slab/records.py, native/records.c) writes exactly format.encode_puts's bytes
and raises its errors; the C marker records and offsets of a set batch are
format.encode_markers's and Geometry's; ``take_at_many`` of the C page table equals the dict table's; a
set at capacity keeps per-key NO_SPACE-free plans, abort gives slots back, and a DEL
read from another process's log frees the owner's slot."""

from __future__ import annotations

import array
import importlib.util
import struct
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.common.integrity import key_fingerprint
from hicache_l3.common.keys import Namespace
from hicache_l3.slab import native, records
from hicache_l3.slab import table as table_mod
from hicache_l3.slab.format import RECORD_BYTES, Entry, Geometry, decode_records, encode_marker, encode_puts
from hicache_l3.slab.store import SlabStore
from hicache_l3.slab.table import NativePageTable, digest
from tests.reference.dict_table import DictPageTable
from tests.reference.records import python_write_markers

u32 = st.integers(0, 0xFFFFFFFE)
entry_st = st.builds(Entry, u32, u32, u32, st.integers(0, 2**64 - 1), u32, st.integers(0, 2**64 - 1))


def native_or_skip() -> None:
    native.library()  # ImportError, naming the fix, where the library is not built


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=90), entry_st), min_size=1, max_size=40))
def test_c_records_equal_the_reference(batch: list[tuple[str, Entry]]) -> None:
    native_or_skip()
    keys, entries = [k for k, _ in batch], [e for _, e in batch]
    data = records.encode_puts(keys, entries)
    assert data == encode_puts(keys, entries)
    decoded, used, skipped = decode_records(data)
    assert used == len(data) and not skipped
    assert [(key, entry) for _, key, entry in decoded] == batch


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text(max_size=40), entry_st), min_size=1, max_size=40))
def test_c_records_from_values_equal_the_reference(batch: list[tuple[str, Entry]]) -> None:
    """encode_put_values (a commit's path: the keys passed to C as lines, or by end
    offsets where a key holds a newline) writes encode_puts's bytes."""
    native_or_skip()
    keys, entries = [k for k, _ in batch], [e for _, e in batch]
    values = array.array("Q", [v for e in entries for v in e])
    assert records.encode_put_values(keys, values) == encode_puts(keys, entries)
    lines = native.library().index.encode_lines(keys, values)
    assert lines == (None if any("\n" in k for k in keys) else encode_puts(keys, entries))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=40))
def test_key_digests_equal_the_reference(keys: list[str]) -> None:
    """key_digests: table.digests's digests in one buffer (C, or the reference where a
    key holds a newline or is not UTF-8 encodable), read as the list it stands for."""
    native_or_skip()
    ds = records.key_digests(keys)
    assert isinstance(ds, table_mod.Digests) and ds.blob == b"".join(table_mod.digests(keys))
    assert ds == table_mod.digests(keys) and list(ds) == table_mod.digests(keys) and len(ds) == len(keys)
    made = native.library().index.key_digests(keys)
    if keys and not any("\n" in k for k in keys):  # from C: it says whether they are all different
        assert made is not None and table_mod.Digests(*made) == ds
        assert ds.distinct == (len(set(keys)) == len(keys))
    else:
        assert ds.distinct is None  # (the reference does not look)


def test_key_digests_of_unencodable_keys_raise_as_the_reference_does() -> None:
    with pytest.raises(UnicodeEncodeError):
        table_mod.digests(["\ud800"])
    with pytest.raises(UnicodeEncodeError):
        records.key_digests(["ok", "\ud800"])


def test_digests_read_as_a_list() -> None:
    ref = [digest(f"k{i}") for i in range(5)]
    ds = table_mod.Digests(b"".join(ref))
    assert len(ds) == 5 and ds[0] == ref[0] and ds[-1] == ref[-1] and list(ds) == ref
    assert ds[1:3] == ref[1:3] and isinstance(ds[1:3], table_mod.Digests) and ds[::2] == ref[::2]
    assert ds[3:1] == [] and ds == ref and ds != ref[:4] and table_mod.joined(ds) == b"".join(ref)
    assert table_mod.joined(ref) == ds.blob
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(ValueError):
        table_mod.Digests(b"x" * 17)


def test_values_out_of_range_raise_as_the_reference_does() -> None:
    native_or_skip()
    too_big = [Entry(2**32, 0, 0, 1, 64, 0)]
    with pytest.raises(struct.error):
        encode_puts(["k"], too_big)
    with pytest.raises(struct.error):
        records.encode_puts(["k"], too_big)
    with pytest.raises(struct.error):
        records.encode_puts(["x" * 70000], [Entry(0, 0, 0, 1, 64, 0)])
    assert records.encode_puts([], []) == b""


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 1), st.integers(0, 5)), max_size=30),
       st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5)), max_size=8))
def test_take_at_many_equals_the_dict_table(puts: list[tuple[int, int, int]],
                                            take: list[tuple[int, int]]) -> None:
    lib = table_mod.native_library()
    native, ref = NativePageTable(lib), DictPageTable()
    for gen, (k, slab, slot) in enumerate(puts, 1):
        for t in (native, ref):
            t.put(digest(f"k{k}"), Entry(0, slab, slot, gen, 64, 0))
    wheres = [(0, slab, slot) for slab, slot in take] + [(-1, 0, 0)]
    assert native.take_at_many(wheres) == ref.take_at_many(wheres)
    assert dict(native.select()) == dict(ref.select())


def open_store(root: str, slots: int) -> SlabStore:
    ns = Namespace(model="rec", kv_dtype="uint8", layout="page_first", page_size=64, tag="t")
    stride = Geometry(64).stride
    return SlabStore(root, ns, 64, capacity_bytes=slots * stride, slab_bytes=4 * stride)


def test_abort_gives_slots_back_and_a_logged_del_frees_the_owners_slot() -> None:
    with tempfile.TemporaryDirectory() as root:
        owner, other = open_store(root, 6), open_store(root, 6)
        try:
            keys = [f"k{i}" for i in range(6)]
            plan = owner.reserve_new(keys)
            owner.commit(keys, plan.slots, [0] * 6, plan.digests)
            plan = owner.reserve_new(["a", "b"])  # at capacity: evicts two
            assert len(plan.slots) == 2 and not plan.full and owner.evictions == 2
            owner.abort(plan.slots)
            assert owner.stats()["free_slots"] == 2 and owner.stats()["own_pages"] == 4
            assert other.delete(["k5"]) == [True]  # another process's DEL
            owner.refresh()  # reads it: the owner's slot is free again
            assert owner.stats()["free_slots"] == 3 and owner.stats()["own_pages"] == 3
            plan = owner.reserve_new(["a", "b", "c"])  # free slots first: nothing evicted
            assert len(plan.slots) == 3 and owner.evictions == 2
            owner.commit(["a", "b", "c"], plan.slots, [0] * 3, plan.digests)
            assert owner.contains(["a", "b", "c", "k2", "k5"]) == [True, True, True, True, False]
        finally:
            owner.close()
            other.close()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", "d", "e\nf", "é"]), max_size=12))
def test_reserve_new_plans_each_new_key_once(keys: list[str]) -> None:
    """reserve_new's plan: the first index of each key not stored yet (stored: "a" and
    "b"), whatever repeats, newlines or non-ASCII keys the batch holds, with those keys'
    digests."""
    with tempfile.TemporaryDirectory() as root:
        store = open_store(root, 32)
        try:
            plan = store.reserve_new(["a", "b"])
            store.commit(["a", "b"], plan.slots, [0, 0], plan.digests)
            plan = store.reserve_new(keys)
            first = [i for i, k in enumerate(keys) if k not in ("a", "b") and keys.index(k) == i]
            assert plan.todo == first and not plan.full and len(plan.slots) == len(first)
            assert list(plan.digests) == [digest(keys[i]) for i in first]
            store.abort(plan.slots)
        finally:
            store.close()


key_st = st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=300)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(key_st, st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1)), min_size=1,
                max_size=40),
       st.sampled_from([64, 4096, 65536, 20000, 1 << 20]))
def test_c_write_markers_equal_the_reference(batch: list[tuple[str, int, int]], slot_bytes: int) -> None:
    """The set batch's marker records (fingerprint of each key, generation, length,
    checksum 0) and slot offsets from C are the reference's bytes and numbers."""
    keys = [k for k, _, _ in batch]
    gens = array.array("Q", [g for _, g, _ in batch])
    slots = array.array("Q", [s for _, _, s in batch])
    geometry = Geometry(slot_bytes)
    # the library itself, not its self-tested view: a C bug fails here instead of skipping
    made = raw_library().write_markers(keys, gens, slots, geometry)
    assert made is not None
    ref = python_write_markers(keys, gens, slots, geometry)
    assert made == ref
    assert list(ref.data_offsets) == [geometry.data_offset(s) for s in slots]
    assert list(ref.marker_offsets) == [geometry.marker_offset(s) for s in slots]
    for j, key in enumerate(keys):
        assert ref.records[RECORD_BYTES * j : RECORD_BYTES * (j + 1)] == encode_marker(
            gens[j], slot_bytes, 0, key_fingerprint(key))


def raw_library() -> native.IndexCalls:
    spec = importlib.util.find_spec("hicache_l3._batch_io")
    assert spec is not None and spec.origin is not None, \
        "hicache_l3._batch_io must be built for this test (CI builds it; the reference runs without it)"
    return native.IndexCalls(spec.origin)


def test_write_markers_fall_back_for_keys_c_does_not_take() -> None:
    """A key holding a newline (the C call's separator) or a non-ASCII character: the
    reference makes the records, the same as for any other key."""
    geometry = Geometry(4096)
    for keys in (["a\nb", "c"], ["clé", "d"], ["\n", "\n\n"]):
        gens, slots = array.array("Q", [3, 4]), array.array("Q", [0, 600])
        assert records.write_markers(keys, gens, slots, geometry) == python_write_markers(
            keys, gens, slots, geometry)
    assert raw_library().write_markers(["a\nb", "c"], array.array("Q", [1, 2]), array.array("Q", [0, 1]),
                                       geometry) is None
