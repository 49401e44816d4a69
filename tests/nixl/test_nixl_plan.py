"""nixl file mode's planned get (``NixlTransport.read_plan`` of a
:class:`~hicache_l3.slab.plan.GetPlan`, rows joined in C, marker records and checksums
checked in C) against its reference paths, with NIXL's real POSIX plugin: the same Reason
per key, the same bytes and the same index afterwards on a batch with misses, corrupt and
torn slots, a size mismatch, an unverified page and a recycled slot; a timeout's Reason;
and the C helpers (connectors/nixl/batch_lib.py) against their Python spellings."""

from __future__ import annotations

import array
import errno
import os
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3 import open_connector
from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import page_checksum
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import FlatPages
from hicache_l3.conformance.slab_backdoor import SlabBackdoor, slab_location
from hicache_l3.connectors.nixl import batch_lib
from hicache_l3.connectors.nixl.base import coalesce
from hicache_l3.slab import native
from hicache_l3.slab.format import RECORD_BYTES, Entry
from hicache_l3.slab.native import CHECKSUM, HEADER, OK, PageBatch
from hicache_l3.slab.table import digest

P = 8192
N = 14
HELPERS = batch_lib.library()


@pytest.fixture(autouse=True)
def _helpers_built() -> None:
    """These tests are of the C path: a library that did not build (or was refused) fails
    them, naming why, instead of skipping them (the test set-up builds it)."""
    assert HELPERS is not None, "the nixl batch helpers need a 64-bit little-endian host"

HIT, MISS, CORRUPT = Reason.OK, Reason.MISS, Reason.CORRUPT
# the damaged batch of _damaged_store, read by a reader that verifies checksums (xxh3)
# and by one that does not (none; checksummed pages are verified all the same)
EXPECTED = {
    "xxh3": [HIT, HIT, MISS, CORRUPT, CORRUPT, Reason.UNVERIFIED, Reason.SIZE_MISMATCH,
             HIT, MISS, CORRUPT, HIT, HIT, HIT, HIT],
    "none": [HIT, HIT, MISS, CORRUPT, CORRUPT, HIT, Reason.SIZE_MISMATCH,
             HIT, MISS, CORRUPT, HIT, HIT, HIT, HIT],
}


class _Backdoor(SlabBackdoor):
    page_bytes = P


def _ns() -> Namespace:
    return Namespace(model="plan/m", kv_dtype="bf16", layout="page_first", page_size=16,
                     tag=f"p{uuid.uuid4().hex[:10]}")


def _open(root: Path, ns: Namespace, **extra: Any) -> Any:
    return open_connector("nixl", ns, {"root": str(root), **extra})


def _damaged_store(root: Path, ns: Namespace) -> tuple[list[str], bytes]:
    """Keys page-00..13 stored (by nixl file mode) with checksums except page-05 (a writer
    without), page-02 and page-08 never stored; then page-03's data flipped and page-04's
    slot torn. The bytes set."""
    keys = [f"page-{i:02d}" for i in range(N)]
    src = HostBuffer(N * P)
    src.view()[:] = random.Random(1).randbytes(N * P)
    pages = [((src.address + i * P, P),) for i in range(N)]
    plain = [i for i in range(N) if i not in (2, 5, 8)]
    with _open(root, ns, checksum="xxh3") as w:
        w.register(src)
        assert all(w.batch_set([keys[i] for i in plain], [pages[i] for i in plain]))
    with _open(root, ns, checksum="none") as w:
        w.register(src)
        assert w.batch_set([keys[5]], [pages[5]]) == [True]
    door = _Backdoor()
    door.backdoor_corrupt({"root": str(root)}, ns, keys[3], "flip")
    door.backdoor_corrupt({"root": str(root)}, ns, keys[4], "truncate")
    return keys, bytes(src.view())


