"""nixl file mode's batch paths: the one-row-per-page common batch, batches of
multi-segment pages and batches split over several transfers (``max_descs``), pages with
and without a checksum in one batch, and :func:`run_flat`'s isolation of failing units.

Against NIXL's real POSIX plugin, except the :func:`run_flat` tests, which check the
splitting rules on a recording transfer function (pure logic: which rows go together).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.errors import Reason
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import strided_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.pages import Pages, page_pattern
from hicache_l3.conformance.slab_backdoor import slab_location
from hicache_l3.connectors.nixl.base import TransferError, Unit, coalesce, run_flat, run_units

PAGE = 16 << 10


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model="batches/model", kv_dtype="bfloat16", layout="page_first",
                     page_size=16, tag=f"b{uuid.uuid4().hex[:10]}")


# ---- run_flat: which rows go together, which units fail ---------------------------------
class Recorder:
    """A transfer function that records each call's rows and fails any call holding a
    row whose device id is in ``bad`` (as NIXL fails a whole transfer)."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.calls: list[list[int]] = []

    def __call__(self, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]) -> None:
        assert len(local) == len(remote)
        assert [row[0] for row in local] == [row[0] for row in remote]
        self.calls.append([row[0] for row in local])
        if any(row[2] in self.bad for row in remote):
            raise TransferError("bad row")


def _rows(sizes: list[int]) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]], list[int]]:
    """Units of ``sizes[i]`` rows; row ``r`` of unit ``i`` is ``(r, 1, i)`` on both sides."""
    local, remote, bounds = [], [], [0]
    for unit, size in enumerate(sizes):
        for _ in range(size):
            row = (len(local), 1, unit)
            local.append(row)
            remote.append(row)
        bounds.append(len(local))
    return local, remote, bounds


def test_run_flat_one_transfer_for_a_batch_within_max_descs() -> None:
    local, remote, _ = _rows([1] * 8)
    rec = Recorder(set())
    assert run_flat(rec, local, remote, None, 8) == [Reason.OK] * 8
    assert rec.calls == [list(range(8))]


def test_run_flat_groups_units_within_max_descs_and_a_large_unit_alone() -> None:
    local, remote, bounds = _rows([2, 1, 5, 1, 1, 2])
    rec = Recorder(set())
    assert run_flat(rec, local, remote, bounds, 4) == [Reason.OK] * 6
    assert rec.calls == [[0, 1, 2], [3, 4, 5, 6, 7], [8, 9, 10, 11]]


def test_run_flat_isolates_failing_units_and_rereads_the_others() -> None:
    local, remote, bounds = _rows([1, 3, 1, 2, 1, 1])
    rec = Recorder({1, 4})
    got = run_flat(rec, local, remote, bounds, 64, reread=True)
    assert got == [Reason.OK, Reason.ENGINE_ERROR, Reason.OK, Reason.OK, Reason.ENGINE_ERROR, Reason.OK]
    # the reread: the good units' rows once more, in one transfer, after the search
    assert rec.calls[-1] == [0, 4, 5, 6, 8]
    assert all(call != [0, 4, 5, 6, 8] for call in rec.calls[:-1])


def test_run_flat_without_bounds_is_one_row_per_unit() -> None:
    local, remote, _ = _rows([1] * 5)
    rec = Recorder({3})
    assert run_flat(rec, local, remote, None, 2) == [Reason.OK] * 3 + [Reason.ENGINE_ERROR, Reason.OK]
    assert rec.calls[:2] == [[0, 1], [2, 3]]


def test_run_units_matches_run_flat() -> None:
    units = [Unit([(0, 1, 0)], [(0, 1, 0)]),
             Unit([(1, 1, 0), (2, 1, 0)], [(1, 1, 7), (2, 1, 7)]),
             Unit([(3, 1, 0)], [(3, 1, 0)])]
    rec = Recorder({7})
    assert run_units(rec, units, 64) == [Reason.OK, Reason.ENGINE_ERROR, Reason.OK]
    assert rec.calls[0] == [0, 1, 2, 3]


