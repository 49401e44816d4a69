"""SGLang's controller path one batch at a time, ours and raw interleaved per batch (issue 17).

``sglang_controller.py`` times 1024 pages of one contender, then the next: our batches run
back to back, each after our own previous one. Here every 128-page batch of ours is
followed by raw's batches of the same pages (``preadv``/``pwritev`` of the same pointers,
one thread, and two threads on the two halves of the batch), in a rotating order, so each
of ours runs after megabytes of someone else's memory traffic: its bookkeeping finds cold
caches, as on a server where other threads run between the controller's batches. Reported:
medians of microseconds per batch and the ratios raw/ours (> 1: ours faster); with
``--stages``, the median time of each of our stages (inclusive, per call; the timers cost
~0.3 us each). Run with the SGLang venv::

    PYTHONPATH=$PWD .venv-sglang/bin/python benchmarks/controller_interleaved.py get [--batches 600]
    PYTHONPATH=$PWD .venv-sglang/bin/python benchmarks/controller_interleaved.py set --stages
    PYTHONPATH=$PWD .venv-sglang/bin/python benchmarks/controller_interleaved.py set --set checksum=none

``get``: our connector in a fresh (unbounded) store holding the 1024 pages, every batch a
hit. ``set``: our connector at capacity (exactly 1024 slots, filled twice first), every
batch of fresh keys evicting; raw overwrites its preallocated, fully written file. A
``sync()`` every 50 batches keeps the dirty pages from piling up.
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
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

warnings.filterwarnings("ignore")

import sglang_controller as sc  # noqa: E402  (benchmarks/: the script's own directory)
import stage_timers  # noqa: E402
import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402

from hicache_l3.bench.runner import cpu_info, describe_cpu  # noqa: E402
from hicache_l3.common.config import parse_sets  # noqa: E402
from hicache_l3.sglang.config import extra_config_for  # noqa: E402
from hicache_l3.slab.format import Geometry  # noqa: E402

PAGES, BATCH = 1024, 128


def main() -> int:
    """Run the interleaved batches; print the medians and ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("op", choices=("get", "set"))
    ap.add_argument("--batches", type=int, default=400, help="batches of ours timed (each with raw's)")
    ap.add_argument("--stages", action="store_true", help="time our stages too (median us per call)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a file connector setting for ours (repeatable), e.g. --set checksum=none")
    args = ap.parse_args()
    print(describe_cpu(cpu_info()), file=sys.stderr)
    work = tempfile.mkdtemp(prefix="hicache-l3-interleaved-")
    host = sc.host_pool(PAGES)
    page_bytes = host.get_size_per_token() * sc.PAGE_TOKENS
    indices = torch.arange(sc.PAGE_TOKENS, (PAGES + 1) * sc.PAGE_TOKENS, dtype=torch.int64)
    settings: dict[str, Any] = {"root": os.path.join(work, "ours"), **parse_sets(args.set)}
    if args.op == "set":
        settings["capacity_bytes"] = PAGES * Geometry(page_bytes).stride
    backend = sc.StorageBackendFactory.create_backend(
        "dynamic", sc.storage_config(extra_config_for("file", settings)), host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    standin = sc.StandIn(host, backend)
    raw = sc.RawPosix(work, host, indices, PAGES, page_bytes, 2, per_batch=True)
    try:
        keys = sc.fresh_keys("stored", PAGES)
        for rep in range(2 if args.op == "set" else 1):  # stored (get); at capacity, twice over (set)
            for ks, idx in sc.batches(sc.fresh_keys(f"fill{rep}", PAGES) if rep else keys, indices):
                if not HiCacheController._page_set_zero_copy(standin, ks, idx):
                    raise RuntimeError("a fill batch failed")
        os.sync()
        if args.stages:
            connector = backend.connector
            store = connector._store_for_io()
            wraps = [(backend, f"batch_{args.op}_v1", "adapter"), (connector, f"_{args.op}", "page hook"),
                     (store, "refresh", "refresh"), (store, "plan_get", "plan"),
                     (connector.transport, "read_plan", "read"), (store, "touch_columns", "touch"),
                     (store, "reserve_new", "reserve"), (connector.transport, "write", "write"),
                     (store, "commit", "commit")]
            for owner, name, label in wraps:
                stage_timers.timed(owner, name, label)
        batches = sc.batches(keys, indices)
        fn, op = (_libc_fn("preadv"), sc.Operation()) if args.op == "get" else (_libc_fn("pwritev"), None)
        times: dict[str, list[int]] = defaultdict(list)

        def ours(k: int, i: int) -> None:
            if args.op == "get":
                ks, idx = batches[k]
                if HiCacheController._page_get_zero_copy(standin, op, ks, idx) != len(ks):
                    raise RuntimeError("a get missed pages")
            elif not HiCacheController._page_set_zero_copy(standin, sc.fresh_keys(f"s{i}", BATCH),
                                                           batches[k][1]):
                raise RuntimeError("a set batch failed")

        def raw_1t(k: int, i: int) -> None:
            arr, count, offset, nbytes = raw.calls[k]
            if fn(raw.fd, ctypes.addressof(arr), count, offset) != nbytes:
                raise RuntimeError("raw: short transfer")

        def raw_2t(k: int, i: int) -> None:
            first, second = raw.parts[k]
            assert raw.pool is not None
            raw._keep_helpers_off()
            other = raw.pool.submit(raw._share, fn, raw.fd, [second])
            raw._share(fn, raw.fd, [first])
            other.result()

        contenders: list[tuple[str, Callable[[int, int], None]]] = [
            ("ours", ours), ("raw-1t", raw_1t), ("raw-2t-halves", raw_2t)]
        for i in range(args.batches):
            k = i % len(batches)
            for j in range(len(contenders)):
                name, run = contenders[(i + j) % len(contenders)]
                t0 = time.perf_counter_ns()
                run(k, i)
                times[name].append(time.perf_counter_ns() - t0)
            if i % 50 == 49:
                os.sync()
    finally:
        raw.close()
        backend.close()
        shutil.rmtree(work, ignore_errors=True)
    med = {name: statistics.median(v) / 1e3 for name, v in times.items()}
    print(f"{args.op}, {args.batches} batches of {BATCH} x {page_bytes >> 10} KiB, interleaved "
          f"(us a batch, medians): " + ", ".join(f"{n} {m:.0f}" for n, m in med.items()))
    print(f"  ratio raw-1t/ours {med['raw-1t'] / med['ours']:.3f}, "
          f"raw-2t-halves/ours {med['raw-2t-halves'] / med['ours']:.3f}")
    for label, ns in stage_timers.calls.items():
        print(f"  stage {label:<10} {statistics.median(ns) / 1e3:7.0f} us (median of {len(ns)} calls)")
    return 0


def _libc_fn(name: str) -> Any:
    return getattr(sc._LIBC, name)


if __name__ == "__main__":
    sys.exit(main())
