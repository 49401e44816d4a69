"""The planned read (``hl3_read_plan``: a get plan's arrays and the batch's flat segments
read as they are, hicache_l3/slab/native.py BatchIO.plan_read / read_plan) against the
read of a PageBatch (``hl3_read_pages``, the path it replaces) and against the status
each page's damage implies: flipped data, a record of another generation (a torn or
recycled slot), both, a short slot, a page without checksum, a bad descriptor; in shares
of any size, from per-page lists and from FlatPages."""

from __future__ import annotations

import array
import errno
import itertools
import os
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_l3.common.integrity import page_checksum
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import FlatPages, Page
from hicache_l3.slab import native as batch_io
from hicache_l3.slab.format import RECORD_BYTES
from hicache_l3.slab.native import CHECKSUM, HEADER, OK, SHORT, PageBatch
from hicache_l3.slab.plan import GetPlan

SEG = 2048  # two segments per page
PAGE = 2 * SEG
DATA0 = 64 * RECORD_BYTES  # data after the marker table
MAX_PAGES = 24
DAMAGE = ("ok", "flip", "record", "both", "short", "unchecked", "badfd")
EXPECTED = {"ok": OK, "flip": CHECKSUM, "record": HEADER, "both": HEADER, "short": SHORT,
            "unchecked": OK, "badfd": -errno.EBADF}


@pytest.fixture(scope="module")
def native() -> batch_io.BatchIO:
    lib = batch_io.library()
    assert lib is not None, f"hicache_l3._batch_io unavailable: {batch_io.unavailable_reason()}"
    assert lib.reads_plans, "hicache_l3._batch_io built without hl3_read_plan"
    return lib


def _slot_file(path: Path, damage: list[str], rng: random.Random, gap: bool) -> tuple[int, GetPlan, bytes]:
    """A file of ``len(damage)`` slots (adjacent, or one page apart when ``gap``), page
    ``j`` damaged as ``damage[j]`` says, and the plan of reading them back: (fd, plan,
    the bytes stored)."""
    n = len(damage)
    stride = 2 * PAGE if gap else PAGE
    data = rng.randbytes(n * PAGE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    data_offs = array.array("q", (DATA0 + j * stride for j in range(n)))
    marker_offs = array.array("q", (j * RECORD_BYTES for j in range(n)))
    csums = array.array("Q", bytes(8 * n))
    expect = bytearray()
    for j, what in enumerate(damage):
        page = data[j * PAGE:(j + 1) * PAGE]
        record = rng.randbytes(RECORD_BYTES)
        expect += record
        os.pwrite(fd, record if what not in ("record", "both") else bytes(b ^ 1 for b in record),
                  marker_offs[j])
        stored = page if what not in ("flip", "both") else bytes([page[0] ^ 0xFF]) + page[1:]
        if what == "short":
            stored = stored[: PAGE // 2]
            data_offs[j] = DATA0 + (n + 4) * stride  # past every other slot: the file ends mid-page
        os.pwrite(fd, stored, data_offs[j])
        csums[j] = 0 if what == "unchecked" else _checksum(page)
    fds = array.array("i", (-1 if what == "badfd" else fd for what in damage))
    plan = GetPlan(n, n, array.array("Q", bytes(48 * n)), array.array("i", bytes(4 * n)), data_offs,
                   marker_offs, expect, csums, array.array("i", range(n)), fds)
    return fd, plan, data


def _checksum(page: bytes) -> int:
    buf = HostBuffer(len(page))
    buf.view()[:] = page
    return page_checksum([(buf.address, len(page))])


def _pages(dst: HostBuffer, n: int, flat: bool) -> list[Page] | FlatPages:
    """``n`` destination pages of two segments each, the second segment first in memory
    (the segments of a page need not be in address order for the read)."""
    pages = [((dst.address + j * PAGE + SEG, SEG), (dst.address + j * PAGE, SEG)) for j in range(n)]
    if not flat:
        return pages
    segs = array.array("Q", (v for page in pages for seg in page for v in seg))
    return FlatPages(pages, segs.tobytes(), 2)


def _shares(n: int, cuts: list[int]) -> list[tuple[int, int]]:
    bounds = sorted({0, n, *(c % (n + 1) for c in cuts)})
    return list(itertools.pairwise(bounds))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.lists(st.sampled_from(DAMAGE), min_size=1, max_size=MAX_PAGES),
       cuts=st.lists(st.integers(0, MAX_PAGES), max_size=4), flat=st.booleans(), gap=st.booleans(),
       seed=st.integers(0, 2**32))
def test_planned_read_matches_the_page_batch_read(native: batch_io.BatchIO, tmp_path: Path,
                                                  damage: list[str], cuts: list[int], flat: bool,
                                                  gap: bool, seed: int) -> None:
    n = len(damage)
    fd, plan, data = _slot_file(tmp_path / "slab", damage, random.Random(seed), gap)
    try:
        dst_ref, dst = HostBuffer(n * PAGE), HostBuffer(n * PAGE)
        ref = PageBatch.for_read(RECORD_BYTES, plan.fds, plan.data_offs, plan.marker_offs,
                                 _pages(dst_ref, n, False), plan.expect, plan.csums)
        call = native.plan_read(plan, _pages(dst, n, flat))
        bad_ref = sum(native.read(ref, lo, hi) for lo, hi in _shares(n, cuts))
        bad = sum(native.read_plan(call, lo, hi) for lo, hi in _shares(n, cuts[::-1]))
    finally:
        os.close(fd)
    assert list(call.status) == list(ref.status) == [EXPECTED[d] for d in damage]
    assert bad == bad_ref == sum(EXPECTED[d] != OK for d in damage)
    got, want = bytes(dst.view()), bytes(dst_ref.view())
    for j in range(n):
        if call.status[j] == OK:  # every verified page holds its bytes, in segment order
            page = data[j * PAGE:(j + 1) * PAGE]
            assert got[j * PAGE:(j + 1) * PAGE] == want[j * PAGE:(j + 1) * PAGE] == page[SEG:] + page[:SEG]


def test_a_plan_read_refuses_pages_of_another_count(native: batch_io.BatchIO, tmp_path: Path) -> None:
    fd, plan, _ = _slot_file(tmp_path / "slab", ["ok"] * 3, random.Random(1), False)
    os.close(fd)
    dst = HostBuffer(3 * PAGE)
    with pytest.raises(ValueError):
        native.plan_read(plan, _pages(dst, 2, False))
    call = native.plan_read(plan, _pages(dst, 3, True))
    assert native.read_plan(call, 1, 1) == 0
    with pytest.raises(ValueError):
        native.read_plan(call, 2, 4)