# ---- coalesce and run_flat(merge=True): adjacent rows moved as one -----------------------
def test_coalesce_joins_only_rows_that_continue_on_both_sides() -> None:
    local = [(100, 10, 0), (110, 10, 0), (120, 10, 0), (200, 10, 0), (210, 10, 0), (220, 10, 0)]
    remote = [(0, 10, 5), (10, 10, 5), (20, 10, 6), (30, 10, 6), (50, 10, 6), (60, 10, 6)]
    # rows 0-1 continue; 2 is on another file; 3 leaves a local gap; 4 a remote gap; 4-5 continue
    assert coalesce(local, remote) == ([(100, 20, 0), (120, 10, 0), (200, 10, 0), (210, 20, 0)],
                                       [(0, 20, 5), (20, 10, 6), (30, 10, 6), (50, 20, 6)])


def test_coalesce_caps_a_joined_row() -> None:
    local = [(i * 10, 10, 0) for i in range(7)]
    remote = [(1000 + i * 10, 10, 3) for i in range(7)]
    assert coalesce(local, remote, max_bytes=30) == ([(0, 30, 0), (30, 30, 0), (60, 10, 0)],
                                                     [(1000, 30, 3), (1030, 30, 3), (1060, 10, 3)])
    backwards = local[::-1], remote[::-1]
    assert coalesce(*backwards) == backwards  # nothing continues: the rows as given


class Failing:
    """A transfer function failing every call that covers any byte of ``bad`` (an
    address), with ``reason``; records each call's (address, length) rows."""

    def __init__(self, bad: set[int], reason: Reason = Reason.ENGINE_ERROR) -> None:
        self.bad, self.reason = bad, reason
        self.calls: list[list[tuple[int, int]]] = []

    def __call__(self, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]]) -> None:
        self.calls.append([(row[0], row[1]) for row in local])
        if any(row[0] <= b < row[0] + row[1] for row in local for b in self.bad):
            raise TransferError("bad", self.reason)


def test_run_flat_merge_moves_adjacent_rows_as_one() -> None:
    local = [(i * 10, 10, 0) for i in range(6)]
    remote = [(i * 10, 10, 1) for i in range(6)]
    rec = Failing(set())
    assert run_flat(rec, local, remote, None, 64, merge=True) == [Reason.OK] * 6
    assert rec.calls == [[(0, 60)]]


def test_run_flat_merge_failure_isolates_pages_row_by_row() -> None:
    local = [(i * 10, 10, 0) for i in range(6)]
    remote = [(i * 10, 10, 1) for i in range(6)]
    rec = Failing({45})
    got = run_flat(rec, local, remote, None, 64, reread=True, merge=True)
    assert got == [Reason.OK] * 4 + [Reason.ENGINE_ERROR, Reason.OK]
    assert rec.calls[0] == [(0, 60)]
    assert rec.calls[1] == [(i * 10, 10) for i in range(6)]  # one row per page from then on


def test_run_flat_merge_timeout_fails_every_page_without_retry() -> None:
    local = [(i * 10, 10, 0) for i in range(4)]
    remote = [(i * 10, 10, 1) for i in range(4)]
    rec = Failing({0}, Reason.TIMEOUT)
    assert run_flat(rec, local, remote, None, 64, merge=True) == [Reason.TIMEOUT] * 4
    assert rec.calls == [[(0, 40)]]


