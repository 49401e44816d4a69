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
from hicache_l3.slab.readers import ResidentReaders

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
    lib = batch_io.library()
    assert lib is not None, f"hicache_l3._batch_io unavailable: {batch_io.unavailable_reason()}"
    assert lib.reads_plans, "hicache_l3._batch_io built without hl3_read_plan"
    return lib


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
    assert native.shares, "hicache_l3._batch_io built without hl3_share_read_plan"
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


# ---- resident readers: threads that wait in C for the batches (hicache_l3/slab/readers.py) ---

def _expect_read(call: batch_io.PlanRead, dst: HostBuffer, damage: list[str], data: bytes) -> None:
    assert list(call.status) == [EXPECTED[d] for d in damage]
    got = bytes(dst.view())
    for j in range(len(damage)):
        if call.status[j] == OK:
            page = data[j * PAGE:(j + 1) * PAGE]
            assert got[j * PAGE:(j + 1) * PAGE] == page[SEG:] + page[:SEG]


def _publish_as_another_caller(readers: ResidentReaders, call: batch_io.PlanRead, chunk: int) -> None:
    """Publish ``call`` in ``readers``' mailbox (fixed chunks of ``chunk`` pages) as another
    caller would: the mailbox is owned from here until ``done``."""
    lib = readers._lib
    assert lib is not None
    args = call.args
    owned = array.array("q", (0,))
    assert lib.publish(readers._mailbox, len(call.status), chunk, 0, 0, args.buffer_info()[0],
                       owned.buffer_info()[0])
    assert owned[0] == 1


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.lists(st.sampled_from(DAMAGE), min_size=1, max_size=MAX_PAGES),
       threads=st.integers(1, 2), chunk=st.integers(1, 6), guided=st.booleans(),
       linger=st.sampled_from([0, 200_000]), seed=st.integers(0, 2**32))
def test_resident_readers_read_every_page_once(native: batch_io.BatchIO, tmp_path: Path, damage: list[str],
                                               threads: int, chunk: int, guided: bool, linger: int,
                                               seed: int) -> None:
    """A batch published to resident readers (awake or asleep: ``linger`` 0 sends them to
    sleep at once) is read with the statuses and bytes of one whole read, and the call
    returns only once every page is."""
    n = len(damage)
    fd, plan, data = _slot_file(tmp_path / "slab", damage, random.Random(seed), False)
    readers = ResidentReaders(threads, "test-r", linger)
    try:
        assert readers.running
        dst = HostBuffer(n * PAGE)
        call = native.plan_read(plan, _pages(dst, n, True))
        if linger == 0:
            time.sleep(0.002)  # asleep on the futex by now
        readers.wake()
        assert readers.read(call, chunk, 2 * (threads + 1) if guided else 0, False, 5_000_000_000)
        _expect_read(call, dst, damage, data)
    finally:
        readers.close()
        os.close(fd)


def test_a_second_caller_finds_the_readers_taken_and_reads_nothing(native: batch_io.BatchIO,
                                                                   tmp_path: Path) -> None:
    """While one caller owns the readers' mailbox (from its publish to its end), another's
    read says False and touches nothing (it shares its batch another way); once the owner
    is done, the readers take the next batch."""
    n = 8
    fd, plan, data = _slot_file(tmp_path / "slab", ["ok"] * n, random.Random(4), False)
    readers = ResidentReaders(1, "test-r")
    try:
        lib, mailbox = readers._lib, readers._mailbox
        assert lib is not None
        first_dst, second_dst = HostBuffer(n * PAGE), HostBuffer(n * PAGE)
        first = native.plan_read(plan, _pages(first_dst, n, True))
        _publish_as_another_caller(readers, first, 2)
        second = native.plan_read(plan, _pages(second_dst, n, True))
        second.status[:] = array.array("i", [99]) * n
        assert not readers.read(second, 2, 0, False, 1_000_000_000)
        assert list(second.status) == [99] * n and bytes(second_dst.view()) == bytes(n * PAGE)
        assert lib.read(mailbox, 1_000_000_000)  # the owner's drain: every chunk done
        lib.done(mailbox)
        _expect_read(first, first_dst, ["ok"] * n, data)
        assert readers.read(second, 2, 0, False, 1_000_000_000)
        _expect_read(second, second_dst, ["ok"] * n, data)
    finally:
        readers.close()
        os.close(fd)


