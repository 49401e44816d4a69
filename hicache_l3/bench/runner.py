"""Runs bench pairs: the connector and its raw baseline interleaved, repetition by
repetition, on the same pre-touched pages, bytes verified after timing; and the helpers
every bench mode shares (CPU line, quantiles, tables, progress bars, ``--set`` parsing)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import math
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hicache_l3.bench.targets import BenchOptions, BenchTarget, Pair
from hicache_l3.common.errors import ConfigError, HiCacheL3Error
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page, contiguous_pages


class BenchError(HiCacheL3Error):
    """A bench run could not produce valid figures (failed ops, wrong bytes)."""


CPU_FLAGS = ("avx2", "avx512f")  # the SIMD levels checksums and copies depend on


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    """``{"model", "avx2", "avx512f", "cores"}`` of the first processor in ``cpuinfo`` (the
    platform's processor string and no flags without it)."""
    import platform

    model, flags = "", set[str]()
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        name = name.strip()
        if name == "model name" and not model:
            model = value.strip()
        elif name == "flags" and not flags:
            flags = set(value.split())
    info: dict[str, Any] = {"model": model or platform.processor() or platform.machine() or "unknown"}
    info.update({flag: flag in flags for flag in CPU_FLAGS})
    info["cores"] = os.cpu_count() or 0
    return info


def describe_cpu(info: dict[str, Any]) -> str:
    """One line for a table header: ``cpu: MODEL (N cores; avx2, no avx512f)``."""
    flags = ", ".join(f if info.get(f) else f"no {f}" for f in CPU_FLAGS)
    return f"cpu: {info['model']} ({info.get('cores', 0)} cores; {flags})"


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (nearest rank below) of ``values``; 0.0 when empty."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fixed_width(lines: list[list[str]]) -> str:
    """Rows of cells as right-aligned columns, two spaces apart."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def format_columns(rows: list[dict[str, Any]], columns: list[tuple[str, str]],
                   header: list[str] | None = None, blank: str = "") -> str:
    """:func:`fixed_width` of ``rows``' ``columns`` (key, format) under ``header`` (default: the
    keys); ``blank`` where a row has no value or None."""
    return fixed_width([header or [key for key, _ in columns]] + [
        [blank if row.get(key) is None else fmt.format(row[key]) for key, fmt in columns] for row in rows])


def print_results(table: str, meta: dict[str, Any], rows: list[dict[str, Any]],
                  json_path: Path | None) -> None:
    """Print the CPU line and ``table``; with ``json_path``, write ``{"meta", "results": rows}``
    there, ``meta`` with the CPU added."""
    meta["cpu"] = cpu_info()
    print(describe_cpu(meta["cpu"]))
    print(table)
    if json_path:
        json_path.write_text(json.dumps({"meta": meta, "results": rows}, indent=1))


@contextlib.contextmanager
def progress(total: int, quiet: bool, desc: str, unit: str, **tqdm_args: Any) -> Iterator[Callable[..., Any]]:
    """A tqdm bar on stderr (nothing when ``quiet``); yields ``update(n=1)``."""
    if quiet:
        yield lambda n=1: None
        return
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False, **tqdm_args)
    try:
        yield bar.update
    finally:
        bar.close()


def size_arg(text: str) -> int:
    """An argparse type: a size such as ``64KiB`` in bytes."""
    import argparse

    from hicache_l3.common.config import parse_size

    try:
        return parse_size(text, "size")
    except HiCacheL3Error as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_settings(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """``--set BACKEND.KEY=VALUE`` items as ``{backend: {key: value}}``; ConfigError on a bad one."""
    out: dict[str, dict[str, Any]] = {}
    for item in overrides:
        name, sep, value = item.partition("=")
        backend, dot, key = name.partition(".")
        if not (sep and dot and backend and key):
            raise ConfigError(f"--set {item!r}: expected BACKEND.KEY=VALUE, e.g. file.root=/mnt/kv")
        out.setdefault(backend, {})[key] = value
    return out


def load_backend(name: str) -> Callable[[BenchOptions, contextlib.ExitStack], list[Pair]]:
    """The ``make_pairs`` of bench backend ``name`` (ConfigError when it has none)."""
    from hicache_l3.common.registry import resolve_name

    module_name = f"hicache_l3.bench.backend_{resolve_name(name)}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise ConfigError(f"no bench backend for connector {name!r} yet") from None
        raise
    make: Callable[[BenchOptions, contextlib.ExitStack], list[Pair]] = module.make_pairs
    return make


def page_buffer(pages: int, page_bytes: int, **kwargs: Any) -> tuple[HostBuffer, list[Page]]:
    """A :class:`HostBuffer` of ``pages`` pages (``kwargs``: its options) and its pages."""
    buffer = HostBuffer(pages * page_bytes, **kwargs)
    return buffer, contiguous_pages(buffer.address, page_bytes, range(pages))


def fill(buffer: HostBuffer, page_bytes: int) -> None:
    """Distinct, incompressible-looking bytes in every page (1 MiB random block + page id)."""
    view = buffer.view()
    block = os.urandom(min(1 << 20, buffer.size))
    for off in range(0, buffer.size, len(block)):
        n = min(len(block), buffer.size - off)
        view[off : off + n] = block[:n]
    for i, off in enumerate(range(0, buffer.size - 8 + 1, page_bytes)):
        view[off : off + 8] = i.to_bytes(8, "little")


@dataclasses.dataclass
class Measure:
    """Timings of one target and op across repetitions."""

    rep_seconds: list[float] = dataclasses.field(default_factory=list)
    batch_seconds: list[float] = dataclasses.field(default_factory=list)
    failures: int = 0


def _mixed_plans(target: BenchTarget, keys: list[str], src: list[Page], dst: list[Page],
                 batch: int, read_fraction: float) -> list[tuple[str, Any]]:
    plans = []
    for j, lo in enumerate(range(0, len(keys), batch)):
        if int((j + 1) * read_fraction) > int(j * read_fraction):
            plans.append(("get", target.plan("get", keys[lo : lo + batch], dst[lo : lo + batch])))
        else:
            fresh = [f"{k}-mix" for k in keys[lo : lo + batch]]
            plans.append(("set", target.plan("set", fresh, src[lo : lo + batch])))
    return plans


def drop_page_cache(directory: Path) -> None:
    """Write back and drop the page cache of every file under ``directory`` (cold reads)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _time_op(target: BenchTarget, op: str, keys: list[str], pages: list[Page], batch: int,
             threads: int, measure: Measure, plans: list[tuple[str, Any]] | None = None) -> None:
    if plans is None:
        plans = [(op, target.plan(op, keys[lo : lo + batch], pages[lo : lo + batch]))
                 for lo in range(0, len(keys), batch)]
    lat: list[float] = []

    def work(share: list[tuple[str, Any]]) -> int:
        failed = 0
        for kind, plan in share:
            t0 = time.perf_counter()
            results = target.run(kind, plan)
            lat.append(time.perf_counter() - t0)
            failed += results.count(False)
        return failed

    start = time.perf_counter()
    if threads <= 1 or target.backend.startswith("raw-"):
        failed = work(plans)
    else:
        with ThreadPoolExecutor(threads) as pool:
            failed = sum(pool.map(work, [plans[t::threads] for t in range(threads)]))
    measure.rep_seconds.append(time.perf_counter() - start)
    measure.batch_seconds.extend(lat)
    measure.failures += failed


