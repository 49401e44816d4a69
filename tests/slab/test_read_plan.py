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
import threading
import time
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
DAMAGE = ("ok", "flip", "flip-end", "record", "both", "short", "unchecked", "badfd")
EXPECTED = {"ok": OK, "flip": CHECKSUM, "flip-end": CHECKSUM, "record": HEADER, "both": HEADER,
            "short": SHORT, "unchecked": OK, "badfd": -errno.EBADF}
BIG_SEG = 200 << 10
"""Segments of a 400 KiB page: bigger than one coalesced read (``HL3_READ_RUN``, 256 KiB), so
read and hashed in pieces, the cut inside its second segment."""


@pytest.fixture(scope="module")
def native() -> batch_io.BatchIO:
    return batch_io.library()


def _slot_file(path: Path, damage: list[str], rng: random.Random, gap: bool,
               seg: int = SEG) -> tuple[int, GetPlan, bytes]:
    """A file of ``len(damage)`` slots of two ``seg``-byte segments (adjacent, or one page
    apart when ``gap``), page ``j`` damaged as ``damage[j]`` says, and the plan of reading
    them back: (fd, plan, the bytes stored)."""
    n, page_bytes = len(damage), 2 * seg
    stride = 2 * page_bytes if gap else page_bytes
    data = rng.randbytes(n * page_bytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    data_offs = array.array("q", (DATA0 + j * stride for j in range(n)))
    marker_offs = array.array("q", (j * RECORD_BYTES for j in range(n)))
    csums = array.array("Q", bytes(8 * n))
    expect = bytearray()
    for j, what in enumerate(damage):
        page = data[j * page_bytes:(j + 1) * page_bytes]
        record = rng.randbytes(RECORD_BYTES)
        expect += record
        os.pwrite(fd, record if what not in ("record", "both") else bytes(b ^ 1 for b in record),
                  marker_offs[j])
        stored = page if what not in ("flip", "both") else bytes([page[0] ^ 0xFF]) + page[1:]
        if what == "flip-end":  # the last byte: in the last piece of a page read in pieces
            stored = page[:-1] + bytes([page[-1] ^ 0xFF])
        if what == "short":
            stored = stored[: page_bytes // 2]
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


def _pages(dst: HostBuffer, n: int, flat: bool, seg: int = SEG) -> list[Page] | FlatPages:
    """``n`` destination pages of two ``seg``-byte segments each, the second segment first
    in memory (the segments of a page need not be in address order for the read)."""
    pages = [((dst.address + j * 2 * seg + seg, seg), (dst.address + j * 2 * seg, seg)) for j in range(n)]
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
        expect = [bytes(plan.expect[RECORD_BYTES * j:RECORD_BYTES * (j + 1)]) for j in range(n)]
        ref = PageBatch(RECORD_BYTES, list(plan.fds), list(plan.data_offs), list(plan.marker_offs),
                        _pages(dst_ref, n, False), expect, list(plan.csums), writing=False)
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


@pytest.mark.parametrize("nowait", [False, True])
def test_a_page_bigger_than_a_run_is_read_and_hashed_in_pieces(native: batch_io.BatchIO, tmp_path: Path,
                                                               nowait: bool) -> None:
    """A page bigger than one coalesced read is read in pieces, each hashed right after its
    read (while in cache): the same statuses and bytes as a whole read, damage in its first
    or last piece caught; with ``nowait``, a page the file cannot hold whole is left for a
    blocking read (AGAIN), as a smaller page is."""
    damage = ["ok", "flip", "flip-end", "record", "both", "short", "unchecked", "ok"]
    n, page_bytes = len(damage), 2 * BIG_SEG
    fd, plan, data = _slot_file(tmp_path / "slab", damage, random.Random(5), False, seg=BIG_SEG)
    try:
        dst = HostBuffer(n * page_bytes)
        call = native.plan_read(plan, _pages(dst, n, False, seg=BIG_SEG))
        bad = native.read_plan(call, 0, n, nowait)
    finally:
        os.close(fd)
    want = [batch_io.AGAIN if nowait and d == "short" else EXPECTED[d] for d in damage]
    assert list(call.status) == want
    assert bad == sum(w != OK for w in want)
    got = bytes(dst.view())
    for j in range(n):
        if want[j] == OK:
            page = data[j * page_bytes:(j + 1) * page_bytes]
            assert got[j * page_bytes:(j + 1) * page_bytes] == page[BIG_SEG:] + page[:BIG_SEG]


# ---- one batch shared by threads, claimed and joined in C (hl3_share_read_plan) --------------

@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.lists(st.sampled_from(DAMAGE), min_size=1, max_size=MAX_PAGES),
       threads=st.integers(1, 3), chunk=st.integers(1, 6), guided=st.booleans(), seed=st.integers(0, 2**32))
def test_a_shared_read_reads_every_page_once_whichever_thread_claims_it(
        native: batch_io.BatchIO, tmp_path: Path, damage: list[str], threads: int, chunk: int, guided: bool,
        seed: int) -> None:
    """Threads draining one share (chunks of ``chunk`` pages, or guided: big first, small
    last) read every page once, with the statuses and bytes of one whole read; the calling
    thread's drain returns True only once every chunk has finished."""
    n = len(damage)
    fd, plan, data = _slot_file(tmp_path / "slab", damage, random.Random(seed), False)
    try:
        dst = HostBuffer(n * PAGE)
        call = native.plan_read(plan, _pages(dst, n, True))
        share = batch_io.Share(n, chunk, 2 * threads if guided else 0)
        others = [threading.Thread(target=native.share_read_plan, args=(share, call, 0))
                  for _ in range(threads - 1)]
        for t in others:
            t.start()
        finished = native.share_read_plan(share, call, 5_000_000_000)
        done_then = share.done
        for t in others:
            t.join()
    finally:
        os.close(fd)
    assert finished and done_then == n
    assert list(call.status) == [EXPECTED[d] for d in damage]
    got = bytes(dst.view())
    for j in range(n):
        if call.status[j] == OK:
            page = data[j * PAGE:(j + 1) * PAGE]
            assert got[j * PAGE:(j + 1) * PAGE] == page[SEG:] + page[:SEG]


def test_a_drain_of_a_finished_or_stopped_share_touches_no_page(native: batch_io.BatchIO,
                                                                tmp_path: Path) -> None:
    """A pool thread that starts after the batch ended (every page claimed and finished) or
    after it was stopped (an interrupted caller) claims nothing: it reads no page and
    writes no status."""
    n = 6
    fd, plan, _ = _slot_file(tmp_path / "slab", ["ok"] * n, random.Random(2), False)
    try:
        dst = HostBuffer(n * PAGE)
        call = native.plan_read(plan, _pages(dst, n, True))
        share = batch_io.Share(n, 2)
        assert native.share_read_plan(share, call, 0) and share.done == n
        assert list(call.status) == [OK] * n
        call.status[:] = array.array("i", [99]) * n
        dst.view()[:] = bytes(n * PAGE)
        assert native.share_read_plan(share, call, 0)  # late: nothing left to claim
        stopped = batch_io.Share(n, 2)
        native.share_stop(stopped)
        assert not native.share_read_plan(stopped, call, 0)  # nothing claimed, nothing finished
        assert stopped.done == 0
    finally:
        os.close(fd)
    assert list(call.status) == [99] * n
    assert bytes(dst.view()) == bytes(n * PAGE)


def test_the_callers_wait_for_a_chunk_still_running_is_bounded(native: batch_io.BatchIO,
                                                               tmp_path: Path) -> None:
    """When a chunk another thread claimed does not finish, the calling thread's wait ends
    after its bound (then it waits for the pool threads as a sleeper): False, in at least
    the bound and at most twice it."""
    fd, plan, _ = _slot_file(tmp_path / "slab", ["ok"] * 4, random.Random(3), False)
    os.close(fd)
    call = native.plan_read(plan, _pages(HostBuffer(4 * PAGE), 4, True))
    share = batch_io.Share(4, 4)
    native.share_stop(share)  # as if another thread had claimed every page and were still reading
    wait_s = 0.05
    start = time.monotonic()
    assert not native.share_read_plan(share, call, int(wait_s * 1e9))
    took = time.monotonic() - start
    assert wait_s <= took <= 2 * wait_s, took
    assert share.spins > 0
