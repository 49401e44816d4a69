"""Where Mooncake ``batch_exists`` time goes: the connector against raw ``batch_is_exist``.

    LD_PRELOAD=<loopback shim> .venv/bin/python benchmarks/mooncake_exists.py \
        [--keys 4096] [--batch 128] [--reps 31] [--key-chars 64]

Starts a local ``mooncake_master`` and segment holder, stores ``--keys`` pages (4 KiB)
through the connector (no segment of its own), then times, interleaved repetition by
repetition (order reversed every other one), batches of ``--batch`` keys:

* ``connector``: ``batch_exists`` (validation, metrics, the hook);
* ``hook``: the connector's ``_exists_prefixed`` alone, of storage keys built before the
  clock (one call, the codes read): what is left once the base class has checked and
  prefixed the keys (one C pass when ``hicache_l3._keys`` is built);
* ``raw``: ``batch_is_exist`` of the same storage keys from a second client, the key lists
  built before the clock.

Prints the CPU line, the load average, keys/s per contender (median), the median of
the per-repetition ratio connector / raw, and the connector's own cost per batch with
the store replaced by a stub that answers at once (steady where the round trip is not).
Keys are ``--key-chars`` hex digits (SGLang's page hashes are 64). Figures:
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from collections.abc import Callable

from hicache_l3.bench.runner import cpu_info, describe_cpu
from hicache_l3.common.keys import NATIVE_KEYS, Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.engines import MooncakeEngine

PAGE = 4096


def main() -> None:
    """Run the comparison and print it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--reps", type=int, default=31)
    parser.add_argument("--key-chars", type=int, default=64)
    args = parser.parse_args()
    from mooncake.store import MooncakeDistributedStore

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    print(describe_cpu(cpu_info()), "load %.2f %.2f %.2f" % os.getloadavg())
    print("key checks:", "C (hicache_l3._keys)" if NATIVE_KEYS else "Python (hicache_l3._keys not built)")
    n, b = args.keys, args.batch
    with contextlib.ExitStack() as stack:
        engine = MooncakeEngine(holder=True, segment_size=f"{(n * PAGE >> 20) * 2 + 64} MB")
        stack.enter_context(engine)
        settings = dict(engine.settings, global_segment_size=0)
        ns = Namespace(model="exists-bench", kv_dtype="uint8", layout="page_first", page_size=PAGE)
        conn = open_connector("mooncake", ns, settings)
        stack.callback(conn.close)
        raw = MooncakeDistributedStore()
        if raw.setup("127.0.0.1", settings["metadata_server"], 0, 16 << 20, "tcp", "",
                     settings["master_address"]) != 0:
            raise SystemExit("raw client setup failed")
        stack.callback(raw.close)
        buf = HostBuffer(n * PAGE)
        conn.register(buf)
        keys = [f"{i:0{args.key_chars}x}" for i in range(n)]
        pages = contiguous_pages(buf.address, PAGE, range(n))
        for lo in range(0, n, b):
            if not all(conn.batch_set(keys[lo : lo + b], pages[lo : lo + b])):
                raise SystemExit("set failed")
        batches = [keys[lo : lo + b] for lo in range(0, n, b)]
        raw_batches = [[ns.storage_key(k) for k in part] for part in batches]
        exists, hook, is_exist = conn.batch_exists, conn._exists_prefixed, raw.batch_is_exist  # type: ignore[attr-defined]

        def timed(call: Callable[[list[str]], object], parts: list[list[str]]) -> float:
            start = time.perf_counter()
            for part in parts:
                call(part)
            return time.perf_counter() - start

        contenders = {"connector": (exists, batches), "hook": (hook, raw_batches),
                      "raw": (is_exist, raw_batches)}
        seconds: dict[str, list[float]] = {name: [] for name in contenders}
        for call, parts in contenders.values():
            timed(call, parts)  # warm-up
        for rep in range(args.reps):
            order = list(contenders) if rep % 2 == 0 else list(reversed(contenders))
            for name in order:
                call, parts = contenders[name]
                seconds[name].append(timed(call, parts))
        for name, values in seconds.items():
            print(f"{name:>9}: {n / statistics.median(values) / 1e6:.3f} M keys/s (median), "
                  f"{statistics.median(values) / len(batches) * 1e6:.0f} us per batch")
        ratios = [r / c for c, r in zip(seconds["connector"], seconds["raw"])]
        print(f"connector / raw: {statistics.median(ratios):.3f} (median of {args.reps}; "
              f"min {min(ratios):.3f}, max {max(ratios):.3f})")
        print(f"connector without the round trip: {overhead(conn, batches):.1f} us per batch "
              "(a stub store answering 'found'; median of 201 passes)")
        print("load %.2f %.2f %.2f" % os.getloadavg())


class _FoundStore:
    """Stands in for the Mooncake client: every key found, no round trip."""

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [1] * len(keys)


def overhead(conn: object, batches: list[list[str]]) -> float:
    """The connector's own cost of one ``batch_exists`` (checks, storage keys, lifecycle,
    metrics, results), in microseconds: the store swapped for :class:`_FoundStore` for
    the measurement, then put back."""
    store = conn._store  # type: ignore[attr-defined]
    conn._store = _FoundStore()  # type: ignore[attr-defined]
    try:
        exists = conn.batch_exists  # type: ignore[attr-defined]
        passes = []
        for _ in range(201):
            start = time.perf_counter()
            for part in batches:
                exists(part)
            passes.append((time.perf_counter() - start) / len(batches))
        return statistics.median(passes) * 1e6
    finally:
        conn._store = store  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
