"""Where a batch's time goes in nixl file mode (issue 17): wall-clock stage timers.

Opens the nixl connector (file mode, a temporary root, capacity one repetition as in
``hicache-l3 bench``), warms up, then times ``--reps`` repetitions of ``--pages`` pages
in batches of ``--batch`` through ``batch_set`` then ``batch_get``, with every stage
wrapped in a timer: the connector's validation (``_transfer`` less the page hook), the
slab store (reserve, commit, lookup or get plan, touch), the transport (offsets, marker
records, the C marker calls and helpers, the planned read), ``run_flat`` and the NIXL
calls (descriptor lists, transfer setup, post, polls, release). Times are inclusive (a
stage's time holds its sub-stages), in microseconds per batch; the timers themselves
cost ~0.3 us per call.

    PYTHONPATH=$PWD python benchmarks/nixl_stages.py --page-size 65536
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time

from stage_timers import spent, timed  # (benchmarks/: the script's own directory)

import hicache_l3.connectors.nixl.base as nixl_base
import hicache_l3.connectors.nixl.file as nixl_file
import hicache_l3.slab.format as slab_format
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.registry import open_connector
from hicache_l3.connectors.nixl import batch_lib
from hicache_l3.slab import native
from hicache_l3.slab.store import SlabStore


def main() -> None:
    """Run the breakdown and print one table per op."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--page-size", type=int, default=64 << 10)
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    pb, n, b = args.page_size, args.pages, args.batch
    root = tempfile.mkdtemp(prefix="nixl-stages-")
    ns = Namespace(model="nixl-stages", kv_dtype="uint8", layout="page_first", page_size=pb, tag="s")
    conn = open_connector("nixl", ns, {"mode": "file", "root": f"{root}/store",
                                       "capacity_bytes": n * slab_format.Geometry(pb).stride})
    try:
        buf = HostBuffer(n * pb)
        conn.register(buf)
        pages = [((buf.address + i * pb, pb),) for i in range(n)]

        def rep(op: str, gen: int) -> float:
            call = conn.batch_set if op == "set" else conn.batch_get
            start = time.perf_counter()
            for lo in range(0, n, b):
                if not all(call([f"k{i}-{gen}" for i in range(lo, min(n, lo + b))], pages[lo:lo + b])):
                    raise SystemExit(f"{op} failed")
            return time.perf_counter() - start

        rep("set", 0)
        rep("get", 0)
        nx = conn.agent.agent
        for name in ("get_xfer_descs", "initialize_xfer", "transfer", "check_xfer_state",
                     "release_xfer_handle"):
            timed(nx, name, f"nixl.{name}")
        timed(conn, "_transfer", "connector._transfer (validation + hook)")
        for hook in ("_get", "_set"):
            timed(conn, hook, f"engine.{hook}")
        for name in ("lookup", "plan_get", "reserve_new", "commit", "touch"):
            timed(SlabStore, name, f"store.{name}")
        for name in ("read", "read_plan", "write", "_check_markers", "_put_markers", "_move_flat"):
            timed(nixl_file.NixlTransport, name, f"transport.{name}")
        for name in ("rows", "read_markers", "check_sums", "write_markers"):
            timed(batch_lib.NixlBatchLib, name, f"C helpers.{name}")
        for name in ("read_markers", "write_markers"):
            timed(native.BatchIO, name, f"C {name}")
        timed(nixl_base.Agent, "transfer", "Agent.transfer (NIXL setup, post, polls)")
        timed(slab_format.Geometry, "offsets", "Geometry.offsets")
        for name in ("encode_markers", "expected_markers"):
            timed(slab_format, name, name)
            setattr(nixl_file, name, getattr(slab_format, name))
        timed(nixl_base, "run_flat", "run_flat")
        timed(nixl_base, "coalesce", "coalesce")
        nixl_file.run_flat = nixl_base.run_flat
        spent.clear()
        total = {"set": sum(rep("set", g) for g in range(1, args.reps + 1))}
        sets = dict(spent)
        spent.clear()
        total["get"] = sum(rep("get", args.reps) for _ in range(args.reps))
        batches = args.reps * -(-n // b)
        for op, stages in (("set", sets), ("get", dict(spent))):
            print(f"== {op}: {total[op] / batches * 1e6:.0f} us per batch of {b} x {pb} B")
            for label, seconds in sorted(stages.items(), key=lambda kv: -kv[1]):
                print(f"   {label:44s} {seconds / batches * 1e6:8.1f}")
    finally:
        conn.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
