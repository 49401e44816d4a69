"""The Python of the file connector's steady-state set path, without the I/O (issue 17).

Opens the file connector on a temporary root with capacity for ``--pages`` pages (so
that, after the warm-up, every set evicts and reuses slots, as a long-running server's
do), then sets ``--rounds`` rounds of ``--pages`` fresh keys in batches of ``--batch``
through ``batch_set``. With ``--no-io`` the C batch write is replaced by a call that
moves nothing and reports every page written, so what is timed is the Python (and the
small C calls) around it: the slot reservation (``reserve_new``: digests, eviction),
the transport's ``write`` (marker records, the batch arrays, the thread pool's
dispatch) and the index commit. Reported: the minimum over rounds of each stage, in ms
per ``--pages`` pages (inclusive: ``set`` holds the others), which is steadier than a
mean on a shared machine. Run it against two checkouts one after the other to compare
them:

    PYTHONPATH=$PWD python benchmarks/set_python.py --no-io
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from typing import Any

from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import strided_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import Geometry

NS = Namespace(model="bench", kv_dtype="bfloat16", layout="page_first", page_size=16)


def main() -> None:
    """Parse the arguments, run the rounds, print the stage minima."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=64 << 10)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--no-io", action="store_true", help="time the Python only (no bytes moved)")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="hicache-l3-setpy-")
    try:
        capacity = args.pages * Geometry(args.page_size).stride
        with open_connector("file", NS, root=root, capacity_bytes=capacity) as conn:
            buf = HostBuffer(args.pages * args.page_size)
            conn.register(buf)
            half = args.page_size // 2  # two segments per page, as SGLang's K and V halves
            pages = strided_pages(buf.address, half, 2, args.page_size, range(args.pages))
            counter = [0]

            def one_round() -> None:
                counter[0] += 1
                keys = [f"{counter[0]:08x}{i:056x}" for i in range(args.pages)]
                for lo in range(0, args.pages, args.batch):
                    if not all(conn.batch_set(keys[lo : lo + args.batch], pages[lo : lo + args.batch])):
                        raise RuntimeError("a set failed")

            for _ in range(3):  # warm-up: fills the store, so every later set evicts
                one_round()
            store = conn._store_for_io()
            spent: dict[str, int] = {}
            wrap(store, "reserve_new", "reserve", spent)
            wrap(conn.transport, "write", "write", spent)
            wrap(store, "commit", "commit", spent)
            wrap(conn, "_set", "set", spent)
            if args.no_io:
                conn.transport.lib.write = lambda pb, lo, hi, checksum: 0  # status stays OK
            best: dict[str, int] = {}
            for _ in range(args.rounds):
                spent.clear()
                one_round()
                for stage, ns in spent.items():
                    best[stage] = min(best.get(stage, ns), ns)
            scale = 1e6
            print(f"{args.pages} x {args.page_size} B pages, batches of {args.batch}, "
                  f"{'no I/O' if args.no_io else 'with I/O'}, min of {args.rounds} rounds, "
                  f"evictions {store.evictions}:")
            for stage in ("reserve", "write", "commit", "set"):
                print(f"  {stage:8s} {best.get(stage, 0) / scale:7.3f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def wrap(obj: Any, name: str, stage: str, spent: dict[str, int]) -> None:
    """Add the wall time of every ``obj.name`` call to ``spent[stage]``."""
    inner = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[stage] = spent.get(stage, 0) + time.perf_counter_ns() - t0

    setattr(obj, name, timed)


if __name__ == "__main__":
    main()
