"""BatchPool: every item once, errors propagate, nothing runs after return."""

from __future__ import annotations

import threading
import time

import pytest

from hicache_l3.common.parallel import BatchPool


@pytest.mark.parametrize("threads, n, chunk", [(1, 10, 3), (2, 1, 4), (2, 128, 16), (3, 100, 7), (2, 5, 8)])
def test_every_item_runs_exactly_once(threads: int, n: int, chunk: int) -> None:
    pool = BatchPool(threads, "t")
    try:
        seen: list[int] = []
        lock = threading.Lock()

        def fn(lo: int, hi: int) -> None:
            assert 0 <= lo < hi <= n and hi - lo <= chunk
            with lock:
                seen.extend(range(lo, hi))

        pool.run_chunks(fn, n, chunk)
        assert sorted(seen) == list(range(n))
        pool.run_chunks(fn, 0, chunk)  # nothing to do: fn never called
        assert len(seen) == n
    finally:
        pool.shutdown()


def test_a_failing_chunk_raises_and_no_chunk_runs_after_the_call() -> None:
    pool = BatchPool(2, "t")
    try:
        running = 0
        after: list[int] = []
        returned = threading.Event()
        lock = threading.Lock()

        def fn(lo: int, hi: int) -> None:
            nonlocal running
            with lock:
                running += 1
                if returned.is_set():
                    after.append(lo)
            try:
                time.sleep(0.002)
                if lo == 32:
                    raise OSError("chunk 32 failed")
            finally:
                with lock:
                    running -= 1

        with pytest.raises(OSError, match="chunk 32"):
            pool.run_chunks(fn, 1000, 8)
        returned.set()
        assert running == 0  # no chunk was still running when the call raised
        time.sleep(0.05)
        assert after == []  # and none started afterwards
    finally:
        pool.shutdown()


class _Share:
    """A Python stand-in for a native share (``hl3_share_read_plan``'s protocol): chunks
    claimed under a lock, ``done`` counted, the caller's wait bounded."""

    def __init__(self, n: int, chunk: int, work_s: float = 0.0, fail_at: int | None = None,
                 pool_work_s: float | None = None) -> None:
        self.n, self.chunk, self.work_s, self.fail_at = n, chunk, work_s, fail_at
        self.pool_work_s = work_s if pool_work_s is None else pool_work_s
        self.next = self.done = 0
        self.lock = threading.Lock()
        self.seen: list[int] = []
        self.stopped = 0

    def drain(self, wait_ns: int) -> bool:
        while True:
            with self.lock:
                lo = self.next
                if lo >= self.n:
                    break
                self.next = hi = min(self.n, lo + self.chunk)
            time.sleep(self.work_s if wait_ns else self.pool_work_s)  # (pool threads drain with 0)
            if self.fail_at is not None and lo <= self.fail_at < hi:
                raise OSError(f"chunk at {lo} failed")
            with self.lock:
                self.seen.extend(range(lo, hi))
                self.done += hi - lo
        end = time.monotonic() + wait_ns / 1e9
        while self.done < self.n and time.monotonic() < end:
            time.sleep(0.0002)
        return self.done >= self.n

    def stop(self) -> None:
        with self.lock:
            self.stopped += 1
            self.next = self.n


@pytest.mark.parametrize("threads, n, chunk", [(1, 10, 3), (2, 1, 4), (2, 128, 16), (3, 100, 7)])
def test_run_shared_runs_every_item_once_and_returns_when_all_finished(threads: int, n: int,
                                                                       chunk: int) -> None:
    pool = BatchPool(threads, "t")
    try:
        share = _Share(n, chunk, work_s=0.0005)
        pool.run_shared(share.drain, share.stop, -(-n // chunk), 2_000_000_000)
        assert share.done == n and sorted(share.seen) == list(range(n))
        assert share.stopped == 0  # the caller's drain saw every chunk finish: nothing to stop
    finally:
        pool.shutdown()


def test_run_shared_stops_and_waits_when_a_chunk_outlasts_the_callers_wait() -> None:
    """The caller's bounded wait ends before a slow chunk: the claims are stopped and the call
    returns only once no pool thread runs a chunk."""
    pool = BatchPool(2, "t")
    try:
        # two chunks: the caller's takes 0.2 s, in which the pool thread surely claims the other,
        # which takes 0.5 s: far longer than the caller's 1 ms wait
        share = _Share(8, 4, work_s=0.2, pool_work_s=0.5)
        pool.run_shared(share.drain, share.stop, 2, 1_000_000)
        assert share.stopped == 1
        assert share.done == share.next  # every claimed chunk finished before the return
    finally:
        pool.shutdown()


def test_run_shared_raises_a_pool_drains_error_after_waiting_for_it() -> None:
    pool = BatchPool(2, "t")
    try:
        share = _Share(64, 4, work_s=0.002, fail_at=60)
        with pytest.raises(OSError, match="failed"):
            pool.run_shared(share.drain, share.stop, 16, 50_000_000)
        assert share.stopped == 1
    finally:
        pool.shutdown()


@pytest.mark.parametrize("threads, n", [(1, 5), (2, 1), (4, 3), (16, 128)])
def test_start_runs_every_item_once_off_the_caller(threads: int, n: int) -> None:
    pool = BatchPool(threads, "t", min_share=1)
    try:
        seen: list[int] = []
        where: set[int] = set()
        lock = threading.Lock()

        def fn(lo: int, hi: int) -> None:
            with lock:
                seen.extend(range(lo, hi))
                where.add(threading.get_ident())

        pool.start(fn, n).wait()
        assert sorted(seen) == list(range(n))
        assert (threading.get_ident() in where) == (threads == 1)
        pool.start(fn, 0).wait()
        assert len(seen) == n
    finally:
        pool.shutdown()


def test_start_wait_raises_a_shares_error_once_none_is_running() -> None:
    pool = BatchPool(4, "t", min_share=1)
    try:
        running = 0
        lock = threading.Lock()

        def fn(lo: int, hi: int) -> None:
            nonlocal running
            with lock:
                running += 1
            try:
                time.sleep(0.01 if lo else 0.0)
                if lo == 0:
                    raise OSError("share 0 failed")
            finally:
                with lock:
                    running -= 1

        started = pool.start(fn, 3)
        with pytest.raises(OSError, match="share 0"):
            started.wait()
        assert running == 0  # the other shares ended before wait raised
    finally:
        pool.shutdown()
