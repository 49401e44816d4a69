"""What a checkpoint's snapshot holds the index lock for, at a given table size.

    .venv/bin/python benchmarks/index_snapshot.py [--pages 1000000] [--delta 0.03125] [--reps 3]

Builds a C page table image of ``--pages`` pages, attaches a table to it, puts a delta of
``--delta`` x pages new pages, then per repetition times ``snapshot()`` (``hl3_pt_fork``:
what is taken under the lock now), ``hl3_pt_flatten`` of the live table (what was taken
under it before) and the fork's own flatten (now off the lock); then a journal catch-up
rate. Prints the CPU line and the load average (docs/benchmarks.md, "No stall for a
checkpoint, and cold reads at depth"). Needs numpy and about 300 B of memory per page.
"""

from __future__ import annotations

import argparse
import array
import os
import statistics
import time

import numpy as np

from hicache_l3.bench.runner import cpu_info, describe_cpu
from hicache_l3.slab.table import NativePageTable, TableImage, native_library


def entries(n: int, slab0: int) -> np.ndarray:
    """``n`` page-table values (writer, slab, slot, gen, length, checksum) in fresh slots."""
    vals = np.zeros((n, 6), dtype=np.uint64)
    vals[:, 1] = slab0 + np.arange(n) // 65536
    vals[:, 2] = np.arange(n) % 65536
    vals[:, 3], vals[:, 4], vals[:, 5] = 1, 4096, np.arange(n)
    return vals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--delta", type=float, default=1 / 32, help="delta pages, as a fraction of --pages")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    lib = native_library()
    if lib is None:
        raise SystemExit("the C page table is not built (hicache_l3._batch_io)")
    rng = np.random.default_rng(1)
    n, m = args.pages, int(args.pages * args.delta)
    image = TableImage.from_snapshot(lib, rng.bytes(16 * n), array.array("Q", entries(n, 0).tobytes()), n)
    fd = os.memfd_create("image")
    image.write(fd, 0)
    nbytes = image.nbytes
    del image
    table = NativePageTable(lib)
    table.expect(n)
    table.attach(fd, 0, nbytes)
    os.close(fd)
    ds = rng.bytes(16 * m)
    table.put_many([ds[16 * i : 16 * i + 16] for i in range(m)],
                   [tuple(int(v) for v in row) for row in entries(m, 10_000)])
    print(describe_cpu(cpu_info()), "load", os.getloadavg())
    print(f"{len(table):,} pages, a delta of {table.delta_len:,}")
    fork_ms, flat_ms, off_ms = [], [], []
    for _ in range(args.reps):
        started = time.perf_counter()
        snap = table.snapshot()
        fork_ms.append(1e3 * (time.perf_counter() - started))
        started = time.perf_counter()
        lib.free(lib.build_flatten(table._t, 0, b"", None))
        flat_ms.append(1e3 * (time.perf_counter() - started))
        started = time.perf_counter()
        snap.prepare()  # (the fork's flatten)
        off_ms.append(1e3 * (time.perf_counter() - started))
        del snap
    print(f"under the lock now, hl3_pt_fork: median {statistics.median(fork_ms):.1f} ms")
    print(f"under the lock before, hl3_pt_flatten: median {statistics.median(flat_ms):.0f} ms")
    print(f"off the lock now, the fork's flatten: median {statistics.median(off_ms):.0f} ms")
    copy = table.snapshot().table  # a standalone copy, then journal records replayed onto it
    table.journal_start()
    k = min(250_000, n // 4)
    jd = rng.bytes(16 * k)
    digests = [jd[16 * i : 16 * i + 16] for i in range(k)]
    values = [tuple(int(v) for v in row) for row in entries(k, 20_000)]
    for lo in range(0, k, 128):
        table.put_many(digests[lo : lo + 128], values[lo : lo + 128])
    started = time.perf_counter()
    copy.catch_up(table)
    elapsed = time.perf_counter() - started
    print(f"journal catch-up: {k:,} puts in {1e3 * elapsed:.0f} ms ({1e9 * elapsed / k:.0f} ns a record)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
