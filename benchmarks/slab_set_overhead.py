"""Where a set batch's bookkeeping time goes in the slab store (issue 17): per-stage
wall-clock timers around :meth:`SlabStore.reserve_new` and :meth:`SlabStore.commit`.

Opens a :class:`~hicache_l3.slab.store.SlabStore` in a temporary directory with a
capacity of ``--capacity`` slots of ``--slot-bytes`` (sparse slab files: the data is
never written, only the store's metadata is timed), fills it, then runs ``--batches``
set batches of ``--batch`` new keys each as the slab engine does (reserve_new, then
commit with zero checksums and the plan's digests): at capacity every reserve evicts.
Each stage's time is measured per batch; the table shows the median over batches (and
the mean) in microseconds. Stages are inclusive (``reserve_new`` holds ``reserve``, which
holds ``_evict``...); each timer costs ~0.3 us a call. ``--plain`` runs without stage
timers (the totals alone, as the engine pays them).

    PYTHONPATH=$PWD python benchmarks/slab_set_overhead.py
    PYTHONPATH=$PWD python benchmarks/slab_set_overhead.py --plain --batches 3000
    PYTHONPATH=$PWD python benchmarks/slab_set_overhead.py --write-between 8   # cold, as on SGLang's path
"""

from __future__ import annotations

import argparse
import array
import collections
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

from stage_timers import spent, timed  # (benchmarks/: the script's own directory)

import hicache_l3.slab.index as slab_index
import hicache_l3.slab.store as slab_store
from hicache_l3.bench.runner import cpu_info, describe_cpu
from hicache_l3.common.keys import Namespace
from hicache_l3.slab.clock import Clock
from hicache_l3.slab.format import Geometry
from hicache_l3.slab.index import SlabIndex
from hicache_l3.slab.store import SlabStore


def instrument() -> None:
    """Wrap the stages of reserve_new and commit (whichever of them exist in this tree)."""
    for owner, names in (
        (SlabStore, ("reserve_new", "commit", "refresh", "reserve", "_take_slots", "_evict", "_preallocate",
                     "_maybe_compact", "_writer_ready", "compact")),
        (SlabIndex, ("refresh", "remove_unlogged_runs", "apply_put_values", "_settle_evicted",
                     "checkpoint_due", "save_checkpoint_later", "_adopt_base", "rebase_on_newer",
                     "rebase_later")),
        (Clock, ("evict_runs", "add_slots")),
    ):
        for name in names:
            if hasattr(owner, name):
                timed(owner, name, f"{owner.__name__}.{name}")
    for module, names in ((slab_store, ("digests", "key_digests", "encode_put_values")),
                          (slab_index, ("take_run",))):
        for name in names:
            if hasattr(module, name):
                timed(module, name, f"{module.__name__.rsplit('.', 1)[1]}.{name}")
    timed(os, "write", "os.write")


def run(store: SlabStore, batches: int, b: int, start: int, per_batch: Callable[[float], None],
        between: Callable[[], None] | None = None) -> int:
    """``batches`` set batches of ``b`` new keys from key number ``start``, each followed
    by ``per_batch(seconds of its reserve_new + commit)`` and preceded by ``between()``
    (off the clock); the next key number."""
    zeros = array.array("Q", bytes(8 * b))
    clock = time.perf_counter
    for _ in range(batches):
        if between is not None:
            between()
        keys = [f"{i:032x}" for i in range(start, start + b)]
        start += b
        t0 = clock()
        todo, slots, full, ds = store.reserve_new(keys)
        if full or len(todo) != b:
            raise SystemExit(f"reserve_new: {len(todo)} of {b} reserved, {len(full)} full")
        store.commit(keys, slots, zeros, ds)
        per_batch(clock() - t0)
    return start


def main() -> None:
    """Fill the store, then time the batches and print the per-stage medians."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slot-bytes", type=int, default=64 << 10)
    ap.add_argument("--capacity", type=int, default=4096, help="slots (pages) the store holds")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--plain", action="store_true", help="no stage timers: totals only")
    ap.add_argument("--write-between", type=int, default=0, metavar="MIB",
                    help="before each batch, off the clock, pwrite this many MiB into a scratch file "
                         "(what a set's data write does to the caches: the store's bookkeeping then "
                         "runs cold, as on SGLang's path; 0: hot, batches back to back)")
    args = ap.parse_args()
    print(describe_cpu(cpu_info()), "load %.2f %.2f %.2f" % os.getloadavg())
    root = tempfile.mkdtemp(prefix="slab-set-overhead-")
    ns = Namespace(model="slab-set-overhead", kv_dtype="uint8", layout="page_first",
                   page_size=args.slot_bytes, tag="s")
    stride = Geometry(args.slot_bytes).stride
    store = SlabStore(root, ns, args.slot_bytes, capacity_bytes=args.capacity * stride)
    between = None
    if args.write_between > 0:
        scratch = os.open(os.path.join(root, "scratch"), os.O_RDWR | os.O_CREAT, 0o600)
        data = os.urandom(1 << 20) * args.write_between

        def between() -> None:
            os.pwrite(scratch, data, 0)
    try:
        b = args.batch
        # fill to capacity, and a few passes more so that compaction and checkpoints
        # reach their steady state
        nxt = run(store, 3 * -(-args.capacity // b), b, 0, lambda _: None)
        if not args.plain:
            instrument()
        per: dict[str, list[float]] = collections.defaultdict(list)
        total: list[float] = []

        def per_batch(seconds: float) -> None:
            total.append(seconds)
            for label, stage in spent.items():
                per[label].append(stage)
            spent.clear()

        run(store, args.batches, b, nxt, per_batch, between)
        stats = store.stats()
        print(f"== {args.batches} batches of {b} keys, {args.capacity} slots of {args.slot_bytes} B, "
              f"{args.write_between} MiB written between batches "
              f"(evictions {stats['evictions']}, compactions {stats['log_compactions']}); "
              f"load {'%.2f %.2f %.2f' % os.getloadavg()}")
        print(f"   {'stage (us per batch)':44s} {'median':>8s} {'mean':>8s}")
        print(f"   {'reserve_new + commit':44s} {statistics.median(total) * 1e6:8.1f} "
              f"{statistics.fmean(total) * 1e6:8.1f}")
        for label, xs in sorted(per.items(), key=lambda kv: -statistics.fmean(kv[1])):
            xs += [0.0] * (args.batches - len(xs))  # batches where the stage did not run
            print(f"   {label:44s} {statistics.median(xs) * 1e6:8.1f} {statistics.fmean(xs) * 1e6:8.1f}")
    finally:
        store.close()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