def balanced_ratio(ratios: list[float]) -> float:
    """The row's ratio from per-repetition ratios connector / raw (the connector first in
    even repetitions): the median over pairs of repetitions (0 and 1, 2 and 3, ...) of each
    pair's geometric mean, so that a first-runner penalty cancels. An odd last repetition is
    left out; a single one is returned as is; ValueError when empty."""
    if not ratios:
        raise ValueError("balanced_ratio: no repetitions")
    if len(ratios) == 1:
        return ratios[0]
    return statistics.median(math.sqrt(a * b) for a, b in zip(ratios[0::2], ratios[1::2]))


def run_pairs(pairs: list[Pair], opts: BenchOptions, ops: tuple[str, ...]) -> list[dict[str, Any]]:
    """Measure every pair (one untimed warm-up, then ``opts.reps`` repetitions, the order
    swapped every other one); one JSON row per target and op. BenchError on a failed page
    or wrong bytes."""
    src, src_pages = page_buffer(opts.pages, opts.page_bytes, name="bench-src")
    dst, dst_pages = page_buffer(opts.pages, opts.page_bytes, name="bench-dst")
    fill(src, opts.page_bytes)
    targets = [t for pair in pairs for t in (pair.connector, pair.raw)]
    for t in targets:
        t.prepare([src, dst], opts.page_bytes)
    run_id = uuid.uuid4().hex[:8]
    measures = {(id(t), op): Measure() for t in targets for op in ops}
    for t in targets:  # warm-up: fills slabs / segments, faults in everything
        keys = [f"{run_id}-warm-{i}" for i in range(opts.pages)]
        for op in ("set", "get"):
            if op in t.ops and (op in ops or "mixed" in ops):
                _time_op(t, op, keys, src_pages if op == "set" else dst_pages,
                         opts.batch, opts.threads, Measure())
    for rep in range(opts.reps):
        keys = [f"{run_id}-r{rep}-{i}" for i in range(opts.pages)]
        for pair in pairs:
            order = (pair.raw, pair.connector) if rep % 2 else (pair.connector, pair.raw)
            if "set" not in ops:  # get/exists need the pages stored: store them untimed
                for t in order:
                    if "set" in t.ops:
                        _time_op(t, "set", keys, src_pages, opts.batch, opts.threads, Measure())
            for op in ops:
                for t in order:
                    if not t.supports(op):
                        continue
                    plans = None
                    if op == "mixed":
                        plans = _mixed_plans(t, keys, src_pages, dst_pages, opts.batch, opts.read_fraction)
                    if opts.cache == "cold" and op in ("get", "mixed"):
                        drop_page_cache(opts.workdir)
                    if opts.idle_s:
                        time.sleep(opts.idle_s)
                    _time_op(t, op, keys, src_pages if op == "set" else dst_pages, opts.batch,
                             opts.threads, measures[(id(t), op)], plans)
                    if op == "get":
                        verify(t.backend, src, dst, opts.page_bytes)
    rows = []
    for pair in pairs:
        for op in ops:
            raw_m = measures[(id(pair.raw), op)]
            for t in (pair.connector, pair.raw):
                if not t.supports(op):
                    continue
                m = measures[(id(t), op)]
                if m.failures:
                    raise BenchError(f"{t.backend} {op}: {m.failures} pages failed during timing")
                row = _row(t, op, m, opts)
                if t is pair.connector and raw_m.rep_seconds:
                    row["ratio_to_raw"] = balanced_ratio([r / c for c, r in zip(m.rep_seconds,
                                                                                  raw_m.rep_seconds)])
                    row["raw_backend"] = pair.raw.backend
                rows.append(row)
    return rows