def _wreck(store: Any, keys: list[str]) -> None:
    """page-06's entry claims a page longer than a slot; page-09's another generation (its slot
    was recycled since: the marker record read differs from the one expected)."""
    d = digest("page-06")
    e = store.index.table.get(d)
    store.index.table.put(d, Entry(e.writer, e.slab, e.slot, e.gen, 2 * P, e.checksum))
    d = digest("page-09")
    e = store.index.table.get(d)
    store.index.table.put(d, Entry(e.writer, e.slab, e.slot, e.gen + 1, e.length, e.checksum))


def _get(root: Path, ns: Namespace, keys: list[str], path: str, checksum: str,
         segments: int = 1) -> tuple[list[Reason], bytes, list[bool], int, int]:
    """A fresh reader's get of ``keys`` (pages of ``segments`` segments each) through
    ``path``: "planned" (read_plan) or "located" (the lookup and NixlTransport.read).
    (reasons, destination bytes, exists afterwards, plans made, planned reads)."""
    dst = HostBuffer(N * P)
    step = P // segments
    pages = [tuple((dst.address + i * P + s * step, step) for s in range(segments))
             for i in range(len(keys))]
    with _open(root, ns, checksum=checksum) as r:
        r.register(dst)
        assert r.transport.reads_plans and r.stats()["engine"]["planned_get"]
        assert r.batch_exists(keys[:1]) is not None  # opens the store
        store = r._store
        _wreck(store, keys)
        if path == "located":
            r.transport.reads_plans = False  # the instance takes _get_located
        plans: list[Any] = []
        reads: list[int] = []
        real, real_read = store.plan_get, r.transport.read_plan

        def plan_get(*a: Any) -> Any:
            plans.append(real(*a))
            return plans[-1]

        def read_plan(*a: Any) -> Any:
            reads.append(1)
            return real_read(*a)

        store.plan_get, r.transport.read_plan = plan_get, read_plan
        reasons = r.batch_reasons("get", keys, pages)
        made = len([p for p in plans if p is not None])
        return reasons, bytes(dst.view()), r.batch_exists(keys), made, len(reads)


@pytest.mark.parametrize("checksum", ["xxh3", "none"])
@pytest.mark.parametrize("segments", [1, 4])
def test_planned_get_agrees_with_the_reference(tmp_path: Path, checksum: str, segments: int) -> None:
    ns = _ns()
    keys, src = _damaged_store(tmp_path, ns)
    planned = _get(tmp_path, ns, keys, "planned", checksum, segments)
    located = _get(tmp_path, ns, keys, "located", checksum, segments)
    assert planned[3:] == (1, 1) and located[3:] == (0, 0)  # paths taken
    assert planned[0] == located[0] == EXPECTED[checksum]
    for i, r in enumerate(EXPECTED[checksum]):
        if r is HIT:
            assert planned[1][i * P:(i + 1) * P] == src[i * P:(i + 1) * P], i
    assert planned[1] == located[1]
    assert planned[2] == located[2]  # the same keys dropped from the index
    dropped = [2, 3, 4, 8, 9] + ([5] if checksum == "xxh3" else [])
    assert [i for i, e in enumerate(planned[2]) if not e] == sorted(dropped)


def test_planned_get_of_an_all_hit_batch_is_every_byte(tmp_path: Path) -> None:
    ns = _ns()
    keys, src = _damaged_store(tmp_path, ns)
    good = [k for k, r in zip(keys, EXPECTED["xxh3"]) if r is HIT and k != "page-09"]
    dst = HostBuffer(N * P)
    pages = [((dst.address + j * P, P),) for j in range(len(good))]
    with _open(tmp_path, ns) as r:
        r.register(dst)
        assert r.batch_get(good, pages) == [True] * len(good)
    got = bytes(dst.view())
    for j, k in enumerate(good):
        i = keys.index(k)
        assert got[j * P:(j + 1) * P] == src[i * P:(i + 1) * P], k


TIMEOUT_PAGES = 512  # more than the POSIX plugin's queue: the transfer spans several polls


