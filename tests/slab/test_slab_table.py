"""The page table (hicache_l3/slab/table.py): the C table against the dict reference."""

from __future__ import annotations

import array
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.slab.format import Entry
from hicache_l3.slab.table import (
    NativePageTable,
    PageTable,
    build_image,
    digest,
    digests,
    native_library,
    new_table,
)
from tests.reference.dict_table import DictPageTable


def _native() -> NativePageTable:
    lib = native_library()
    assert lib is not None, "the C page table must be built for this test (hicache_l3._batch_io)"
    return NativePageTable(lib)


def _dig(home: int, n: int) -> bytes:
    """A digest whose home bucket is ``home``'s place in the array (its hash's top byte:
    the bucket is hash * capacity >> 64): many share one, forcing long probe runs and
    backward shifts; 0xFF's run wraps around the array's end."""
    return bytes(7) + bytes([home]) + n.to_bytes(2, "little") + bytes(6)


DIG = st.builds(_dig, st.sampled_from([0, 1, 0x80, 0xFE, 0xFF]), st.integers(0, 400))
# in range, with a few lengths (length classes) and the extremes
ENTRY = st.builds(Entry, st.integers(0, 2), st.integers(0, 2), st.integers(0, 40),
                  st.one_of(st.integers(0, 2**48 - 1), st.just(2**48 - 1)),
                  st.one_of(st.sampled_from([0, 4096, 2**32 - 1]), st.integers(0, 2**32 - 1)),
                  st.integers(0, 2**64 - 1))
# each field at its limit or one past it: both tables refuse the whole call alike
EDGE = st.builds(Entry, st.sampled_from([0, 65534, 65535]), st.sampled_from([0, 2**24 - 1, 2**24]),
                 st.sampled_from([0, 2**24 - 1, 2**24]), st.sampled_from([0, 2**48 - 1, 2**48]),
                 st.sampled_from([1, 2**32 - 1, 2**32]), st.just(7))
ANY_ENTRY = st.one_of(ENTRY, ENTRY, ENTRY, EDGE)
WHERE = st.one_of(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 40)),
                  st.tuples(st.sampled_from([65534, 65535]), st.sampled_from([0, 2**24 - 1, 2**24]),
                            st.sampled_from([2**24 - 1, 2**24])))
OP = st.one_of(
    st.tuples(st.just("put"), DIG, ANY_ENTRY),
    st.tuples(st.just("put_many"), st.lists(st.tuples(DIG, ANY_ENTRY), max_size=30)),
    st.tuples(st.just("reserve"), st.integers(0, 700)),
    st.tuples(st.just("expect"), st.integers(0, 700)),
    st.tuples(st.just("pop"), DIG),
    st.tuples(st.just("pop_many"), st.lists(DIG, max_size=30)),
    st.tuples(st.just("get_many"), st.lists(DIG, max_size=30)),
    st.tuples(st.just("at"), WHERE),
    st.tuples(st.just("at_many"), st.lists(WHERE, max_size=10)),
    st.tuples(st.just("select"), st.one_of(st.none(), st.integers(0, 2)),
              st.one_of(st.none(), st.integers(0, 2))),
    st.tuples(st.just("reload")),
)


def _apply(table: PageTable, op: tuple) -> object:
    try:
        return _run(table, op)
    except ValueError as exc:  # refused: the same way by both
        return "refused", "out of range" in str(exc)


def _run(table: PageTable, op: tuple) -> object:
    kind = op[0]
    if kind == "reserve":
        return table.reserve(op[1])
    if kind == "expect":
        return table.expect(op[1])
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
        assert native.check() == 0, op  # every page and inverse entry is found from its home
    # the inverse is exactly the inverse of the page map
    pages, slots, n = _state(native)
    assert sorted((e[:3], d) for d, e in pages) == slots and len(pages) == n


