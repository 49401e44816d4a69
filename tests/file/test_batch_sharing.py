"""How the native transport shares a batch among its I/O threads: a batch moving less than
``PARALLEL_MIN_BYTES`` runs as one call on the caller's thread (a second thread cost more
than it saved on small pages), a bigger one is cut into chunks the threads claim (claimed
and joined in C, by the threads resident in C where the read pool has some, else by
``BatchPool.run_shared``'s pool threads); the bytes read back are exact either way."""

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
from hicache_l3.slab.readers import ResidentReaders

NS = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)


@pytest.mark.parametrize("io_threads", [2, 1])
@pytest.mark.parametrize(("page", "n"), [(256, 128), (4096, 128), (32 << 10, 64), (64 << 10, 128)])
def test_small_batches_run_whole_and_big_ones_are_shared(tmp_path: Path, page: int, n: int, io_threads: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int]] = []
    shared: list[int] = []
    resident: list[bool] = []
    resident_writes: list[bool] = []
    run_chunks, run_shared, read = BatchPool.run_chunks, BatchPool.run_shared, ResidentReaders.read
    write = ResidentReaders.write

    def spy(self: BatchPool, fn: Any, count: int, chunk: int) -> None:
        calls.append((count, chunk))
        run_chunks(self, fn, count, chunk)

    def spy_shared(self: BatchPool, drain: Any, stop: Any, chunks: int, wait_ns: int) -> None:
        shared.append(chunks)
        run_shared(self, drain, stop, chunks, wait_ns)

    def spy_resident(self: ResidentReaders, *args: Any) -> bool:
        resident.append(read(self, *args))
        return resident[-1]

    monkeypatch.setattr(BatchPool, "run_chunks", spy)
    monkeypatch.setattr(BatchPool, "run_shared", spy_shared)
    def spy_resident_write(self: ResidentReaders, *args: Any) -> bool:
        resident_writes.append(write(self, *args))
        return resident_writes[-1]

    monkeypatch.setattr(ResidentReaders, "read", spy_resident)
    monkeypatch.setattr(ResidentReaders, "write", spy_resident_write)
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
    # (by the resident reader, which took both, where the read pool has two threads; with
    # one, the write by a pool thread and the read as one call)
    if not big:
        assert len(calls) == 2 and all(count == chunk == n for count, chunk in calls), calls
        assert not shared and not resident and not resident_writes, (shared, resident, resident_writes)
    elif io_threads > 1:
        assert not calls and not shared, (calls, shared)
        assert resident_writes == [True] and resident == [True], (resident_writes, resident)
    else:
        assert calls == [(n, n)] and len(shared) == 1 and shared[0] > 1, (calls, shared)
        assert not resident and not resident_writes, (resident, resident_writes)


def _reader_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hicache-file-r")]


@pytest.mark.parametrize("same_cpu", [True, False])
def test_a_reader_on_the_callers_cpu_moves_off_it(tmp_path: Path, same_cpu: bool) -> None:
    """A resident reader that finds itself on the CPU of the caller whose batch it is to
    share moves to the other CPUs it may use; one on another CPU stays where it is."""
    allowed = sorted(os.sched_getaffinity(0))
    assert len(allowed) >= 2, f"this test needs two CPUs, the process may use {allowed}"
    mine, other = allowed[0], allowed[1]
    n, page = 128, 64 << 10
    with open_connector("file", NS, root=str(tmp_path), io_threads=2) as conn:
        readers = _reader_threads()
        assert readers, "no resident reader started"
        try:
            os.sched_setaffinity(0, {mine})  # this thread: the caller
            for t in readers:
                assert t.native_id is not None
                os.sched_setaffinity(t.native_id, {mine if same_cpu else other})
            keys = [f"k{i}" for i in range(n)]
            pages = Pages(conn, page, n)
            pages.fill(keys)
            assert conn.batch_set(keys, pages.pages) == [True] * n
            for _ in range(20):  # gets the reader shares, each after it fell asleep
                pages.wipe()
                assert conn.batch_get(keys, pages.pages) == [True] * n
                assert all(pages.matches(i, k) for i, k in enumerate(keys))
                if conn.stats()["engine"]["reader_moves"]:
                    break
                time.sleep(0.01)
            deadline = time.monotonic() + 2
            while same_cpu and not conn.stats()["engine"]["reader_moves"] and time.monotonic() < deadline:
                time.sleep(0.01)  # (this CPU free: a reader woken onto it runs, and moves)
            moves = conn.stats()["engine"]["reader_moves"]
            cpus = [os.sched_getaffinity(t.native_id) for t in readers if t.native_id is not None]
        finally:
            os.sched_setaffinity(0, set(allowed))
    if same_cpu:
        assert moves >= 1 and all(mine not in c and c for c in cpus), (moves, cpus)
    else:
        assert moves == 0 and all(c == {other} for c in cpus), (moves, cpus)
