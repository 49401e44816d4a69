"""The C page table's two layers (hicache_l3/native/page_table.c, hl3_pt_attach and
hl3_pt_rebase): a table whose pages lie in a read-only shared image (a checkpoint's) with
its own changes in a private delta answers exactly as the dict reference does, whatever
the operations, attaches and rebases in between; an image that is not whole is refused."""

from __future__ import annotations

import array
import os
import random
import struct
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.slab.format import Entry
from hicache_l3.slab.table import NativePageTable, TableImage, build_image, native_library
from tests.reference.dict_table import DictPageTable
from tests.slab.test_slab_table import DIG, ENTRY, OP, WHERE, _apply, _state


def _native() -> NativePageTable:
    lib = native_library()
    assert lib is not None, "the C page table must be built for this test (hicache_l3._batch_io)"
    return NativePageTable(lib)


def _image_fd(pages: list[tuple[bytes, Entry]], offset: int = 4096) -> tuple[int, int]:
    """A file (unlinked) holding the image of ``pages`` at ``offset``: (fd, image bytes)."""
    ref = DictPageTable()
    ref.put_many([d for d, _ in pages], [e for _, e in pages])
    image = build_image(*ref.export())
    assert image is not None
    fd = os.memfd_create("image")
    image.write(fd, offset)
    return fd, image.nbytes


def _attached(pages: list[tuple[bytes, Entry]]) -> NativePageTable:
    fd, n = _image_fd(pages)
    table = _native()
    try:
        table.attach(fd, 4096, n)
    finally:
        os.close(fd)  # the mapping stays
    return table


LAYER_OP = st.one_of(
    OP, OP, OP,
    st.tuples(st.just("attach")),  # a fresh table on the image of this one
    st.tuples(st.just("rebase")),  # rebased on the image of this one
    st.tuples(st.just("rebase_other"), st.lists(st.tuples(DIG, ENTRY), max_size=40)),
    st.tuples(st.just("take"), st.lists(WHERE, max_size=10)),
    st.tuples(st.just("snapshot")),  # journal on; a table on the image of this one, made now...
    st.tuples(st.just("take_part")),  # ... takes the journal so far (which goes on from none)...
    st.tuples(st.just("adopt")),  # ... catches up with the journal and replaces this one
    # a snapshot (a fork sharing the base) with pages put after, kept while the table goes on...
    st.tuples(st.just("fork"), st.lists(st.tuples(DIG, ENTRY), max_size=5)),
    st.tuples(st.just("use_fork"), st.sampled_from(["table", "image", "rebase"])),  # ... used later
)


def _check_fork(held: tuple[TableImage, DictPageTable], how: str) -> None:
    """A kept snapshot holds what the table held when it was taken, used as a standalone
    table, through its written image, or rebased on an image of another table."""
    image, expected = held
    if how == "table":  # the standalone copy: no base, every page in its own arrays
        assert _state(image.table) == _state(expected)  # (a fork with no pages put shares its base)
        table = image.prepare()
        assert table.delta_len == len(table) and table.shared_nbytes == 0
    elif how == "image":
        fd = os.memfd_create("image")
        try:
            image.write(fd, 4096)
            table = _native()
            table.attach(fd, 4096, image.nbytes)
        finally:
            os.close(fd)
    else:
        fd, n = _image_fd([(bytes([7]) * 16, Entry(0, 0, 9, 1, 64, 1))])
        try:
            image.rebase(fd, 4096, n)
        finally:
            os.close(fd)
        table = image.table
    assert _state(table) == _state(expected) and table.check() == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(LAYER_OP, max_size=60))
def test_layered_table_agrees_with_the_dict_reference(ops: list[tuple]) -> None:
    ref, native = DictPageTable(), _native()
    pending: NativePageTable | None = None
    forks: list[tuple[TableImage, DictPageTable]] = []
    for op in ops:
        if op[0] == "snapshot" and pending is None:
            native.journal_start()
            pending = _attached(native.select())
        elif op[0] == "adopt" and pending is not None:
            pending.catch_up(native)
            native, pending = pending, None
        elif op[0] == "take_part" and pending is not None:
            native.journal_take().apply(pending)
            assert native.journal_len == 0
            continue
        elif op[0] in ("snapshot", "adopt", "take_part"):
            continue
        elif op[0] == "fork":  # the pages with pages put after, as the reference would
            fork = native.snapshot(b"".join(d for d, _ in op[1]),
                                   array.array("Q", [v for _, e in op[1] for v in e]))
            expected = DictPageTable()
            expected.load(*ref.export())
            expected.put_many([d for d, _ in op[1]], [e for _, e in op[1]])
            forks.append((fork, expected))
        elif op[0] == "use_fork":
            if forks:
                _check_fork(forks.pop(0), op[1])
            continue
        elif op[0] in ("attach", "rebase", "rebase_other"):  # the pages do not change
            fd, n = _image_fd(op[1] if op[0] == "rebase_other" else native.select())
            try:
                if op[0] == "attach":
                    native, pending = _native(), None
                    native.attach(fd, 4096, n)
                else:
                    native.rebase(fd, 4096, n)
            finally:
                os.close(fd)
            if op[0] == "attach":
                ref = DictPageTable()  # (its length classes start again, as the delta's)
                ref.load(*native.export())
            if op[0] == "rebase":
                assert native.delta_len == 0
        elif op[0] == "take":
            assert native.take_at_many(op[1]) == ref.take_at_many(op[1]), op
        else:
            assert _apply(native, op) == _apply(ref, op), op
        assert _state(native) == _state(ref), op
        assert native.check() == 0, op  # both layers, the dead bits, no shadowed base page
    for i, held in enumerate(forks):  # (after the table they were forked from changed or went)
        _check_fork(held, ("table", "image", "rebase")[i % 3])


