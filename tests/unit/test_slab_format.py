"""Slab format 2 (hicache_l3.slab.format): the grouped slot geometry, the marker record,
and the refusal of a format-1 namespace directory."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.errors import ConfigError
from hicache_l3.conformance.pages import Pages
from hicache_l3.slab.format import (
    ALIGN,
    FORMAT_VERSION,
    GROUP_SLOTS,
    NAMESPACE_FILE,
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


@pytest.mark.parametrize("slot_bytes", [1000, 4096, 16 << 10, 64 << 10, 70000, 1 << 20])
def test_geometry_places_every_part_apart_and_aligned(slot_bytes: int) -> None:
    g = Geometry(slot_bytes)
    n = 2 * GROUP_SLOTS + 7  # two whole groups and a partial one
    data, marks = g.offsets(range(n))
    assert data == [g.data_offset(s) for s in range(n)] and marks == [g.marker_offset(s) for s in range(n)]
    assert g.table % ALIGN == 0 and g.table == GROUP_SLOTS * RECORD_BYTES
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


def test_a_format_1_namespace_is_refused_with_the_fix(tmp_path: Path) -> None:
    """A namespace written by format 1 must never yield bytes: opening it is a ConfigError
    naming the directory and what to do; a fresh root works."""
    directory = namespace_dir(tmp_path, NS)
    directory.mkdir(parents=True)
    (directory / NAMESPACE_FILE).write_text(json.dumps({"format": 1, "slot_bytes": 16 << 10,
                                                        "namespace": NS.fields()}))
    with pytest.raises(ConfigError, match="format 1") as info, \
            open_connector("file", NS, root=str(tmp_path), page_bytes=16 << 10) as conn:
        conn.batch_exists(["k"])
    assert str(directory) in str(info.value) and "delete" in str(info.value)
    fresh = tmp_path / "fresh"
    with open_connector("file", NS, root=str(fresh)) as conn:
        pages = Pages(conn, 16 << 10, 1)
        pages.fill(["k"])
        assert conn.batch_set(["k"], pages.pages) == [True]
    meta = json.loads((namespace_dir(fresh, NS) / NAMESPACE_FILE).read_text())
    assert meta["format"] == FORMAT_VERSION == 2