# ---- the connector's batch paths on the real POSIX plugin ---------------------------------
def test_mixed_segment_batch_over_several_transfers_round_trips(opened: list[Any], namespace: Namespace,
                                                               tmp_path: Path) -> None:
    """One batch of single-segment pages and 4-segment pages with ``max_descs=3``: unit
    bounds, several transfers, a page of more rows than ``max_descs`` moved alone."""
    conn = open_connector("nixl", namespace, {"root": str(tmp_path / "s"), "max_descs": 3})
    opened.append(conn)
    flat = Pages(conn, PAGE, 4)
    segments, count = 4, 3
    seg = PAGE // segments
    stride = count * seg
    scattered = HostBuffer(segments * stride)
    conn.register(scattered)
    spages = strided_pages(scattered.address, seg, segments, stride, range(count))
    keys = [f"mix-{i}" for i in range(7)]
    # batch order: flat, scattered, flat, scattered, flat, scattered, flat
    order = [("f", 0), ("s", 0), ("f", 1), ("s", 1), ("f", 2), ("s", 2), ("f", 3)]
    pages = [flat.pages[i] if kind == "f" else spages[i] for kind, i in order]
    view = scattered.view()

    def fill() -> None:
        for key, (kind, i) in zip(keys, order):
            pattern = page_pattern(key, PAGE)
            if kind == "f":
                flat.view[i * PAGE:(i + 1) * PAGE] = pattern
            else:
                for j in range(segments):
                    view[j * stride + i * seg: j * stride + (i + 1) * seg] = pattern[j * seg:(j + 1) * seg]

    def held(key: str, kind: str, i: int) -> bool:
        if kind == "f":
            return flat.matches(i, key)
        got = b"".join(view[j * stride + i * seg: j * stride + (i + 1) * seg] for j in range(segments))
        return got == page_pattern(key, PAGE)

    fill()
    assert conn.batch_set(keys, pages) == [True] * 7
    flat.wipe()
    view[:] = bytes(len(view))
    assert conn.batch_get(keys, pages) == [True] * 7
    assert all(held(k, kind, i) for k, (kind, i) in zip(keys, order))
    for k in keys:  # the bytes at rest are each key's own page
        where = slab_location(tmp_path / "s", namespace, k)
        assert where is not None
        path, offset, length, _ = where
        with open(path, "rb") as f:
            f.seek(offset)
            assert f.read(length) == page_pattern(k, PAGE)
    view.release()


def test_checksummed_pages_verified_in_a_batch_with_unchecksummed_ones(
        opened: list[Any], namespace: Namespace, tmp_path: Path) -> None:
    """``checksum=none`` writes no checksum, but a page stored with one (by the file
    connector) is verified: a flipped byte in one of those, placed where its position in
    the batch differs from its position among the checksummed pages, is the one miss."""
    root = str(tmp_path / "s")
    with open_connector("file", namespace, {"root": root, "checksum": "xxh3"}) as writer:
        a = [f"a{i}" for i in range(3)]
        wpages = Pages(writer, PAGE, 3)
        wpages.fill(a)
        assert writer.batch_set(a, wpages.pages) == [True] * 3
    conn = open_connector("nixl", namespace, {"root": root, "checksum": "none"})
    opened.append(conn)
    b = [f"b{i}" for i in range(3)]
    bpages = Pages(conn, PAGE, 3)
    bpages.fill(b)
    assert conn.batch_set(b, bpages.pages) == [True] * 3
    where = slab_location(tmp_path / "s", namespace, "a1")
    assert where is not None
    path, offset, length, _ = where
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset + length // 3)
        os.pwrite(fd, bytes([byte[0] ^ 0x5A]), offset + length // 3)
    finally:
        os.close(fd)
    keys = ["b0", "a0", "b1", "b2", "a1", "a2"]
    pages = Pages(conn, PAGE, len(keys))
    assert conn.batch_get(keys, pages.pages) == [True, True, True, True, False, True]
    assert all(pages.matches(i, k) for i, k in enumerate(keys) if k != "a1")
    assert conn.stats()["ops"]["get"]["failed"] == {"corrupt": 1}
    assert conn.batch_exists(["a1"]) == [False]  # dropped from the index