@pytest.mark.parametrize("planned", [True, False])
def test_a_timed_out_get_reports_timeout_in_both_paths(tmp_path: Path, planned: bool) -> None:
    """The planned read hands the engine the transfer's Reason (timeout), as the located
    path's ReadBatch does; the agent is renewed and the next get is exact."""
    ns = _ns()
    keys = [f"t{i}" for i in range(TIMEOUT_PAGES)]
    buf = HostBuffer(TIMEOUT_PAGES * P)
    buf.view()[:] = random.Random(2).randbytes(TIMEOUT_PAGES * P)
    want = bytes(buf.view())
    # backwards: no two rows join, one request per page
    pages = [((buf.address + (TIMEOUT_PAGES - 1 - i) * P, P),) for i in range(TIMEOUT_PAGES)]
    with _open(tmp_path, ns) as conn:
        conn.register(buf)
        assert conn.batch_set(keys, pages) == [True] * TIMEOUT_PAGES
        conn.transport.reads_plans = planned
        conn.config.timeout_s = 1e-6
        buf.view()[:] = bytes(TIMEOUT_PAGES * P)
        reasons = conn.batch_reasons("get", keys, pages)
        assert Reason.TIMEOUT in reasons, "the tiny timeout did not expire"
        assert set(reasons) <= {Reason.TIMEOUT, Reason.OK}
        conn.config.timeout_s = 30.0
        assert conn.batch_get(keys, pages) == [True] * TIMEOUT_PAGES
        assert bytes(buf.view()) == want
        assert conn.stats()["engine"]["agent_renewals"] == 1


# ---- the C helpers against their Python spellings ---------------------------------------
_KEY = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=80)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4)), min_size=1, max_size=3),
                          st.integers(0, 1), st.integers(0, 3)), min_size=1, max_size=12),
       st.integers(0, 12))
def test_join_rows_is_coalesce_of_the_segment_rows(spec: list[tuple[list[tuple[int, int]], int, int]],
                                                   cap: int) -> None:
    """Pages of small segments at addresses that often continue each other (a gap of 0..3
    after each), in two descriptors at offsets that often continue: the C rows are
    :func:`coalesce` of one row per segment, for any cap (0: none joined)."""
    assert HELPERS is not None
    pages: list[tuple[tuple[int, int], ...]] = []
    fds, offs = [], []
    address, offset = 4096, 0
    for segs, fd, gap in spec:
        page = []
        for skip, length in segs:
            address += skip
            page.append((address, length))
            address += length
        pages.append(tuple(page))
        fds.append(10 + fd)
        offset += gap
        offs.append(offset)
        offset += sum(n for _, n in page)
    local, remote = [], []
    for laid, fd, off in zip(pages, fds, offs):
        for a, n in laid:
            local.append((a, n, 0))
            remote.append((off, n, fd))
            off += n
    segments, at = batch_lib.flatten(pages)
    got = HELPERS.rows(segments, at, array.array("i", fds), array.array("q", offs), cap)
    assert got == ((local, remote) if cap == 0 else coalesce(local, remote, max_bytes=cap))


def test_flatten_takes_flat_pages_as_they_are() -> None:
    pages = [((4096 * i, 4096),) for i in range(1, 5)]
    flat = FlatPages(pages, array.array("Q", [v for p in pages for s in p for v in s]).tobytes(), 1)
    assert batch_lib.flatten(flat) == batch_lib.flatten(list(pages))


