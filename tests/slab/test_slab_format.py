"""Slab format 2 (hicache_l3.slab.format): the grouped slot geometry, the marker record,
and the refusal of a format-1 namespace directory."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.errors import ConfigError
from hicache_l3.conformance.pages import Pages, page_pattern
from hicache_l3.conformance.slab_backdoor import slab_location
from hicache_l3.slab.format import (
    ALIGN,
    FORMAT_VERSION,
    GROUP_SLOTS,
    NAMESPACE_FILE,
    PACKED_FORMAT,
    PACKED_MAX,
    RECORD_BYTES,
    Entry,
    Geometry,
    check_marker,
    encode_end,
    encode_marker,
    encode_start,
    namespace_dir,
)

NS = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)


@pytest.mark.parametrize(("slot_bytes", "packed"), [
    (1, True), (64, True), (100, True), (256, True), (1000, True), (2048, True),
    (64, False), (1000, False), (2048, False), (2049, None), (4096, None), (16 << 10, None),
    (64 << 10, None), (70000, None), (1 << 20, None)])
def test_geometry_places_every_part_apart_and_aligned(slot_bytes: int, packed: bool | None) -> None:
    g = Geometry(slot_bytes, pack=packed)
    assert g.packed == (slot_bytes <= PACKED_MAX if packed is None else packed)
    assert g == Geometry(slot_bytes) or packed is False  # a new namespace packs what it can
    n = 2 * GROUP_SLOTS + 7  # two whole groups and a partial one
    data, marks = g.offsets(range(n))
    assert data == [g.data_offset(s) for s in range(n)] and marks == [g.marker_offset(s) for s in range(n)]
    assert g.table % ALIGN == 0 and g.table == GROUP_SLOTS * RECORD_BYTES
    if g.packed:  # the smallest power of two (of 64 bytes at least) holding the slot
        assert g.data_stride >= max(slot_bytes, 64) and g.data_stride & (g.data_stride - 1) == 0
        assert g.data_stride < 2 * max(slot_bytes, 64)
        assert all(d % g.data_stride == 0 for d in data)
        assert all(d // ALIGN == (d + slot_bytes - 1) // ALIGN for d in data)  # none straddles 4 KiB
    else:
        assert all(d % ALIGN == 0 for d in data)
    if slot_bytes <= 64 << 10 and slot_bytes & (slot_bytes - 1) == 0:
        assert all(d % slot_bytes == 0 for d in data)  # power-of-two pages: aligned to their size
    spans = sorted([(d, d + slot_bytes) for d in data] + [(m, m + RECORD_BYTES) for m in marks])
    assert all(a[1] <= b[0] for a, b in pairwise(spans))  # nothing overlaps
    assert spans[-1][1] <= g.bytes_for(n)
    # a group's data areas are back to back: adjacent slots are one contiguous range
    assert data[1] - data[0] == g.data_stride and marks[1] - marks[0] == RECORD_BYTES
    assert g.group * 2 == g.data_offset(2 * GROUP_SLOTS) - g.table  # whole groups tile the slab
    for k in (0, 1, GROUP_SLOTS - 1, GROUP_SLOTS, GROUP_SLOTS + 1, n):
        assert g.slots_in(g.bytes_for(k)) == k
        assert g.slots_in(g.bytes_for(k) - 1) == max(0, k - 1)
    assert g.stride == g.data_stride + RECORD_BYTES
    assert g.group == GROUP_SLOTS * g.stride  # the capacity's per-slot count is exact per group


def test_marker_record_is_start_header_then_end_marker() -> None:
    fp = bytes(range(16))
    record = encode_marker(7, 4096, 99, fp)
    assert len(record) == RECORD_BYTES
    assert record == encode_start(7, 4096, 99, fp) + encode_end(7, fp)
    assert record[4:6] == FORMAT_VERSION.to_bytes(2, "little")
    entry = Entry(0, 0, 3, 7, 4096, 99)
    assert check_marker(record, entry, fp)
    assert not check_marker(record, entry._replace(gen=8), fp)  # rewritten: a new generation
    assert not check_marker(record, entry, bytes(16))  # another key
    assert not check_marker(record, entry._replace(checksum=98), fp)
    format1 = bytearray(record)
    format1[4:6] = (1).to_bytes(2, "little")
    assert not check_marker(bytes(format1), entry, fp)  # format-1 bytes never match


def _namespace_file(root: Path, fmt: int, slot_bytes: int) -> Path:
    """A namespace directory under ``root`` (both private) whose namespace.json says
    ``fmt`` with ``slot_bytes``-byte slots, as an earlier version would have left it."""
    directory = namespace_dir(root, NS)
    directory.mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (directory / NAMESPACE_FILE).write_text(json.dumps({"format": fmt, "slot_bytes": slot_bytes,
                                                        "namespace": NS.fields()}))
    return directory


def _assert_refused(root: Path, fmt: int) -> None:
    """Opening the namespace (16 KiB pages) is a ConfigError naming the format, the
    directory and what to do."""
    directory = _namespace_file(root, fmt, 16 << 10)
    with pytest.raises(ConfigError, match=f"format {fmt}") as info, \
            open_connector("file", NS, root=str(root), page_bytes=16 << 10) as conn:
        conn.batch_exists(["k"])
    assert str(directory) in str(info.value) and "delete" in str(info.value)


def test_a_format_1_namespace_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A namespace written by format 1 must never yield bytes: opening it is a ConfigError
    naming the directory and what to do; a fresh root works."""
    _assert_refused(tmp_path, 1)
    fresh = tmp_path / "fresh"
    with open_connector("file", NS, root=str(fresh)) as conn:
        pages = Pages(conn, 16 << 10, 1)
        pages.fill(["k"])
        assert conn.batch_set(["k"], pages.pages) == [True]
    meta = json.loads((namespace_dir(fresh, NS) / NAMESPACE_FILE).read_text())
    assert meta["format"] == FORMAT_VERSION == 2


