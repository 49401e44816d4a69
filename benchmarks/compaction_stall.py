"""How long a writer's log compaction stalls its caller and a concurrent reader.

    .venv/bin/python benchmarks/compaction_stall.py [--pages 131072] [--compactions 3]
        [--no-reader] [--workdir DIR]

Fills a file-connector store of ``--pages`` 4 KiB pages at capacity and keeps setting
128-page batches of new keys (every set evicts), until ``--compactions`` log compactions
have ended. A second thread meanwhile gets the last batch set, in a loop
(``--no-reader``: none). Prints the set and get latencies (p50, p99, p99.9, max) and the
set rate, with the CPU line. The log compacts once it exceeds 3x its live part, so a
bigger store compacts less often and for longer; before the compaction moved off the
store's lock (hicache_l3/slab/compaction.py) its whole cost was the worst set's, and the
worst get's (docs/benchmarks.md, session 20).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time

from hicache_l3.bench.runner import cpu_info, describe_cpu
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import Geometry

PAGE = 4096
BATCH = 128


def quantiles(values: list[float]) -> str:
    """p50, p99, p99.9 and max of ``values`` (seconds), in ms."""
    v = sorted(values)
    at = [v[min(len(v) - 1, int(len(v) * q))] for q in (0.5, 0.99, 0.999)]
    return " ".join(f"{name} {x * 1e3:.2f}" for name, x in zip(("p50", "p99", "p99.9"), at)) + \
        f" max {v[-1] * 1e3:.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=131072, help="the store's capacity in 4 KiB pages")
    ap.add_argument("--compactions", type=int, default=3, help="stop once this many ended")
    ap.add_argument("--no-reader", action="store_true", help="no concurrent reader thread")
    ap.add_argument("--timeout", type=float, default=600, help="give up after this many seconds")
    ap.add_argument("--workdir", default=None, help="where the store lives (default: a temp dir)")
    args = ap.parse_args()
    print(describe_cpu(cpu_info()))
    work = tempfile.mkdtemp(prefix="hicache-compaction-", dir=args.workdir)
    ns = Namespace(model="bench/compaction", kv_dtype="bfloat16", layout="page_first", page_size=1,
                   tp_rank=0, tp_size=1)
    conn = open_connector("file", ns, root=work, capacity_bytes=args.pages * Geometry(PAGE).stride)
    try:
        wbuf, rbuf = HostBuffer(BATCH * PAGE), HostBuffer(BATCH * PAGE)
        conn.register(wbuf)
        conn.register(rbuf)
        wpages = contiguous_pages(wbuf.address, PAGE, range(BATCH))
        rpages = contiguous_pages(rbuf.address, PAGE, range(BATCH))
        last = [f"first-{j}" for j in range(BATCH)]
        if not all(conn.batch_set(last, wpages)):
            raise SystemExit("the first set failed")
        store = conn._store_for_io()  # type: ignore[attr-defined]
        stop = threading.Event()
        gets: list[float] = []

        def reader() -> None:
            while not stop.is_set():
                keys = last
                t = time.perf_counter()
                conn.batch_get(keys, rpages)
                gets.append(time.perf_counter() - t)
                time.sleep(0.0005)

        thread = None if args.no_reader else threading.Thread(target=reader, daemon=True)
        if thread is not None:
            thread.start()
        sets: list[float] = []
        start = time.monotonic()
        n = 0
        while store.compactions < args.compactions and time.monotonic() - start < args.timeout:
            keys = [f"k{n}-{j}" for j in range(BATCH)]
            n += 1
            t = time.perf_counter()
            ok = conn.batch_set(keys, wpages)
            sets.append(time.perf_counter() - t)
            if not all(ok):
                raise SystemExit(f"set {n} failed: {ok.count(False)} pages")
            last = keys
            if n % 1000 == 0:
                print(f"  {n} batches, {store.compactions} compactions", flush=True)
        elapsed = time.monotonic() - start
        stop.set()
        if thread is not None:
            thread.join()
        print(f"store of {args.pages} pages of 4 KiB, batches of {BATCH}: {n} sets in {elapsed:.1f} s "
              f"({n / elapsed:.0f} a second), {store.compactions} compactions")
        print(f"  set: {quantiles(sets)}")
        if gets:
            print(f"  concurrent get ({len(gets)}): {quantiles(gets)}")
    finally:
        conn.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