def test_a_base_page_put_again_moves_to_the_delta_and_shadows_nothing() -> None:
    d = [bytes([i]) * 16 for i in range(4)]
    table = _attached([(d[0], Entry(0, 0, 1, 1, 64, 1)), (d[1], Entry(0, 0, 2, 1, 64, 1))])
    assert len(table) == 2 and table.delta_len == 0 and table.shared_nbytes > 0
    table.put(d[2], Entry(0, 0, 1, 2, 64, 2))  # another key into d0's slot: d0 is gone
    table.put(d[1], Entry(0, 0, 3, 2, 64, 2))  # d1 moves: its old slot is free
    assert table.get(d[0]) is None and table.at((0, 0, 1)) == d[2]
    assert table.at((0, 0, 2)) is None and table.at((0, 0, 3)) == d[1]
    assert len(table) == 2 and table.delta_len == 2 and table.check() == 0
    assert table.pop(d[2]) == Entry(0, 0, 1, 2, 64, 2) and len(table) == 1


@pytest.fixture
def image_bytes() -> Iterator[bytes]:
    rng = random.Random(5)
    pages = [(rng.randbytes(16), Entry(0, 0, i, i + 1, 4096, i)) for i in range(200)]
    fd, n = _image_fd(pages, offset=0)
    try:
        yield os.pread(fd, n, 0)
    finally:
        os.close(fd)


def _attach_bytes(data: bytes) -> NativePageTable:
    fd = os.memfd_create("image")
    try:
        os.write(fd, data)
        table = _native()
        table.attach(fd, 0, len(data))
        return table
    finally:
        os.close(fd)


@pytest.mark.parametrize("damage", ["magic", "version", "cap", "len", "short", "inverse", "class"])
def test_an_image_that_is_not_whole_is_refused(image_bytes: bytes, damage: str) -> None:
    data = bytearray(image_bytes)
    cap = struct.unpack_from("<Q", data, 16)[0]
    pages_at = 40 + 8  # header, one length class padded to 8
    if damage == "magic":
        data[0] ^= 1
    elif damage == "version":
        data[8] = 9
    elif damage == "cap":
        struct.pack_into("<Q", data, 16, cap + 1)
    elif damage == "len":
        struct.pack_into("<Q", data, 24, cap)  # no free bucket would end a probe
    elif damage == "short":
        data = data[:-1]
    elif damage == "inverse":  # an inverse entry past the page array
        inv = pages_at + 40 * cap
        first = next(i for i in range(cap) if struct.unpack_from("<I", data, inv + 4 * i)[0])
        struct.pack_into("<I", data, inv + 4 * first, cap + 7)
    else:  # a page whose length class is not one
        first = next(i for i in range(cap) if struct.unpack_from("<Q", data, pages_at + 40 * i + 32)[0])
        struct.pack_into("<Q", data, pages_at + 40 * first + 24, 5)
    with pytest.raises(ValueError, match="image"):
        _attach_bytes(bytes(data))


def test_an_attach_needs_an_empty_table(image_bytes: bytes) -> None:
    table = _attach_bytes(image_bytes)
    assert len(table) == 200
    fd = os.memfd_create("image")
    try:
        os.write(fd, image_bytes)
        with pytest.raises(ValueError, match="empty"):
            table.attach(fd, 0, len(image_bytes))
    finally:
        os.close(fd)
    assert len(table) == 200 and table.check() == 0


def test_the_base_stays_mapped_after_its_file_is_replaced(tmp_path) -> None:
    """A reader keeps the checkpoint it mapped whole when a writer renames a new one over
    it (nothing ever writes into a renamed checkpoint)."""
    rng = random.Random(7)
    old = [(rng.randbytes(16), Entry(0, 0, i, 1, 64, i)) for i in range(50)]
    fd, n = _image_fd(old)
    path = tmp_path / "ckpt"
    data = os.pread(fd, 4096 + n, 0)
    os.close(fd)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    table = _native()
    table.attach(fd, 4096, n)
    os.close(fd)
    (tmp_path / "new").write_bytes(b"\0" * len(data))
    os.replace(tmp_path / "new", path)
    assert sorted(table.select()) == sorted(old) and table.check() == 0


def test_a_table_made_from_a_snapshot_catches_up_with_every_change_since() -> None:
    """The journal: puts, pops and takes after the snapshot, replayed in order onto the
    table made from the snapshot's image, give exactly the live table."""
    d = [bytes([i]) * 16 for i in range(6)]
    live = _native()
    live.put_many(d[:4], [Entry(0, 0, i, 1, 64, i) for i in range(4)])
    live.journal_start()
    made = _attached(live.select())
    live.pop(d[0])
    live.take_at_many([(0, 0, 1)])
    live.put(d[4], Entry(0, 0, 2, 2, 64, 9))  # into d2's slot
    live.put(d[3], Entry(0, 0, 5, 2, 64, 9))  # d3 moves
    made.catch_up(live)
    assert sorted(made.select()) == sorted(live.select()) and made.check() == 0
    assert [made.get(x) is not None for x in d] == [False, False, False, True, True, False]
    with pytest.raises(ValueError, match="journal"):  # it stopped: no second replay
        made.catch_up(live)