def test_packed_slots_are_never_made_for_big_pages() -> None:
    with pytest.raises(ValueError, match="never packed"):
        Geometry(PACKED_MAX + 1, pack=True)


def _slabs_bytes(root: Path) -> int:
    """Disk blocks the namespace's slab files hold."""
    return sum(p.stat().st_blocks * 512 for p in namespace_dir(root, NS).glob("writers/w*/slab-*.packed.dat"))


def _read_back(conn: object, pages: Pages, keys: list[str]) -> list[bool]:
    """Get ``keys`` into a wiped buffer: per key, hit and the bytes its pattern."""
    pages.wipe()
    got = conn.batch_get(keys, pages.pages[:len(keys)])  # type: ignore[attr-defined]
    return [ok and pages.matches(i, key) for i, (ok, key) in enumerate(zip(got, keys))]


def test_small_pages_are_packed_in_a_format_3_namespace_and_read_back(tmp_path: Path) -> None:
    """A new namespace of 256-byte pages lays them out packed (format 3): its slabs hold
    about 2,000 x (256 + 128) bytes for 2,000 pages, not 2,000 x (4 KiB + 128); every page
    reads back whole, in this process and in a fresh one."""
    n, page = 2000, 256
    keys = [f"k{i}" for i in range(n)]
    with open_connector("file", NS, root=str(tmp_path)) as conn:
        pages = Pages(conn, page, n)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * n
        assert _read_back(conn, pages, keys) == [True] * n
    meta = json.loads((namespace_dir(tmp_path, NS) / NAMESPACE_FILE).read_text())
    assert meta["format"] == PACKED_FORMAT and meta["slot_bytes"] == page
    used = _slabs_bytes(tmp_path)
    assert 0 < used <= 2 * Geometry(page).bytes_for(n) + (1 << 20) < n * Geometry(page, pack=False).stride
    with open_connector("file", NS, root=str(tmp_path)) as conn:
        pages = Pages(conn, page, n)
        assert _read_back(conn, pages, keys) == [True] * n


def test_a_format_2_namespace_of_small_pages_keeps_its_4_kib_stride(tmp_path: Path) -> None:
    """A namespace of small pages created before packing (namespace.json format 2) is read
    and written with the stride it was created with, never the packed one."""
    directory = _namespace_file(tmp_path, 2, 256)
    keys = [f"k{i}" for i in range(600)]  # more than a group
    with open_connector("file", NS, root=str(tmp_path)) as conn:
        pages = Pages(conn, 256, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        assert _read_back(conn, pages, keys) == [True] * len(keys)
    assert json.loads((directory / NAMESPACE_FILE).read_text())["format"] == 2
    for key in keys[:3] + keys[-3:]:
        located = slab_location(tmp_path, NS, key)
        assert located is not None
        path, data_at, length, _ = located
        assert data_at % ALIGN == 0 and length == 256
        assert path.read_bytes()[data_at:data_at + 256] == page_pattern(key, 256)


def test_a_format_3_namespace_of_big_pages_is_refused(tmp_path: Path) -> None:
    _assert_refused(tmp_path, 3)  # (format 3 is for packed slots of at most 2 KiB)


@pytest.mark.parametrize("damage", ["missing", "damaged"])
def test_a_rebuilt_namespace_file_never_reads_slabs_of_the_other_layout(tmp_path: Path, damage: str) -> None:
    """A format-2 namespace of small pages (4 KiB stride, written before packing) whose
    namespace.json is lost or damaged is rebuilt as a new one (format 3, packed): its
    slabs, named for their layout, are not found, so every old page misses, even with
    checksum=none (never the bytes of a slab read with the other stride); new sets then
    work, and so do gets in a fresh process."""
    directory = _namespace_file(tmp_path, 2, 256)
    keys = [f"k{i}" for i in range(40)]
    with open_connector("file", NS, root=str(tmp_path), checksum="none") as conn:
        pages = Pages(conn, 256, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
    assert [p.name for p in directory.glob("writers/w*/slab-*.dat")] == ["slab-000000.dat"]
    path = directory / NAMESPACE_FILE
    if damage == "missing":
        path.unlink()
    else:
        path.write_text("{not json")
    with open_connector("file", NS, root=str(tmp_path), page_bytes=256, checksum="none") as conn:
        pages = Pages(conn, 256, len(keys))
        assert conn.batch_get(keys, pages.pages) == [False] * len(keys)  # misses, not hits
        assert conn.batch_exists(keys) == [False] * len(keys)  # dropped once found gone
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
    assert json.loads(path.read_text())["format"] == PACKED_FORMAT
    assert list(directory.glob("writers/w*/slab-*.packed.dat"))
    with open_connector("file", NS, root=str(tmp_path), checksum="none") as conn:
        pages = Pages(conn, 256, len(keys))
        assert _read_back(conn, pages, keys) == [True] * len(keys)


def test_a_damaged_namespace_file_of_packed_pages_is_rebuilt_and_its_pages_read(tmp_path: Path) -> None:
    keys = [f"k{i}" for i in range(40)]
    with open_connector("file", NS, root=str(tmp_path)) as conn:
        pages = Pages(conn, 256, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
    (namespace_dir(tmp_path, NS) / NAMESPACE_FILE).write_text("{not json")
    with open_connector("file", NS, root=str(tmp_path), page_bytes=256) as conn:
        pages = Pages(conn, 256, len(keys))
        assert _read_back(conn, pages, keys) == [True] * len(keys)
