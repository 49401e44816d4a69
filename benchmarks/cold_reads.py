"""Cold random gets from a file-connector store against ``cold_read_threads``.

    .venv/bin/python benchmarks/cold_reads.py [--pages 1000000] [--threads 0,16]
        [--keys 4096] [--rounds 2] [--workdir DIR]

Fills a store of ``--pages`` 4 KiB pages once (kept between runs in ``--workdir``; remove
it after), then per round and per ``cold_read_threads`` value: drops the page cache
(``echo 3 > /proc/sys/vm/drop_caches``: run as root), opens a connector with that
setting and times a get of ``--keys`` random keys in batches of 128 (cold), then the same
keys again (warm). Prints the CPU line and the load average. What a store bigger than
memory sees: most pages of a random batch come from the disk (docs/benchmarks.md, "No
stall for a checkpoint, and cold reads at depth").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from pathlib import Path

from hicache_l3.bench.runner import cpu_info, describe_cpu
from hicache_l3.bench.scale import BATCH, FILL_BATCH, key, scale_namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import Geometry

PAGE = 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1_000_000)
    ap.add_argument("--threads", default="0,16", help="cold_read_threads values, alternated")
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/hicache-cold-reads")
    args = ap.parse_args()
    root = Path(args.workdir)
    settings = {"root": str(root), "capacity_bytes": (args.pages + 20_000) * Geometry(PAGE).stride}
    buf = HostBuffer(FILL_BATCH * PAGE)
    buf.view()[:] = os.urandom(buf.size)
    if not (root / "filled").exists():
        with contextlib.closing(open_connector("file", scale_namespace(PAGE), settings)) as conn:
            conn.register(buf)
            for lo in range(0, args.pages, FILL_BATCH):
                n = min(FILL_BATCH, args.pages - lo)
                ok = conn.batch_set([key(i) for i in range(lo, lo + n)],
                                    contiguous_pages(buf.address, PAGE, range(n)))
                if not all(ok):
                    raise SystemExit(f"fill: {ok.count(False)} pages not stored")
        os.sync()
        (root / "filled").touch()
    print(describe_cpu(cpu_info()), "load", os.getloadavg(), flush=True)
    rng = random.Random(1)
    for _ in range(args.rounds):
        for threads in (int(v) for v in args.threads.split(",")):
            keys = [key(rng.randrange(args.pages)) for _ in range(args.keys)]
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            with contextlib.closing(open_connector("file", scale_namespace(PAGE),
                                                   {**settings, "cold_read_threads": threads})) as conn:
                conn.register(buf)
                pages = contiguous_pages(buf.address, PAGE, range(BATCH))
                conn.batch_exists(keys[:1])  # (the index opened before the clock)
                rates = []
                for _pass in ("cold", "warm"):
                    started = time.perf_counter()
                    for lo in range(0, len(keys), BATCH):
                        if not all(conn.batch_get(keys[lo : lo + BATCH], pages)):
                            raise SystemExit("a stored page was not read back")
                    rates.append(len(keys) / (time.perf_counter() - started))
                cold = conn.stats()["ops"]["counters"].get("cold_pages", 0)
            print(f"cold_read_threads {threads:3d}: cold {rates[0] / 1e3:.1f} k pages/s, "
                  f"warm {rates[1] / 1e3:.0f} k pages/s ({cold} pages through the cold pool)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
