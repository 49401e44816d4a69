"""hicache-l3 bench: measure connectors against their raw engines, side by side.

For every backend (--backend file,mooncake,...) and every combination of --page-size,
--batch and --threads, the bench writes, reads and queries --pages pages, --reps times,
the connector and its raw engine baseline (raw-posix, raw-mooncake, raw-nixl)
interleaved within each repetition on the same pre-touched pages, after one untimed
warm-up. Reads are verified byte for byte after timing. Engines a backend needs are
started locally when no address is configured, and stopped at the end.

Examples:
  hicache-l3 bench                                   # file connector in a temp dir
  hicache-l3 bench --page-size 64KiB,1MiB --batch 32,128 --json out.json --plot out.png
  hicache-l3 bench --backend file --set file.root=/mnt/nvme/kv --set file.o_direct=true
  hicache-l3 bench --scale --scale-sizes 1e4,1e5 --json scale.json --plot scale.png
  hicache-l3 bench --beyond-memory --beyond-store 8GiB --beyond-cache 2GiB --page-size 64KiB,1MiB
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from hicache_l3.bench.runner import (
    BenchError,
    format_columns,
    load_backend,
    parse_settings,
    print_results,
    progress,
    run_pairs,
    size_arg,
)
from hicache_l3.bench.targets import DEFAULT_OPS, OPS, BenchOptions
from hicache_l3.common.errors import HiCacheL3Error
from hicache_l3.common.logs import quiet_credential_loggers


def _items(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _sizes(text: str) -> list[int]:
    return [size_arg(v) for v in _items(text)]


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in _items(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench's command-line options."""
    parser.add_argument("--backend", default="file",
                        help="comma-separated connectors to measure (default: file)")
    parser.add_argument("--page-size", type=_sizes, default=[64 << 10], metavar="SIZES",
                        help="page size(s), e.g. 64KiB or 16KiB,64KiB,1MiB (default 64KiB)")
    parser.add_argument("--pages", type=int, default=4096,
                        help="pages moved per op and repetition (default 4096)")
    parser.add_argument("--batch", type=_ints, default=[128], metavar="N[,N]",
                        help="pages per batch call (default 128, SGLang's prefetch batch)")
    parser.add_argument("--threads", type=_ints, default=[1], metavar="N[,N]",
                        help="client threads issuing batches to a connector (default 1; "
                             "raw baselines always use one)")
    parser.add_argument("--reps", type=int, default=6,
                        help="timed repetitions (default 6); the connector goes first in every other "
                             "one, the ratio takes them in pairs")
    parser.add_argument("--ops", default=",".join(DEFAULT_OPS),
                        help="ops to run, from set,get,exists,mixed (default set,get,exists); "
                             "mixed = batches of gets and sets, --read-fraction of them gets")
    parser.add_argument("--read-fraction", type=float, default=0.8,
                        help="share of get batches in the mixed op (default 0.8)")
    parser.add_argument("--idle-ms", type=float, default=0.0, metavar="MS",
                        help="sleep MS ms before every timed op, off the clock: what a server's "
                             "first get after a pause meets (default 0: back to back)")
    parser.add_argument("--cache", choices=["warm", "cold", "both"], default="warm",
                        help="warm: reads may hit the page cache; cold: the store files' page cache "
                             "is dropped before every timed read; both: run each")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="BACKEND.KEY=VALUE", help="a connector setting, e.g. file.root=/mnt/kv")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where file-based stores live (default: a temp dir, removed after)")
    parser.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    parser.add_argument("--csv", type=Path, default=None, help="write results as CSV here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG of throughput vs page size and batch (needs matplotlib)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--scale", action="store_true",
                        help="instead: sweep file-connector store sizes (index memory, open time, "
                             "exists/get/set rates, eviction)")
    parser.add_argument("--scale-sizes", default="1e4,1e5,1e6,1e7", metavar="N[,N]",
                        help="--scale: pages per store (default 1e4,1e5,1e6,1e7)")
    parser.add_argument("--scale-page-bytes", type=_sizes, default=[256], metavar="SIZE",
                        help="--scale: page size (default 256 bytes, so that 10^7 pages fit the "
                             "page cache; 64KiB pages need 10^7 x that of disk)")
    parser.add_argument("--scale-index-only", action="store_true",
                        help="--scale: stores written as index logs over sparse slabs: open time, "
                             "index memory and exists at sizes the disk cannot hold; no get/set")
    parser.add_argument("--kv", choices=["random", "real"], default="random",
                        help="--compression and --beyond-memory: page bytes: random, or the KV of "
                             "SmolLM2-135M run on CPU (cached under ~/.cache/hicache-l3; pip install "
                             "'hicache-l3[kv]'); --beyond-memory keeps each page's index in its first "
                             "8 bytes")
    parser.add_argument("--compression", action="store_true",
                        help="each backend of --compression-backends with compression=zstd against "
                             "itself with none, interleaved: stored ratio and effective GB/s")
    parser.add_argument("--compression-backends", default="memory,nixl-obj", metavar="B[,B]",
                        help="--compression: memory, nixl-obj, mooncake, file-fsspec, s3-fsspec "
                             "(the file connector on an s3:// root on the local S3 server; needs "
                             "s3fs), file")
    parser.add_argument("--compression-link-rate", type=_sizes, default=[0], metavar="RATE",
                        help="--compression: reach the S3 server (nixl-obj, s3-fsspec) through a "
                             "loopback proxy passing RATE bytes/s each way, as a link to a remote "
                             "store does (e.g. 100MB; default: no limit; other backends refuse it)")
    parser.add_argument("--beyond-memory", action="store_true",
                        help="instead: file and hf3fs stores several times the page cache allowed (a "
                             "memory cgroup), random gets and evicting sets from the device against raw "
                             "O_DIRECT and fio, with the break-even against recompute")
    parser.add_argument("--beyond-store", type=_sizes, default=[0], metavar="SIZE",
                        help="--beyond-memory: bytes of pages per store (default: 4x --beyond-cache; "
                             "without a cgroup, 2x the machine's memory)")
    parser.add_argument("--beyond-cache", type=_sizes, default=[512 << 20], metavar="SIZE",
                        help="--beyond-memory: the page cache the bench may use (default 512MiB)")
    parser.add_argument("--beyond-backends", default="file,hf3fs",
                        help="--beyond-memory: connectors (default file,hf3fs)")
    parser.add_argument("--beyond-modes", default="buffered,o_direct",
                        help="--beyond-memory: comma-separated from buffered, o_direct and zstd "
                             "(buffered with compression=zstd: stored ratio and effective GB/s; "
                             "compressible with --kv real) (default buffered,o_direct)")
    parser.add_argument("--beyond-device-rate", type=_sizes, default=[0], metavar="RATE",
                        help="--beyond-memory: limit the stores' disk to RATE bytes/s each way for the "
                             "bench (an I/O cgroup; e.g. 600MB): a device slower than the cores decode, "
                             "as a remote filesystem is to a many-core host. cgroup v1 leaves "
                             "page-cache writeback unlimited (default 0: the disk as it is)")
    parser.add_argument("--beyond-rounds", type=int, default=3,
                        help="--beyond-memory: interleaved rounds (default 3)")
    parser.add_argument("--beyond-batches", type=int, default=256,
                        help="--beyond-memory: timed batches per contender and op (default 256, at "
                             "most one pass over the store)")
    parser.add_argument("--beyond-fio-seconds", type=float, default=2.0,
                        help="--beyond-memory: seconds of each fio job per round (default 2)")
    parser.add_argument("--kv-bytes-per-token", type=int, default=None,
                        help="--beyond-memory: the model's KV bytes per token (default 131072: "
                             "Llama-3.1-8B in bf16)")
    parser.add_argument("--prefill-tokens-per-s", type=float, default=None,
                        help="--beyond-memory: prefill rate of the model on its GPU (default 30000: "
                             "Llama-3.1-8B on one H100)")


