"""BatchPool.run_chunks: every item once, errors propagate, nothing runs after return."""

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