def test_growth_and_removal_of_many_pages_keeps_every_page() -> None:
    table = _native()
    ds = digests([f"k{i}" for i in range(20000)])
    entries = [Entry(i % 3, i // 1000, i % 1000, i + 1, 4096, i) for i in range(20000)]
    table.put_many(ds, entries)
    assert len(table) == 20000 and table.get_many(ds) == entries
    assert table.nbytes < 20000 * 120  # buckets, not Python objects: 44 B at load 0.53-0.8, a header
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


@pytest.mark.parametrize("make", [DictPageTable, _native])
def test_both_tables_refuse_the_same_limits(make: type) -> None:
    table = make()
    fits = [Entry(65534, 2**24 - 1, 2**24 - 1, 2**48 - 1, 2**32 - 1, 2**64 - 1)]
    table.put_many([digest("fits")], fits)
    assert table.get(digest("fits")) == fits[0] and table.at((65534, 2**24 - 1, 2**24 - 1)) == digest("fits")
    for bad in (Entry(65535, 0, 0, 1, 1, 0), Entry(0, 2**24, 0, 1, 1, 0), Entry(0, 0, 2**24, 1, 1, 0),
                Entry(0, 0, 0, 2**48, 1, 0), Entry(0, 0, 0, 1, 2**32, 0), Entry(0, 0, 0, 1, 1, 2**64)):
        with pytest.raises(ValueError, match="out of range"):
            table.put_many([digest("a"), digest("b")], [Entry(1, 0, 0, 1, 1, 0), bad])
    assert table.select() == [(digest("fits"), fits[0])]
    assert table.at((65535, 0, 0)) is None and table.at((0, 2**24, 0)) is None


@pytest.mark.parametrize("make", [DictPageTable, _native])
def test_length_classes_are_limited_and_a_refused_call_takes_none(make: type) -> None:
    """65535 distinct lengths in a table's life; a call that would pass that adds none of
    its lengths (the next call with one new length still fits)."""
    table = make()
    n = 65533
    ds = [i.to_bytes(16, "little") for i in range(n + 3)]
    table.put_many(ds[:n], [Entry(0, i >> 12, i & 4095, 1, 100 + i, 0) for i in range(n)])
    with pytest.raises(ValueError, match="out of range"):  # three new lengths and one seen
        table.put_many(ds[n : n + 3] + ds[:1], [Entry(1, 0, 0, 1, 1, 0), Entry(1, 0, 1, 1, 2, 0),
                                                Entry(1, 0, 2, 1, 3, 0), Entry(1, 0, 3, 1, 100, 0)])
    assert len(table) == n
    table.pop_many(ds[: n // 2])  # a class stays once seen
    table.put(ds[n], Entry(1, 0, 0, 1, 1, 0))  # the 65534th length
    table.put_many(ds[n + 1 : n + 3], [Entry(1, 0, 1, 1, 2, 0), Entry(1, 0, 2, 1, 2, 0)])  # 65535th
    with pytest.raises(ValueError, match="out of range"):
        table.put(ds[n + 2], Entry(1, 0, 2, 1, 3, 0))
    assert table.get(ds[n + 2]) == Entry(1, 0, 2, 1, 2, 0) and table.get(ds[-4]) == Entry(
        0, (n - 1) >> 12, (n - 1) & 4095, 1, 100 + n - 1, 0)
    if isinstance(table, NativePageTable):
        assert table.check() == 0


@pytest.mark.parametrize("pages", [1, 63, 64, 100, 1000, 12345])
def test_reserve_presizes_any_capacity_and_growth_rebuilds(pages: int) -> None:
    """A reserved table holds its pages without growing (its mapped bytes stay put); past
    them it grows 1.5 times at a time (capacities that are not powers of two), keeping
    every page and its inverse."""
    table = _native()
    table.reserve(pages)
    reserved = table.nbytes
    ds = digests([f"r{i}" for i in range(4 * pages + 200)])
    entries = [Entry(i % 5, i // 4096, i % 4096, i + 1, 4096, i) for i in range(len(ds))]
    table.put_many(ds[:pages], entries[:pages])
    assert table.nbytes == reserved and table.check() == 0
    sizes = {reserved}
    for k in range(pages, len(ds), max(1, pages // 3)):  # grows several times
        table.put_many(ds[k : k + max(1, pages // 3)], entries[k : k + max(1, pages // 3)])
        sizes.add(table.nbytes)
        assert table.check() == 0
    assert len(sizes) >= 3 and table.get_many(ds) == entries
    assert all(table.at(e[:3]) == d for d, e in zip(ds, entries))
    table.reserve(1)  # never shrinks
    assert table.nbytes == max(sizes)
    assert table.pop_many(ds[1::2]) == len(ds) // 2 and table.check() == 0
    assert table.get_many(ds) == [e if i % 2 == 0 else None for i, e in enumerate(entries)]


def test_deletions_wrap_around_the_array_end() -> None:
    """A probe run that starts in the last buckets continues at the first; deleting from
    it shifts buckets back across the end (and their inverse entries with them)."""
    table, ref = _native(), DictPageTable()
    ds = [_dig(0xFF, i) for i in range(30)] + [_dig(0, i) for i in range(5)]
    entries = [Entry(0, 0, i, 1, 64, i) for i in range(len(ds))]
    for t in (table, ref):
        t.put_many(ds, entries)
    for d in ds[:30:3] + ds[30:32]:
        assert table.pop(d) == ref.pop(d)
        assert table.check() == 0 and _state(table) == _state(ref)


def _reserved(pages: int) -> int:
    table = _native()
    table.reserve(pages)
    return table.nbytes


@pytest.mark.parametrize("expected", [5000, 30000, 77777])
def test_growth_lands_on_the_expected_capacity(expected: int) -> None:
    """With a capacity hint nothing is allocated at first; the table grows 1.5x at a time
    and, once one step from the hint, to exactly the hint's size (load 0.8 when full);
    past it, it grows on."""
    table = new_table(capacity=expected)
    assert isinstance(table, NativePageTable) and table.nbytes == new_table().nbytes
    ds = digests([f"e{i}" for i in range(2 * expected)])
    entries = [Entry(0, i >> 12, i & 4095, 1, 64, i) for i in range(len(ds))]
    sizes = []
    for k in range(0, expected, 37):
        table.put_many(ds[k : min(k + 37, expected)], entries[k : min(k + 37, expected)])
        sizes.append(table.nbytes)
    assert sizes[-1] == _reserved(expected) and table.check() == 0
    table.put_many(ds[expected:], entries[expected:])
    assert table.nbytes > sizes[-1] and table.get_many(ds) == entries and table.check() == 0
    huge = new_table(capacity=2**40)  # past any table: grows as without a hint
    huge.put_many(ds[:expected], entries[:expected])
    plain = new_table()
    plain.put_many(ds[:expected], entries[:expected])
    assert huge.nbytes == plain.nbytes


def test_reserve_goes_to_the_expected_capacity_when_one_step_from_it() -> None:
    table = _native()
    table.expect(10000)
    table.reserve(7000)  # 8750 buckets; 1.5x of that passes the 12500 expected
    assert table.nbytes == _reserved(10000)
    table = _native()
    table.expect(10000)
    table.reserve(5000)
    assert table.nbytes == _reserved(5000)


@pytest.mark.parametrize("far", [1, 2, 255])
def test_far_inverse_entries_find_their_home_from_the_page(far: int, tmp_path: Path) -> None:
    """An inverse entry HL3_PT_FAR or more from its home keeps no distance and its home is
    computed from its page: with the table built with a tiny HL3_PT_FAR most entries take
    that path, and it still agrees with the reference."""
    import random
    import shutil
    import subprocess

    from hicache_l3.slab.native import IndexCalls

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None, "a C compiler builds the C libraries; this test needs it too"
    native = Path(__file__).parents[2] / "hicache_l3" / "native"
    lib = tmp_path / "pt_far.so"
    # (records.c: the CRC; evict.c: every index call is bound)
    sources = ["page_table.c", "log_scan.c", "get_plan.c", "table_image.c", "records.c", "evict.c"]
    subprocess.run([cc, "-O1", "-shared", "-fPIC", f"-DHL3_PT_FAR={far}", "-o", str(lib),
                    *(str(native / s) for s in sources)], check=True)
    rng = random.Random(far)
    table, ref = NativePageTable(IndexCalls(str(lib))), DictPageTable()
    ds = [rng.randbytes(16) for _ in range(3000)]
    for step in range(40):
        batch = rng.sample(range(3000), 150)
        entries = [Entry(rng.randrange(3), rng.randrange(4), rng.randrange(300), step + 1, 64, i)
                   for i in batch]
        gone = [ds[i] for i in rng.sample(range(3000), 60)]
        for t in (table, ref):
            t.put_many([ds[i] for i in batch], entries)
            t.pop_many(gone)
        assert table.check() == 0 and _state(table) == _state(ref)
    assert len(table) > 1000


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


def _on_image(pages: list[tuple[bytes, Entry]]) -> NativePageTable:
    """A C table whose pages ``pages`` (put in order) lie in its read-only base layer, a
    checkpoint image's (the delta empty)."""
    ref = DictPageTable()
    for d, e in pages:
        ref.put(d, e)
    image = build_image(*ref.export())
    assert image is not None
    fd = os.memfd_create("image")
    try:
        image.write(fd, 4096)
        table = _native()
        table.attach(fd, 4096, image.nbytes)
    finally:
        os.close(fd)  # the mapping stays
    return table


@settings(max_examples=300, deadline=None)
@given(parts=RECORDS, damage=DAMAGE, utf8=st.booleans(), based=st.integers(0, 12),
       hint=st.integers(-1, 12))
def test_live_put_spans_agree_with_decoding_the_log(parts: list, damage: tuple[int, bytes] | None,
                                                     utf8: bool, based: int, hint: int) -> None:
    """The C scan of a log gives the live PUT records that decode_records + the table
    give, or None (never a different answer) where the log is not all clean records;
    also where the table's pages lie in both layers (the first ``based`` pages put are
    in a checkpoint image's base layer, later ones in the delta, superseding some of them
    by key or by slot); and whatever the caller expected (``hint`` live records, the
    result arrays' size: too few takes a second walk, never a shorter answer)."""
    from hicache_l3.slab.format import PUT, RECORD, decode_records, encode_record
    from hicache_l3.slab.table import live_put_spans

    chunks: list[bytes] = []
    puts: list[tuple[bytes, Entry]] = []
    for i, (kind, key, slot, indexed) in enumerate(parts):
        key = key + "é" if utf8 and i == 0 else key  # a non-ASCII key: the C scan declines
        entry = Entry(0, 0, slot, i + 1, 64, 0)
        chunks.append(encode_record(kind, key, entry))
        if kind == PUT and indexed:
            puts.append((digest(key), entry if i % 3 else entry._replace(gen=i + 2)))  # some stale
    table = _on_image(puts[:based]) if based and puts[:based] else _native()
    for d, e in puts[len(puts[:based]) if based else 0:]:
        table.put(d, e)
    if damage is not None:
        chunks.insert(min(damage[0], len(chunks)), damage[1])
    data = b"".join(chunks)
    records, used, skipped = decode_records(data)
    expect = [k for kind, k, e in records if kind == PUT and table.get(digest(k)) is not None
              and table.get(digest(k))[:4] == e[:4]]  # type: ignore[index]
    spans = live_put_spans(table, data, hint)
    clean = used == len(data) and not skipped and all(k.isascii() for _, k, _ in records)
    if spans is None:
        assert not clean
    else:
        assert clean and [data[s + RECORD.size : e].decode() for s, e in spans] == expect
    # a compaction off the lock (slab/compaction.py): the same answer from a fork of the
    # table, without the GIL, written to a file as the spans' bytes one after another
    fd = os.memfd_create("compacted")
    try:
        written = table.snapshot().write_live_puts(data, hint, fd)
        if spans is None:
            assert written is None
        else:
            body = b"".join(data[s:e] for s, e in spans)
            assert written == (len(spans), len(body))
            assert os.pread(fd, len(body) + 1, 0) == body
    finally:
        os.close(fd)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=6).flatmap(
    lambda by_slab: st.tuples(st.just(by_slab), st.lists(st.integers(0, len(by_slab) - 1), max_size=40))))
def test_plan_fds_gathers_each_pages_descriptor(case: tuple[list[int], list[int]]) -> None:
    """A plan's per-page descriptors from the C gather are by_slab[slab_of[where[j]]], as
    the page-by-page map spells them (a batch over several slabs)."""
    by_slab, slab_of = case
    table = _native()
    where = array.array("i", [i for i in range(len(slab_of)) if i % 3 != 1])  # some keys not read
    got = table.plan_fds(where, array.array("i", slab_of), array.array("i", by_slab))
    assert got.typecode == "i"
    assert list(got) == [by_slab[slab_of[i]] for i in where]
