"""How the native transport shares a batch among its I/O threads: a batch moving less than
``PARALLEL_MIN_BYTES`` runs as one call on the caller's thread (a second thread cost more
than it saved on small pages), a bigger one is cut into chunks the caller and the pool's
threads claim (claimed and joined in C: ``BatchPool.run_shared``); the bytes read back are
exact either way. Between calls the pool's threads sleep, blocked, on the CPUs they started
with (docs/architecture.md: nothing that changes the host process)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.parallel import BatchPool
from hicache_l3.conformance.pages import Pages
from hicache_l3.slab.io import PARALLEL_MIN_BYTES

NS = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)


@pytest.mark.parametrize("io_threads", [2, 1])
@pytest.mark.parametrize(("page", "n"), [(256, 128), (4096, 128), (32 << 10, 64), (64 << 10, 128)])
def test_small_batches_run_whole_and_big_ones_are_shared(tmp_path: Path, page: int, n: int, io_threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    shared: list[int] = []
    run_chunks, run_shared = BatchPool.run_chunks, BatchPool.run_shared

    def spy(self: BatchPool, fn: Any, count: int, chunk: int) -> None:
        calls.append((count, chunk))
        run_chunks(self, fn, count, chunk)

    def spy_shared(self: BatchPool, drain: Any, stop: Any, chunks: int, wait_ns: int) -> None:
        shared.append(chunks)
        run_shared(self, drain, stop, chunks, wait_ns)

    monkeypatch.setattr(BatchPool, "run_chunks", spy)
    monkeypatch.setattr(BatchPool, "run_shared", spy_shared)
    big = n * page >= PARALLEL_MIN_BYTES
    with open_connector("file", NS, root=str(tmp_path), io_threads=io_threads, write_threads=2) as conn:
        keys = [f"k{i}" for i in range(n)]
        pages = Pages(conn, page, n)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * n
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * n
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
    # the write, then the read (all in the page cache: the cold pool has nothing to read):
    # a small batch as one call, a big one shared by the threads, claimed and joined in C
    # (the write by the two write threads; the read by the read pool's where it has two,
    # else as one call)
    if not big:
        assert len(calls) == 2 and all(count == chunk == n for count, chunk in calls), calls
        assert not shared, shared
    elif io_threads > 1:
        assert not calls and len(shared) == 2 and min(shared) > 1, (calls, shared)
    else:
        assert calls == [(n, n)] and len(shared) == 1 and shared[0] > 1, (calls, shared)


def _own_threads() -> dict[int, str]:
    """The native ids and names of this library's threads now running."""
    return {t.native_id: t.name for t in threading.enumerate()
            if t.name.startswith("hicache-") and t.native_id is not None}


def _state(tid: int) -> str:
    """The scheduler state of thread ``tid`` of this process (R running, S sleeping...)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def test_io_threads_sleep_between_calls_on_the_cpus_they_started_with(tmp_path: Path) -> None:
    """After big sets and gets (shared by the pool threads), every I/O thread of the
    connector sleeps, blocked, until the next call (none spins or waits on a CPU between
    calls), and no thread's CPU affinity was changed."""
    allowed = os.sched_getaffinity(0)
    n, page = 128, 64 << 10
    with open_connector("file", NS, root=str(tmp_path), io_threads=2, write_threads=2) as conn:
        keys = [f"k{i}" for i in range(n)]
        pages = Pages(conn, page, n)
        pages.fill(keys)
        for _ in range(3):
            assert conn.batch_set(keys, pages.pages) == [True] * n
            pages.wipe()
            assert conn.batch_get(keys, pages.pages) == [True] * n
            assert all(pages.matches(i, k) for i, k in enumerate(keys))
        threads = _own_threads()
        assert threads, "no I/O thread started"
        time.sleep(0.05)
        for _ in range(5):
            running = {name: _state(tid) for tid, name in threads.items() if _state(tid) not in "SD"}
            assert not running, running
            time.sleep(0.01)
        moved = {name: os.sched_getaffinity(tid) for tid, name in threads.items()
                 if os.sched_getaffinity(tid) != allowed}
        assert not moved, moved