def test_check_sums_flags_only_checked_pages_that_differ() -> None:
    """Pages with status OK and a checksum are hashed (a wrong one is CHECKSUM); a page
    without a checksum, or already failed, keeps its status."""
    assert HELPERS is not None
    buf = HostBuffer(4 * P)
    buf.view()[:] = random.Random(3).randbytes(4 * P)
    pages = [((buf.address, P),), ((buf.address + P, 100), (buf.address + 2 * P, P - 100)),
             ((buf.address + 3 * P, P),), ((buf.address + P, P),)]
    sums = [page_checksum(p) for p in pages]
    sums[2] ^= 1  # wrong
    sums[3] = 0  # none
    n = len(pages)
    batch = PageBatch(RECORD_BYTES, [0] * n, [0] * n, [0] * n, pages, [bytes(RECORD_BYTES)] * n, sums,
                      writing=False)
    batch.status[:] = array.array("i", [OK, OK, OK, OK])
    assert HELPERS.check_sums(batch, 0, n) == 1
    assert list(batch.status) == [OK, OK, CHECKSUM, OK]
    batch.status[:] = array.array("i", [-5, OK, OK, OK])
    assert HELPERS.check_sums(batch, 0, 2) == 1
    assert list(batch.status) == [-5, OK, OK, OK]


def test_a_marker_record_cut_short_reads_as_another_record(tmp_path: Path) -> None:
    """read_plan of a plan whose page 1 has its marker record at the very end of its slab
    file (half of it past the end: the pread comes back short): HEADER for that page, as
    the located path's ``_check_markers`` has it, OK for the others."""
    ns = _ns()
    buf = HostBuffer(3 * P)
    buf.view()[:] = random.Random(4).randbytes(3 * P)
    keys = ["s0", "s1", "s2"]
    pages = [((buf.address + i * P, P),) for i in range(3)]
    with _open(tmp_path, ns) as conn:
        conn.register(buf)
        assert conn.batch_set(keys, pages) == [True] * 3
        store = conn._store
        plan = store.plan_get(keys, False)
        assert plan is not None and plan.count == 3
        size = os.fstat(plan.fds[1]).st_size
        plan.marker_offs[1] = size - RECORD_BYTES // 2
        reasons: dict[int, Reason] = {}
        status = conn.transport.read_plan(plan, pages, reasons)
        assert list(status) == [OK, HEADER, OK] and reasons == {}


def test_write_markers_puts_each_record_at_its_offset(tmp_path: Path) -> None:
    assert HELPERS is not None
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        records = bytearray(random.Random(5).randbytes(4 * RECORD_BYTES))
        offsets = [0, RECORD_BYTES, 5 * RECORD_BYTES, 2 * RECORD_BYTES]  # two runs, one out of order
        status = HELPERS.write_markers(array.array("i", [fd] * 4), array.array("q", offsets), records)
        assert list(status) == [OK] * 4
        for j, off in enumerate(offsets):
            assert os.pread(fd, RECORD_BYTES, off) == records[j * RECORD_BYTES:(j + 1) * RECORD_BYTES]
        bad = HELPERS.write_markers(array.array("i", [fd, -1]), array.array("q", [0, 0]),
                                    records[:2 * RECORD_BYTES])
        assert bad[0] == OK and bad[1] < 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("checksum", ["xxh3", "none"])
def test_a_set_writes_the_reference_records_and_bytes(tmp_path: Path, checksum: str) -> None:
    """The same batch set by nixl file mode and by the file connector leaves byte-identical
    slots: records (fingerprints, checksums) and data."""
    ns = _ns()
    buf = HostBuffer(N * P)
    buf.view()[:] = random.Random(6).randbytes(N * P)
    keys = [f"w-{i}" for i in range(N)]
    pages = [((buf.address + i * P, P),) for i in range(N)]
    slots = {}
    for path in ("nixl", "file"):
        root = tmp_path / path
        with open_connector(path, ns, {"root": str(root), "checksum": checksum}) as w:
            w.register(buf)
            assert w.batch_set(keys, pages) == [True] * N
        got = []
        for k in keys:
            where = slab_location(root, ns, k)
            assert where is not None
            file, offset, length, marker = where
            with open(file, "rb") as f:
                got.append((os.pread(f.fileno(), RECORD_BYTES, marker), os.pread(f.fileno(), length, offset)))
        slots[path] = got
    assert slots["nixl"] == slots["file"]
    assert all(d == bytes(buf.view()[i * P:(i + 1) * P]) for i, (_, d) in enumerate(slots["nixl"]))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 1), st.booleans()), min_size=1, max_size=24),
       st.sampled_from([0, 100, 1 << 20]))
