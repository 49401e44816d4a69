"""The page table (hicache_l3/slab/table.py): the C table against the dict reference."""

from __future__ import annotations

import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.slab.format import Entry
from hicache_l3.slab.table import (
    DictPageTable,
    NativePageTable,
    PageTable,
    digest,
    digests,
    native_library,
    new_table,
)


def _native() -> NativePageTable:
    lib = native_library()
    assert lib is not None, "the C page table must be built for this test (hicache_l3._batch_io)"
    return NativePageTable(lib)


def _dig(home: int, n: int) -> bytes:
    """A digest whose home bucket is ``home`` (low bits): many share one, forcing long
    probe runs and backward shifts."""
    return bytes([home]) + bytes(7) + n.to_bytes(2, "little") + bytes(6)


DIG = st.builds(_dig, st.integers(0, 3), st.integers(0, 400))
ENTRY = st.builds(Entry, st.integers(0, 2), st.integers(0, 2), st.integers(0, 40),
                  st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))
OP = st.one_of(
    st.tuples(st.just("put"), DIG, ENTRY),
    st.tuples(st.just("put_many"), st.lists(st.tuples(DIG, ENTRY), max_size=30)),
    st.tuples(st.just("pop"), DIG),
    st.tuples(st.just("pop_many"), st.lists(DIG, max_size=30)),
    st.tuples(st.just("get_many"), st.lists(DIG, max_size=30)),
    st.tuples(st.just("at"), st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 40))),
    st.tuples(st.just("at_many"), st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2),
                                                     st.integers(0, 40)), max_size=10)),
    st.tuples(st.just("select"), st.one_of(st.none(), st.integers(0, 2)),
              st.one_of(st.none(), st.integers(0, 2))),
    st.tuples(st.just("reload")),
)


def _apply(table: PageTable, op: tuple) -> object:
    kind = op[0]
    if kind == "put":
        return table.put(op[1], op[2])
    if kind == "put_many":
        return table.put_many([d for d, _ in op[1]], [e for _, e in op[1]])
    if kind == "pop":
        return table.pop(op[1])
    if kind == "pop_many":
        return table.pop_many(op[1])
    if kind == "get_many":
        return table.get_many(op[1]), table.contains_many(op[1]), [table.get(d) for d in op[1]]
    if kind == "at":
        return table.at(op[1])
    if kind == "at_many":
        return table.at_many(op[1])
    if kind == "select":
        return sorted(table.select(op[1], op[2]))
    snapshot = table.export()  # "reload": the export loads into a fresh table identically
    fresh = type(table)() if isinstance(table, DictPageTable) else _native()
    fresh.load(*snapshot)
    return sorted(fresh.select()) == sorted(table.select()) and len(fresh) == len(table)


def _state(table: PageTable) -> tuple[list, list, int]:
    return sorted(table.select()), sorted(table.slot_items()), len(table)


@settings(max_examples=300, deadline=None)
@given(st.lists(OP, max_size=60))
def test_native_table_agrees_with_the_dict_reference(ops: list[tuple]) -> None:
    ref, native = DictPageTable(), _native()
    for op in ops:
        assert _apply(native, op) == _apply(ref, op), op
        assert _state(native) == _state(ref)
    # the inverse is exactly the inverse of the page map
    pages, slots, n = _state(native)
    assert sorted((e[:3], d) for d, e in pages) == slots and len(pages) == n


def test_growth_and_removal_of_many_pages_keeps_every_page() -> None:
    table = _native()
    ds = digests([f"k{i}" for i in range(20000)])
    entries = [Entry(i % 3, i // 1000, i % 1000, i + 1, 4096, i) for i in range(20000)]
    table.put_many(ds, entries)
    assert len(table) == 20000 and table.get_many(ds) == entries
    assert table.nbytes < 20000 * 200  # buckets, not Python objects: 48 + 32 B at load 0.35-0.7
    assert table.pop_many(ds[::2]) == 10000
    assert table.contains_many(ds) == [i % 2 == 1 for i in range(20000)]
    assert table.at((1, 0, 1)) == ds[1] and table.at((2, 0, 2)) is None
    assert sorted(table.select(writer=1, slab=0)) == sorted(
        (d, e) for d, e in zip(ds, entries) if e.writer == 1 and e.slab == 0 and e.slot % 2 == 1)


@pytest.mark.parametrize("make", [DictPageTable, _native])
def test_out_of_range_entries_are_refused_whole(make: type) -> None:
    table = make()
    good, bad = Entry(0, 0, 0, 1, 1, 0), Entry(0, 0, 1, 1, 2**32, 0)
    with pytest.raises(ValueError, match="out of range"):
        table.put_many([digest("a"), digest("b")], [good, bad])
    with pytest.raises(ValueError, match="out of range"):
        table.put(digest("c"), Entry(2**32 - 1, 0, 0, 1, 1, 0))
    assert len(table) == 0


def test_digest_is_not_the_slot_fingerprint() -> None:
    from hicache_l3.common.integrity import key_fingerprint

    assert digest("key") != key_fingerprint("key") and len(digest("key")) == 16
    assert digests(["a", "b"]) == [digest("a"), digest("b")]


def test_new_table_is_native_when_built() -> None:
    assert isinstance(new_table(), NativePageTable)
    values = array.array("Q", [1, 2, 3, 4, 5, 6])
    table = new_table()
    table.load(digest("x"), values)
    assert table.get(digest("x")) == Entry(1, 2, 3, 4, 5, 6)


RECORDS = st.lists(st.tuples(st.sampled_from([1, 1, 2, 3]), st.text("abc", max_size=4),
                             st.integers(0, 3), st.booleans()), max_size=12)
DAMAGE = st.one_of(st.none(), st.tuples(st.integers(0, 12), st.binary(min_size=1, max_size=20)))


@settings(max_examples=300, deadline=None)
@given(parts=RECORDS, damage=DAMAGE, utf8=st.booleans())
def test_live_put_spans_agree_with_decoding_the_log(parts: list, damage: tuple[int, bytes] | None,
                                                     utf8: bool) -> None:
    """The C scan of a log gives the live PUT records that decode_records + the table
    give, or None (never a different answer) where the log is not all clean records."""
    from hicache_l3.slab.format import PUT, RECORD, decode_records, encode_record
    from hicache_l3.slab.table import live_put_spans

    table, chunks = _native(), []
    for i, (kind, key, slot, indexed) in enumerate(parts):
        key = key + "é" if utf8 and i == 0 else key  # a non-ASCII key: the C scan declines
        entry = Entry(0, 0, slot, i + 1, 64, 0)
        chunks.append(encode_record(kind, key, entry))
        if kind == PUT and indexed:
            table.put(digest(key), entry if i % 3 else entry._replace(gen=i + 2))  # some stale
    if damage is not None:
        chunks.insert(min(damage[0], len(chunks)), damage[1])
    data = b"".join(chunks)
    records, used, skipped = decode_records(data)
    expect = [k for kind, k, e in records if kind == PUT and table.get(digest(k)) is not None
              and table.get(digest(k))[:4] == e[:4]]  # type: ignore[index]
    spans = live_put_spans(table, data)
    clean = used == len(data) and not skipped and all(k.isascii() for _, k, _ in records)
    if spans is None:
        assert not clean
    else:
        assert clean and [data[s + RECORD.size : e].decode() for s, e in spans] == expect
