"""64 KiB gets right after a set and after idle time, from a file-connector store at capacity.

    .venv/bin/python benchmarks/idle_gets.py [--reps 12] [--idle-ms 500] [--fresh]
        [--workdir DIR]

A store of exactly ``--pages`` (1024) slots of 64 KiB pages, each page two 32 KiB segments
(K and V, as SGLang's ``page_first`` host pool lays them out), filled once, so every set
evicts and reuses slots (a store at capacity: a batch's slots lie in two slab files). Each
repetition sets ``--pages`` new pages in batches of 128, then gets them in batches of 128,
either at once ("back to back") or after ``--idle-ms`` of sleep ("after idle": the
resident readers have gone to sleep and the scheduler picks their CPU when the get wakes
them), the two kinds alternating. Reported: the median ms per 1024 pages of each, their
ratio, and ``reader_moves`` (how often a reader found itself on the caller's CPU and moved
off it: batch_io.c ``readers_step_aside``). ``--fresh``: an unbounded store instead.
Prints the CPU line.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import time

from hicache_l3.bench.runner import cpu_info, describe_cpu
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page, strided_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import Geometry

PAGE, BATCH = 64 << 10, 128


def main() -> int:
    """Run the repetitions; print the medians and the ratio."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1024, help="pages per repetition (and the store's slots)")
    ap.add_argument("--reps", type=int, default=12, help="repetitions of each kind")
    ap.add_argument("--idle-ms", type=float, default=500.0, help="sleep before an 'after idle' get")
    ap.add_argument("--fresh", action="store_true", help="an unbounded store (no eviction) instead")
    ap.add_argument("--workdir", default=None, help="where the store lives (default: a temporary directory)")
    args = ap.parse_args()
    if args.pages < BATCH or args.pages % BATCH:
        ap.error(f"--pages must be a multiple of {BATCH}")
    ns = Namespace(model="idle-gets", kv_dtype="bfloat16", layout="page_first", page_size=64)
    work = tempfile.mkdtemp(prefix="hicache-idle-gets-", dir=args.workdir)
    settings = {} if args.fresh else {"capacity_bytes": args.pages * Geometry(PAGE).stride}
    half = PAGE // 2
    times: dict[str, list[float]] = {"back to back": [], "after idle": []}
    try:
        with open_connector("file", ns, root=work, **settings) as conn:
            buf = HostBuffer(args.pages * PAGE)
            conn.register(buf)

            def pages(lo: int, hi: int) -> list[Page]:  # K at the buffer's first half, V at its second
                return strided_pages(buf.address, half, 2, args.pages * half, range(lo, hi))

            for rep in range(-1, 2 * args.reps):  # -1: the fill, untimed
                keys = [f"{rep + 1:04d}{i:060x}" for i in range(args.pages)]
                ctypes.memset(buf.address, (rep + 1) % 251 + 1, args.pages * PAGE)
                os.sync()  # the last repetition's dirty pages written back off the clock
                for lo in range(0, args.pages, BATCH):
                    if not all(conn.batch_set(keys[lo:lo + BATCH], pages(lo, lo + BATCH))):
                        raise RuntimeError(f"a set of batch {lo // BATCH} failed")
                if rep < 0:
                    continue
                kind = "after idle" if rep % 2 else "back to back"
                ctypes.memset(buf.address, 0, args.pages * PAGE)
                if kind == "after idle":
                    time.sleep(args.idle_ms / 1e3)
                t0 = time.perf_counter()
                for lo in range(0, args.pages, BATCH):
                    if not all(conn.batch_get(keys[lo:lo + BATCH], pages(lo, lo + BATCH))):
                        raise RuntimeError(f"a get of batch {lo // BATCH} missed")
                times[kind].append((time.perf_counter() - t0) * 1024 / args.pages)
                if ctypes.string_at(buf.address + args.pages * PAGE - 1, 1)[0] != (rep + 1) % 251 + 1:
                    raise RuntimeError("the bytes read back differ from the bytes written")
            moves = conn.stats()["engine"].get("reader_moves", 0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(describe_cpu(cpu_info()))
    store = "an unbounded store" if args.fresh else f"a store at capacity ({args.pages} slots)"
    print(f"gets of {args.pages} x 64 KiB pages in batches of {BATCH}, from {store}; "
          f"{args.reps} repetitions of each kind, alternating; idle {args.idle_ms:g} ms")
    med = {kind: statistics.median(t) * 1e3 for kind, t in times.items()}
    for kind, t in times.items():
        print(f"  {kind:<13} median {med[kind]:6.2f} ms per 1024 pages "
              f"(range {min(t) * 1e3:.2f}-{max(t) * 1e3:.2f})")
    print(f"  after idle / back to back: {med['after idle'] / med['back to back']:.2f}; reader_moves {moves}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