def test_row_arrays_and_flat_bytes_give_the_rows_of_lists(spec: list[tuple[int, int, bool]],
                                                           cap: int) -> None:
    """rows(..., arrays=True) (what the planned get hands NIXL: m x 3 numpy arrays past
    TUPLE_ROWS rows, the list spelling below) holds the rows of the list spelling, and a
    FlatPages' segment bytes give the same rows as its flattened arrays."""
    assert HELPERS is not None
    pages, fds, offs = [], [], []
    address, offset = 1 << 16, 0
    for count, fd, gap in spec:
        pages.append(tuple((address + 64 * s, 64) for s in range(count)))
        address += 64 * count + (32 if gap else 0)
        fds.append(7 + fd)
        offs.append(offset)
        offset += 64 * count + (16 if gap else 0)
    segments, at = batch_lib.flatten(pages)
    fd_arr, off_arr = array.array("i", fds), array.array("q", offs)
    want = HELPERS.rows(segments, at, fd_arr, off_arr, cap)
    local, remote = HELPERS.rows(segments, at, fd_arr, off_arr, cap, arrays=True)
    if len(want[0]) > batch_lib.TUPLE_ROWS:
        assert local.shape == remote.shape == (len(want[0]), 3)
        local, remote = [tuple(r) for r in local.tolist()], [tuple(r) for r in remote.tolist()]
    else:
        assert isinstance(local, list) and isinstance(remote, list)
    assert (local, remote) == want
    assert HELPERS.rows(segments.tobytes(), at, fd_arr, off_arr, cap) == want
    with pytest.raises(ValueError):
        HELPERS.rows(segments.tobytes()[:-8], at, fd_arr, off_arr, cap)


def test_plan_markers_and_sums_read_the_plan_arrays_as_they_are(tmp_path: Path) -> None:
    """plan_markers: OK, HEADER (another record), SHORT (cut) and -errno per record, as
    read_markers of a PageBatch; plan_sums: CHECKSUM only for a checked OK page whose
    bytes differ, from flat segment bytes."""
    assert HELPERS is not None
    records = [random.Random(i).randbytes(RECORD_BYTES) for i in range(4)]
    path = tmp_path / "slab"
    path.write_bytes(b"".join(records[:3]) + records[3][:10])
    fd = os.open(path, os.O_RDONLY)
    try:
        expect = bytearray(b"".join([records[0], records[2], records[2], records[3]]))
        status = array.array("i", bytes(16))
        fds = array.array("i", [fd, fd, -1, fd])
        offs = array.array("q", [0, RECORD_BYTES, 2 * RECORD_BYTES, 3 * RECORD_BYTES])
        assert HELPERS.plan_markers(fds, offs, expect, status) == 3
        assert list(status) == [OK, HEADER, -errno.EBADF, native.SHORT]
    finally:
        os.close(fd)
    buf = HostBuffer(3 * P)
    buf.view()[:] = random.Random(5).randbytes(3 * P)
    pages = [((buf.address + j * P, P),) for j in range(3)]
    sums = array.array("Q", [page_checksum(pages[0]), page_checksum(pages[1]) ^ 1, 0])
    flat = FlatPages(pages, array.array("Q", [v for p in pages for s in p for v in s]).tobytes(), 1)
    segments, at = native.plan_segments(flat)
    assert isinstance(segments, bytes)
    status = array.array("i", [OK, OK, OK])
    assert HELPERS.plan_sums(segments, at, sums, status, 0, 3) == 1
    assert list(status) == [OK, CHECKSUM, OK]
    with pytest.raises(ValueError):
        HELPERS.plan_sums(segments, at, sums, status, 0, 4)