def _refuse(message: str) -> int:
    """Print ``bench: message`` on stderr; 2, the exit code of bad options."""
    print(f"bench: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    """Run the bench; print the table; write JSON/CSV/plot. Exit 1 on failure, 2 on bad options."""
    quiet_credential_loggers()
    if args.scale:
        return _run_scale(args)
    if args.beyond_memory:
        return _run_beyond(args)
    if args.compression:
        return _run_compression(args)
    if args.reps < 1 or args.pages < 1:
        return _refuse("--reps and --pages must be >= 1")
    if not 0.0 <= args.read_fraction <= 1.0:
        return _refuse("--read-fraction must lie in [0, 1]")
    if not 0.0 <= args.idle_ms <= 60_000:
        return _refuse(f"--idle-ms must lie in [0, 60000], got {args.idle_ms:g}")
    ops = tuple(_items(args.ops))
    bad = [o for o in ops if o not in OPS]
    if bad:
        return _refuse(f"unknown op(s) {bad}; choose from {list(OPS)}")
    backends = _items(args.backend)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hicache-l3-bench-"))
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        settings = parse_settings(args.overrides)
        caches = ["warm", "cold"] if args.cache == "both" else [args.cache]
        combos = [(p, b, t, c) for p in args.page_size for b in args.batch for t in args.threads
                  for c in caches]
        with progress(len(backends) * len(combos), args.quiet, "bench", "config", delay=1.0) as tick:
            for backend in backends:
                make_pairs = load_backend(backend)
                for page_bytes, batch, threads, cache in combos:
                    opts = BenchOptions(page_bytes, args.pages, batch, threads, args.reps,
                                        workdir / f"{backend}-{page_bytes}-{batch}-{threads}-{cache}",
                                        settings, cache, args.read_fraction, args.idle_ms / 1e3)
                    opts.workdir.mkdir(parents=True, exist_ok=True)
                    with contextlib.ExitStack() as stack:
                        pairs = make_pairs(opts, stack)
                        rows.extend(run_pairs(pairs, opts, ops))
                    shutil.rmtree(opts.workdir, ignore_errors=True)
                    tick()
    except (HiCacheL3Error, OSError) as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    note = (f"({time.monotonic() - started:.1f} s; medians over {args.reps} repetitions; "
            "ratio = connector / raw, median over pairs of repetitions with the order swapped)")
    meta = {"pages": args.pages, "reps": args.reps, "backends": backends}
    print_results(f"{format_table(rows)}\n{note}", meta, rows, args.json)
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        from hicache_l3.bench.plot import plot_results

        plot_results(rows, args.plot)
    return 0


def _run_compression(args: argparse.Namespace) -> int:
    from hicache_l3.bench.compression import check_link, format_rows, run_backend

    rows = []
    backends, link_rate = _items(args.compression_backends), args.compression_link_rate[0]
    try:
        check_link(backends, link_rate)
    except HiCacheL3Error as exc:
        return _refuse(str(exc))
    try:
        for backend in backends:
            rows.append(run_backend(backend, args.page_size[0], args.pages, args.batch[0],
                                    args.reps, args.kv, link_rate=link_rate))
    except (HiCacheL3Error, OSError) as exc:
        print(f"bench failed: {exc}", file=sys.stderr)
        return 1
    print_results(format_rows(rows), {"kv": args.kv, "link_rate": link_rate}, rows, args.json)
    return 0


def _run_scale(args: argparse.Namespace) -> int:
    from hicache_l3.bench.scale import parse_counts, run_scale

    try:
        sizes = parse_counts(args.scale_sizes)
        settings = parse_settings(args.overrides)
    except HiCacheL3Error as exc:
        return _refuse(str(exc))
    if len(args.scale_page_bytes) != 1 or set(settings) - {"file"}:
        return _refuse("--scale takes one --scale-page-bytes and only file.* settings")
    return run_scale(sizes, args.scale_page_bytes[0], args.workdir, settings.get("file", {}),
                     args.json, args.plot, args.quiet, args.scale_index_only)


def _run_beyond(args: argparse.Namespace) -> int:
    from hicache_l3.bench.beyond import BeyondOptions, run_beyond

    try:
        opts = BeyondOptions(
            store_bytes=args.beyond_store[0], cache_bytes=args.beyond_cache[0], batch=args.batch[0],
            rounds=args.beyond_rounds, batches=args.beyond_batches, settings=parse_settings(args.overrides),
            fio_seconds=args.beyond_fio_seconds, device_rate=args.beyond_device_rate[0],
            backends=tuple(_items(args.beyond_backends)), modes=tuple(_items(args.beyond_modes)),
            kv=args.kv, workdir=str(args.workdir or ""))
    except HiCacheL3Error as exc:
        return _refuse(str(exc))
    for name in ("kv_bytes_per_token", "prefill_tokens_per_s"):  # None: the model's default
        if getattr(args, name) is not None:
            setattr(opts, name, getattr(args, name))
    reports = []
    for page_bytes in args.page_size:
        code, report = run_beyond(dataclasses.replace(opts, page_bytes=page_bytes), args.quiet)
        if code:
            return code
        reports.append(report)
    if args.json:
        args.json.write_text(json.dumps({"beyond_memory": reports}, indent=1))
    return 0


COLUMNS = [("backend", "{}"), ("op", "{}"), ("cache", "{}"), ("page_size", "{}"), ("batch", "{}"),
           ("threads", "{}"), ("gib_per_s", "{:.2f}"), ("pages_per_s", "{:,.0f}"),
           ("p50_ms", "{:.3f}"), ("p99_ms", "{:.3f}"), ("ratio_to_raw", "{:.2f}")]


def format_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of result rows."""
    from hicache_l3.bench.plot import row_label

    return format_columns([{**row, "backend": row_label(row), "page_size": _human(row["page_size"])}
                           for row in rows], COLUMNS)


def _human(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    """All result rows as CSV (union of their keys as columns)."""
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


__all__ = ["BenchError", "add_arguments", "run"]