def test_concurrent_callers_each_read_their_own_pages(native: batch_io.BatchIO, tmp_path: Path) -> None:
    """Callers racing for the readers: each batch is read whole and exactly once, by the
    readers with its caller or (mailbox taken) by its caller alone."""
    n = 12
    fd, plan, data = _slot_file(tmp_path / "slab", ["ok"] * n, random.Random(5), False)
    readers = ResidentReaders(1, "test-r", 50_000)
    failures: list[str] = []
    took = [0, 0]

    def caller(who: int) -> None:
        for _ in range(150):
            dst = HostBuffer(n * PAGE)
            call = native.plan_read(plan, _pages(dst, n, True))
            call.status[:] = array.array("i", [99]) * n
            if readers.read(call, 2, 4, False, 1_000_000_000):
                took[who] += 1
            else:
                native.read_plan(call, 0, n)
            try:
                _expect_read(call, dst, ["ok"] * n, data)
            except AssertionError as exc:
                failures.append(str(exc))

    try:
        threads = [threading.Thread(target=caller, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        readers.close()
        os.close(fd)
    assert not failures, failures[:3]
    assert sum(took) > 0, "the readers never took a batch"


def test_closed_or_forked_readers_read_nothing(native: batch_io.BatchIO, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A process forked from the one that started the readers has none (its read says
    False); closing stops and joins them at once, even asleep, and later reads say False."""
    n = 4
    fd, plan, _ = _slot_file(tmp_path / "slab", ["ok"] * n, random.Random(6), False)
    os.close(fd)
    call = native.plan_read(plan, _pages(HostBuffer(n * PAGE), n, True))
    readers = ResidentReaders(2, "test-r", 0)
    threads = list(readers._threads)
    assert len(threads) == 2 and all(t.is_alive() for t in threads)
    real_pid = os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: real_pid + 1)
    assert not readers.running and not readers.read(call, 1, 0, False, 1_000_000)
    monkeypatch.undo()
    time.sleep(0.002)  # both asleep on the futex
    start = time.monotonic()
    readers.close()
    assert time.monotonic() - start < 1.0
    assert not any(t.is_alive() for t in threads)
    assert not readers.running and not readers.read(call, 1, 0, False, 1_000_000)


def test_readers_closed_under_an_owner_keep_its_mailbox(native: batch_io.BatchIO, tmp_path: Path) -> None:
    """Closing while a caller owns the mailbox (a get still in flight) stops the readers
    but keeps the mailbox the caller still uses; the caller's drain and end still work."""
    n = 4
    fd, plan, data = _slot_file(tmp_path / "slab", ["ok"] * n, random.Random(7), False)
    readers = ResidentReaders(1, "test-r")
    try:
        lib, mailbox = readers._lib, readers._mailbox
        assert lib is not None
        dst = HostBuffer(n * PAGE)
        call = native.plan_read(plan, _pages(dst, n, True))
        _publish_as_another_caller(readers, call, 1)
        readers.close()
        assert readers._mailbox == mailbox  # kept
        assert lib.read(mailbox, 1_000_000_000)  # the owner goes on with it
        lib.done(mailbox)
        _expect_read(call, dst, ["ok"] * n, data)
    finally:
        os.close(fd)


# ---- resident writes: a set's batch taken by the same threads (ResidentReaders.write) --------

def _write_batch(path: Path, n: int, src: HostBuffer, records: bytes) -> tuple[int, PageBatch]:
    """A write batch of ``n`` two-segment pages from ``src`` into slots of a new file at
    ``path`` (marker table first, data after it): (fd, batch)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    pages = [((src.address + j * PAGE + SEG, SEG), (src.address + j * PAGE, SEG)) for j in range(n)]
    return fd, PageBatch(RECORD_BYTES, [fd] * n, [DATA0 + j * PAGE for j in range(n)],
                         [j * RECORD_BYTES for j in range(n)], pages,
                         [records[j * RECORD_BYTES:(j + 1) * RECORD_BYTES] for j in range(n)], writing=True)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, MAX_PAGES), threads=st.integers(1, 2), chunk=st.integers(1, 6),
       checksum=st.booleans(), linger=st.sampled_from([0, 200_000]), seed=st.integers(0, 2**32))
def test_resident_writes_write_what_one_call_writes(native: batch_io.BatchIO, tmp_path: Path, n: int,
                                                    threads: int, chunk: int, checksum: bool, linger: int,
                                                    seed: int) -> None:
    """A write batch published to the resident threads (awake or asleep) leaves the file,
    the statuses and the checksums one whole write leaves, and the call returns only once
    every page is written; a planned read through the same threads then reads it back."""
    rng = random.Random(seed)
    src = HostBuffer(n * PAGE)
    src.view()[:] = rng.randbytes(n * PAGE)
    records = rng.randbytes(n * RECORD_BYTES)
    fd, batch = _write_batch(tmp_path / "resident", n, src, records)
    ref_fd, ref = _write_batch(tmp_path / "reference", n, src, records)
    readers = ResidentReaders(threads, "test-w", linger)
    try:
        assert native.write(ref, 0, n, checksum) == 0
        if linger == 0:
            time.sleep(0.002)  # asleep on the futex by now
        readers.wake()
        assert readers.write(native.write_args(batch, checksum), n, chunk, 5_000_000_000)
        assert list(batch.status) == [OK] * n == list(ref.status)
        assert list(batch.checksums) == list(ref.checksums)
        assert bool(batch.checksums[0]) == checksum
        assert (tmp_path / "resident").read_bytes() == (tmp_path / "reference").read_bytes()
        written = (tmp_path / "resident").read_bytes()
        csums = array.array("Q", batch.checksums)
        expect = bytearray(written[:n * RECORD_BYTES])
        plan = GetPlan(n, n, array.array("Q", bytes(48 * n)), array.array("i", bytes(4 * n)),
                       array.array("q", [DATA0 + j * PAGE for j in range(n)]),
                       array.array("q", [j * RECORD_BYTES for j in range(n)]), expect, csums,
                       array.array("i", range(n)), array.array("i", [fd] * n), PAGE)
        dst = HostBuffer(n * PAGE)
        call = native.plan_read(plan, _pages(dst, n, True))
        assert readers.read(call, chunk, 0, False, 5_000_000_000)  # a read after a write: its op
        assert list(call.status) == [OK] * n
        assert bytes(dst.view()) == bytes(src.view())
    finally:
        readers.close()
        os.close(fd)
        os.close(ref_fd)


def test_a_write_finds_the_readers_taken_and_writes_nothing(native: batch_io.BatchIO, tmp_path: Path) -> None:
    """While another caller owns the mailbox, a write says False and writes nothing (the
    transport then shares it through its pool); once the owner is done it goes through."""
    n = 8
    fd, plan, _ = _slot_file(tmp_path / "slab", ["ok"] * n, random.Random(8), False)
    src = HostBuffer(n * PAGE)
    src.view()[:] = random.Random(9).randbytes(n * PAGE)
    wfd, batch = _write_batch(tmp_path / "written", n, src, bytes(n * RECORD_BYTES))
    readers = ResidentReaders(1, "test-w")
    try:
        lib, mailbox = readers._lib, readers._mailbox
        assert lib is not None
        first = native.plan_read(plan, _pages(HostBuffer(n * PAGE), n, True))
        _publish_as_another_caller(readers, first, 2)
        args = native.write_args(batch, False)
        assert not readers.write(args, n, 2, 1_000_000_000)
        assert list(batch.status) == [0] * n and os.fstat(wfd).st_size == 0
        assert lib.read(mailbox, 1_000_000_000)
        lib.done(mailbox)
        assert readers.write(args, n, 2, 1_000_000_000)
        assert list(batch.status) == [OK] * n
        data = bytes(src.view())
        assert (tmp_path / "written").read_bytes()[DATA0:] == b"".join(  # (each page's segments swapped)
            data[j * PAGE + SEG:(j + 1) * PAGE] + data[j * PAGE:j * PAGE + SEG] for j in range(n))
    finally:
        readers.close()
        os.close(fd)
        os.close(wfd)