def verify(what: str, src: HostBuffer, dst: HostBuffer, page_bytes: int) -> None:
    """BenchError naming the first page of ``dst`` that differs from ``src``; then ``dst``
    zeroed, so that the next get must write every byte again."""
    a, b = src.view(), dst.view()
    if a != b:
        pb = page_bytes
        bad = next(i for i in range(len(a) // pb) if a[i * pb : (i + 1) * pb] != b[i * pb : (i + 1) * pb])
        raise BenchError(f"{what}: page {bad} read back differs from what was written")
    b[:] = bytes(len(b))


def _row(t: BenchTarget, op: str, m: Measure, opts: BenchOptions) -> dict[str, Any]:
    gibs = [opts.pages * opts.page_bytes / s / 2**30 for s in m.rep_seconds]
    moves = op != "exists"
    row: dict[str, Any] = {
        "backend": t.backend, "op": op, "page_size": opts.page_bytes, "batch": opts.batch,
        "pages": opts.pages, "threads": 1 if t.backend.startswith("raw-") else opts.threads,
        "cache": opts.cache, "reps": len(m.rep_seconds),
        "gib_per_s": statistics.median(gibs) if moves else 0.0,
        "gib_per_s_min": min(gibs) if moves else 0.0,
        "gib_per_s_max": max(gibs) if moves else 0.0,
        "pages_per_s": statistics.median(opts.pages / s for s in m.rep_seconds),
        "p50_ms": quantile(m.batch_seconds, 0.50) * 1e3,
        "p95_ms": quantile(m.batch_seconds, 0.95) * 1e3,
        "p99_ms": quantile(m.batch_seconds, 0.99) * 1e3,
    }
    if op == "mixed":
        row["read_fraction"] = opts.read_fraction
    if opts.idle_s:
        row["idle_ms"] = opts.idle_s * 1e3
    row.update(t.extra)
    return row
