"""Raw contenders of the beyond-memory bench: :class:`RawDirect` (random O_DIRECT blocks
from many threads, a batch at a time) and :func:`run_fio` (``fio`` on the same file)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

from hicache_l3.bench.runner import BenchError


class FioJob(NamedTuple):
    """One ``fio`` contender; ``batch``: ``iodepth`` blocks submitted, then all of them
    awaited (the shape of a connector's synchronous batch), else a queue kept full."""

    name: str
    rw: str
    ioengine: str
    iodepth: int
    numjobs: int
    batch: bool = False


FIO_JOBS = (
    FioJob("fio-io_uring-qd32", "randread", "io_uring", 32, 1),
    FioJob("fio-io_uring-batch128", "randread", "io_uring", 128, 1, batch=True),
    FioJob("fio-psync-16jobs", "randread", "psync", 1, 16),
    FioJob("fio-io_uring-qd32", "randwrite", "io_uring", 32, 1),
)


class RawDirect:
    """``threads`` threads moving random blocks of ``page_bytes`` with O_DIRECT
    ``preadv``/``pwritev`` (through the page cache when not ``direct``) on one file of
    ``pages`` blocks; block ``i`` lies at ``i * page_bytes``. Buffers must be 4 KiB aligned
    (a :class:`HostBuffer`'s are)."""

    def __init__(self, path: Path, pages: int, page_bytes: int, threads: int = 16,
                 direct: bool = True) -> None:
        if page_bytes % 4096:
            raise BenchError(f"O_DIRECT needs 4 KiB multiples, got a page of {page_bytes} bytes")
        self.path = path
        self.pages = pages
        self.page_bytes = page_bytes
        self.threads = threads
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0), 0o600)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="raw-direct")

    def _share(self, op: str, blocks: Sequence[int], views: Sequence[memoryview]) -> bool:
        fd, size = self.fd, self.page_bytes
        call = os.pwritev if op == "set" else os.preadv
        return all(call(fd, [view], block * size) == size for block, view in zip(blocks, views))

    def move(self, op: str, blocks: Sequence[int], views: Sequence[memoryview]) -> bool:
        """Blocks ``blocks`` from (``"set"``) or into (``"get"``) ``views``, one per block,
        cut into ``threads`` shares moved at once; whether every block moved whole."""
        n = len(blocks)
        cuts = [n * t // self.threads for t in range(self.threads + 1)]
        futures = [self.pool.submit(self._share, op, blocks[a:b], views[a:b])
                   for a, b in itertools.pairwise(cuts) if b > a]
        return all(f.result() for f in futures)

    def close(self) -> None:
        """Stop the threads and close the file (the caller removes it)."""
        self.pool.shutdown()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def fio_available() -> bool:
    """Whether ``fio`` is on the PATH."""
    return shutil.which("fio") is not None


def run_fio(path: Path, size: int, page_bytes: int, job: FioJob, seconds: float) -> dict[str, Any]:
    """``fio`` random ``job.rw`` of ``page_bytes`` blocks with O_DIRECT over the first
    ``size`` bytes of ``path`` for ``seconds``: ``{"bytes", "seconds"}`` it reported, all
    jobs together. BenchError when it fails."""
    rw, ioengine, depth = job.rw, job.ioengine, job.iodepth
    batch = [f"--iodepth_batch_submit={depth}", f"--iodepth_batch_complete_min={depth}"] if job.batch else []
    args = ["fio", "--name=hicache-l3-beyond", f"--filename={path}", f"--rw={rw}", *batch,
            f"--bs={page_bytes}", "--direct=1", f"--ioengine={ioengine}", f"--iodepth={depth}",
            f"--numjobs={job.numjobs}", f"--size={size}", f"--runtime={max(1, round(seconds))}",
            "--time_based", "--group_reporting", "--norandommap", "--randrepeat=0",
            "--output-format=json"]
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=seconds + 120)
    except subprocess.TimeoutExpired:
        raise BenchError(f"fio {rw} ({ioengine}) did not end within {seconds + 120:g} s") from None
    if done.returncode != 0:
        raise BenchError(f"fio {rw} ({ioengine}) failed: {done.stderr.strip()[-500:]}")
    text = done.stdout[done.stdout.find("{"):]
    report = json.loads(text)["jobs"][0]
    side = report["read" if rw == "randread" else "write"]
    return {"bytes": int(side["io_bytes"]), "seconds": side["runtime"] / 1e3}


def fio_round(path: Path, size: int, page_bytes: int, op: str, seconds: float,
              figures: dict[tuple[str, str], list[dict[str, Any]]]) -> None:
    """One round of the :data:`FIO_JOBS` of ``op`` (``"get"``: reads, ``"set"``: writes) on
    ``path`` (see :func:`run_fio`), each job's figures appended to ``figures[(name, op)]``."""
    for job in FIO_JOBS:
        if (job.rw == "randread") == (op == "get"):
            os.sync()  # untimed: the contenders' dirty pages are not fio's
            figures.setdefault((job.name, op), []).append(run_fio(path, size, page_bytes, job, seconds))
