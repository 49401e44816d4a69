"""``hicache-l3 bench --beyond-memory``: stores several times bigger than the page cache.

A worker process joins a memory cgroup limited to ``cache_bytes`` (:mod:`.memcg`; without
one the store is sized from the machine's memory), fills one store per contender (file and
hf3fs, buffered, ``o_direct`` and buffered with ``compression="zstd"``) and a raw file, drops
their page cache, then times random batch gets over the whole store and evicting sets of
fresh keys, interleaved round by round with the raw contenders (:mod:`.raw_direct`); each
set batch and each fio job starts after an untimed ``sync()``, so none pays for the page cache
another left dirty. Every page read is verified. Each GB/s is page bytes moved per second
(for a zstd store the effective rate), put beside the break-even against recompute
(``kv_bytes_per_token * prefill_tokens_per_s``). A zstd store's stored ratio comes from its
connector's counters. With ``device_rate`` the stores' disk is limited for the worker (an I/O
cgroup, :func:`.memcg.limit_io`): a device slower than the cores decode, where zstd is meant
to pay.

Page bytes (``kv``): ``random`` (incompressible), ``real`` (the bf16 KV of a real model,
:mod:`.real_kv`) or ``synthetic`` (bf16 values of a normal distribution: compressible like
KV, with no model needed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hicache_l3.bench import memcg, runner
from hicache_l3.bench.raw_direct import RawDirect, fio_available, fio_round
from hicache_l3.bench.runner import BenchError, cpu_info, describe_cpu, drop_page_cache, quantile
from hicache_l3.bench.targets import bench_namespace
from hicache_l3.common.errors import ConfigError, HiCacheL3Error
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.auto_direct import memory_total
from hicache_l3.slab.format import Geometry

BODIES = 64  # distinct page bodies; page i has body i % BODIES and its index in its first 8 bytes
LLAMA31_8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16
# 989 TFLOPS dense bf16 at 50% utilization over 2 FLOPs per parameter per token (8.03e9)
H100_LLAMA31_8B_PREFILL_TOKENS_PER_S = 30_000
CONNECTORS = ("file", "hf3fs")
MODES = ("buffered", "o_direct", "zstd")
DEFAULT_MODES = ("buffered", "o_direct")
KV_BYTES = ("random", "real", "synthetic")
CGROUP_SLACK = 64 << 20  # the worker's own allocations after it joins its cgroup


@dataclasses.dataclass
class BeyondOptions:
    """One beyond-memory run (from the command line)."""

    store_bytes: int = 0  # bytes of pages per store; 0: 4x cache_bytes (or 2x memory, no cgroup)
    cache_bytes: int = 512 << 20  # the page cache the worker may use (its cgroup's limit)
    page_bytes: int = 64 << 10
    batch: int = 128
    rounds: int = 3  # rounds of interleaved contenders; each gets a share of the batches
    batches: int = 256  # timed batches per contender and op, at most (and one pass of the store)
    backends: tuple[str, ...] = CONNECTORS
    modes: tuple[str, ...] = DEFAULT_MODES
    kv: str = "random"  # page bytes: one of KV_BYTES
    raw_threads: int = 16
    fio: bool = True  # run fio when it is installed
    fio_seconds: float = 2.0  # per fio job and round
    settings: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    kv_bytes_per_token: int = LLAMA31_8B_KV_BYTES_PER_TOKEN
    prefill_tokens_per_s: float = H100_LLAMA31_8B_PREFILL_TOKENS_PER_S
    workdir: str = ""  # where stores live (a directory made and removed under it)
    cgroup: str = ""  # the worker's memory cgroup ("" = none)
    device_rate: int = 0  # bytes/s the worker may move to and from the stores' disk (0: no limit)
    io_cgroup: str = ""  # the cgroup holding that limit ("" = none)

    def validate(self) -> None:
        """ConfigError naming the option when a value cannot work."""
        if self.page_bytes % 4096:
            raise ConfigError(f"--page-size: the beyond-memory bench moves pages with O_DIRECT, "
                              f"so a page must be a 4 KiB multiple, got {self.page_bytes}")
        if self.batch < 1 or self.rounds < 1 or self.batches < 1 or self.raw_threads < 1:
            raise ConfigError("--batch, --beyond-rounds, --beyond-batches and the raw threads must be >= 1")
        if not 0 < self.fio_seconds <= 600:
            raise ConfigError(f"--beyond-fio-seconds must lie in (0, 600], got {self.fio_seconds:g}")
        if self.device_rate < 0:
            raise ConfigError(f"--beyond-device-rate must be >= 0 bytes/s, got {self.device_rate}")
        if self.kv_bytes_per_token < 1 or self.prefill_tokens_per_s <= 0:
            raise ConfigError("--kv-bytes-per-token and --prefill-tokens-per-s must be > 0")
        for option, given, known in (("--beyond-backends", self.backends, CONNECTORS),
                                     ("--beyond-modes", self.modes, MODES), ("--kv", (self.kv,), KV_BYTES)):
            for value in given:
                if value not in known:
                    raise ConfigError(f"{option}: {value!r} is not one of {list(known)}")
        for backend, values in self.settings.items():
            taken = {"root", "capacity_bytes", "o_direct", "compression"} & set(values)
            if taken:
                raise ConfigError(f"--set {backend}.{sorted(taken)[0]}: set by the beyond-memory bench")

    @property
    def cgroup_bytes(self) -> int:
        """The worker cgroup's limit: the page cache, the worker's own allocations and, with a
        zstd store, the frames of one batch (which its connector holds while it moves them)."""
        frames = self.batch * self.page_bytes if "zstd" in self.modes else 0
        return self.cache_bytes + CGROUP_SLACK + frames

    @property
    def pages(self) -> int:
        """Pages per store."""
        return max(self.batch, self.store_bytes // self.page_bytes)


def break_even_gb_s(kv_bytes_per_token: int, prefill_tokens_per_s: float) -> float:
    """GB/s above which loading a prefix's KV takes less time than recomputing it."""
    return kv_bytes_per_token * prefill_tokens_per_s / 1e9


def key(i: int) -> str:
    """The key of page ``i``."""
    return f"beyond{i:011d}"


def run_beyond(opts: BeyondOptions, quiet: bool = False) -> tuple[int, dict[str, Any] | None]:
    """Run the mode (a worker in a memory cgroup when one can be made); print the report.
    ``(exit code, report)``: 1 on a failed measure, 2 on bad options (no report then)."""
    cgroup: Path | None = None
    io: Path | None = None
    why = ""

    def remove_cgroups() -> None:
        for made in dict.fromkeys(p for p in (cgroup, io) if p):  # v2: io is the memory cgroup
            memcg.remove(made)

    try:
        opts.validate()
        cgroup, why = memcg.create(opts.cgroup_bytes, f"hicache-l3-bench-{os.getpid()}")
        if opts.store_bytes <= 0:
            opts.store_bytes = 4 * opts.cache_bytes if cgroup else 2 * memory_total()
        base = Path(opts.workdir) if opts.workdir else Path(tempfile.gettempdir())
        base.mkdir(parents=True, exist_ok=True)
        stores = len(opts.backends) * len(opts.modes) + 1
        need = stores * opts.pages * (Geometry(opts.page_bytes).stride + 256) + (256 << 20)
        free = shutil.disk_usage(base).free
        if need > free:
            raise ConfigError(f"--beyond-store {opts.store_bytes / 2**30:.1f} GiB x {stores} stores needs "
                              f"{need / 2**30:.1f} GiB free in {base}, {free / 2**30:.1f} GiB is: lower "
                              "--beyond-store or --beyond-backends/--beyond-modes, or use another --workdir")
        if opts.device_rate:
            io, why_io = memcg.limit_io(opts.device_rate, base, f"hicache-l3-bench-io-{os.getpid()}", cgroup)
            if io is None:
                raise ConfigError(f"--beyond-device-rate: {why_io}")
    except (HiCacheL3Error, OSError) as exc:
        remove_cgroups()
        print(f"bench: {exc}", file=sys.stderr)
        return 2, None
    work = Path(tempfile.mkdtemp(prefix="hicache-l3-beyond-", dir=base))
    try:
        if cgroup is None:
            print(f"bench: no memory cgroup ({why}): the page cache is the machine's "
                  f"({memory_total() / 2**30:.1f} GiB), the store "
                  f"{opts.store_bytes / memory_total():.1f}x that", file=sys.stderr)
        config = dataclasses.replace(opts, workdir=str(work), cgroup=str(cgroup or ""),
                                     io_cgroup=str(io or ""))
        args = [sys.executable, "-m", "hicache_l3.bench.beyond", json.dumps(dataclasses.asdict(config))]
        done = subprocess.run(args, stdout=subprocess.PIPE, text=True,
                              stderr=subprocess.DEVNULL if quiet else None)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            print(f"bench failed: the beyond-memory worker exited with {done.returncode}", file=sys.stderr)
            return 1, None
        report: dict[str, Any] = json.loads(lines[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)
        remove_cgroups()
    if "error" in report:
        print(f"bench failed: {report['error']}", file=sys.stderr)
        return 1, None
    report["meta"].update(cgroup=bool(cgroup), cgroup_why_not=why, cpu=cpu_info())
    print(format_report(report))
    return 0, report


def format_report(report: dict[str, Any]) -> str:
    """The report's text: the setting, one line per contender and op, the break-even."""
    meta = report["meta"]
    limit = (f"page cache limited to {meta['cache_bytes'] / 2**30:.2f} GiB by a memory cgroup"
             if meta["cgroup"] else f"no memory cgroup ({meta['cgroup_why_not']}); the machine has "
             f"{meta['memory_bytes'] / 2**30:.1f} GiB")
    if meta.get("device_rate"):
        limit += f"; the disk limited to {meta['device_rate'] / 1e6:,.0f} MB/s each way by an I/O cgroup"
    even = meta["break_even_gb_s"]
    lines = [describe_cpu(meta["cpu"]),
             f"store {meta['store_bytes'] / 2**30:.2f} GiB per contender ({meta['pages']:,} pages of "
             f"{meta['page_bytes'] >> 10} KiB), {limit}; random batches of {meta['batch']} over the "
             f"whole store, {meta['rounds']} interleaved rounds, every page read verified",
             f"break-even against recompute: {even:.2f} GB/s ({meta['kv_bytes_per_token']:,} KV bytes "
             f"per token x {meta['prefill_tokens_per_s']:,.0f} prefill tokens/s)"]
    columns = [("contender", "{}"), ("op", "{}"), ("gb_s", "{:.2f}"), ("p50_ms", "{:.1f}"),
               ("p99_ms", "{:.1f}"), ("x_raw", "{:.2f}"), ("x_even", "{:.2f}")]
    header = ["contender", "op", "GB/s", "p50 ms", "p99 ms", "x raw", "x break-even"]
    lines.append(runner.format_columns([{**r, "x_even": r["gb_s"] / even} for r in report["results"]],
                                       columns, header))
    lines.append(f"(x raw: against raw-direct-{meta['raw_threads']}t of the same op in the same rounds; "
                 "x break-even > 1: a hit loads faster than recomputing)")
    if meta.get("device_rate") and meta["batch"] * meta["page_bytes"] < meta["device_rate"] * 0.2:
        lines.append("(the I/O cgroup meters in slices of up to 100 ms: batches that move under "
                     f"{meta['device_rate'] * 0.2 / 1e6:,.0f} MB may run faster than the limit)")
    for z in report.get("compressed", []):
        lines.append(f"{z['contender']}: stored ratio {z['stored_ratio']:.2f} (page bytes / stored bytes; "
                     f"{z['frames_written']:,} of {z['pages_written']:,} pages written as zstd frames, "
                     f"{meta.get('kv', 'random')} page bytes); get {z['get_gb_s']:.2f} GB/s effective "
                     "(page bytes moved per second)")
        for mode in ("buffered", "o_direct"):
            if f"over_{mode}_get" in z:
                lines.append(f"zstd / {mode} get ({z['backend']}, same rounds): {z[f'over_{mode}_get']:.2f}x")
    return "\n".join(lines)


# ---- worker side (runs in the cgroup) ---------------------------------------------------


def page_bodies(page_bytes: int, kv: str) -> list[bytes]:
    """``BODIES`` distinct page bodies of ``page_bytes - 8`` bytes (an even length: bf16
    elements stay aligned after the 8-byte stamp) for ``kv`` (one of ``KV_BYTES``):
    random bytes; the real model's KV as one stream, body ``k`` cut where page ``k`` of it
    lies (cycled); or bf16 values drawn from a normal distribution."""
    n = page_bytes - 8
    if kv == "random":
        rng = random.Random(page_bytes)
        return [rng.randbytes(n) for _ in range(BODIES)]
    if kv == "real":
        from hicache_l3.bench.real_kv import token_kv

        flat = token_kv().reshape(-1).view(np.uint8)
        stream = np.resize(flat, BODIES * page_bytes).reshape(BODIES, page_bytes)
        return [row[8:].tobytes() for row in stream]
    if kv == "synthetic":
        gen = np.random.default_rng(page_bytes)
        values = gen.normal(0.0, 0.5, size=(BODIES, n // 2)).astype(np.float32)
        bf16 = (values.view(np.uint32) >> 16).astype("<u2")
        return [row.tobytes() for row in bf16]
    raise ConfigError(f"--kv: {kv!r} is not one of {list(KV_BYTES)}")


class _Pages:
    """Page ``i`` is body ``i % BODIES`` (:func:`page_bodies`) with ``i`` in its first 8 bytes."""

    def __init__(self, page_bytes: int, kv: str = "random") -> None:
        self.page_bytes = page_bytes
        self.bodies = page_bodies(page_bytes, kv)

    def stamp(self, view: memoryview, first: int, count: int) -> None:
        """Write pages ``first .. first + count - 1`` into ``view`` (which holds ``count``)."""
        pb = self.page_bytes
        for j in range(count):
            i = first + j
            view[j * pb : j * pb + 8] = i.to_bytes(8, "little")
            view[j * pb + 8 : (j + 1) * pb] = self.bodies[i % BODIES]

    def check(self, view: memoryview, indices: list[int], what: str) -> None:
        """BenchError unless ``view`` holds pages ``indices`` in order."""
        pb = self.page_bytes
        for j, i in enumerate(indices):
            page = view[j * pb : (j + 1) * pb]
            if page[:8] != i.to_bytes(8, "little") or page[8:].tobytes() != self.bodies[i % BODIES]:
                raise BenchError(f"{what}: page {i} came back with other bytes")


@dataclasses.dataclass
class _Contender:
    name: str
    get: Callable[[list[int]], bool]  # a batch of page indices into this contender's buffer
    set: Callable[[list[int]], bool]  # a batch of page indices from the shared source buffer
    view: memoryview  # where gets land
    buffer: HostBuffer  # owns the memory of view
    fills: bool = True  # writes its pages while the stores are filled (not when it shares a file)
    mode: str = ""  # a connector's --beyond-modes entry ("" for raw)
    backend: str = ""  # a connector's name ("" for raw)
    counters: Callable[[], dict[str, int]] | None = None  # a connector's metrics counters
    written: int = 0  # pages written, filling included
    latencies: dict[str, list[float]] = dataclasses.field(default_factory=lambda: {"get": [], "set": []})


def _connector(opts: BeyondOptions, backend: str, mode: str, source: HostBuffer,
               stack: contextlib.ExitStack) -> _Contender:
    settings: dict[str, Any] = {"root": str(Path(opts.workdir) / f"{backend}-{mode}"),
                                "capacity_bytes": opts.pages * Geometry(opts.page_bytes).stride,
                                "o_direct": mode == "o_direct"}
    if mode == "zstd":
        settings["compression"] = "zstd"
    if backend == "hf3fs":
        settings["max_writers"] = 1
    settings.update(opts.settings.get(backend, {}))
    ns = bench_namespace(opts.page_bytes, f"beyond-{backend}", kv_dtype="bfloat16")  # byte planes for zstd
    conn = open_connector(backend, ns, settings)
    stack.callback(conn.close)
    dst, dst_pages = runner.page_buffer(opts.batch, opts.page_bytes, pin=False)
    conn.register(source)
    conn.register(dst)
    src_pages = contiguous_pages(source.address, opts.page_bytes, range(opts.batch))

    def get(indices: list[int]) -> bool:
        return all(conn.batch_get([key(i) for i in indices], dst_pages[: len(indices)]))

    def put(indices: list[int]) -> bool:
        return all(conn.batch_set([key(i) for i in indices], src_pages[: len(indices)]))

    def counters() -> dict[str, int]:
        return dict(conn.stats()["ops"]["counters"])

    name = backend if mode == "buffered" else f"{backend}+{mode}"
    return _Contender(name, get, put, dst.view(), dst, mode=mode, backend=backend, counters=counters)


def _raw(opts: BeyondOptions, source: HostBuffer, stack: contextlib.ExitStack,
         direct: bool = True) -> tuple[_Contender, RawDirect]:
    raw = RawDirect(Path(opts.workdir) / "raw-direct.dat", opts.pages, opts.page_bytes, opts.raw_threads,
                    direct)
    stack.callback(raw.close)
    dst = HostBuffer(opts.batch * opts.page_bytes, pin=False)
    pb = opts.page_bytes
    dst_views = [dst.view()[j * pb : (j + 1) * pb] for j in range(opts.batch)]
    src_views = [source.view()[j * pb : (j + 1) * pb] for j in range(opts.batch)]

    def get(indices: list[int]) -> bool:
        return raw.move("get", indices, dst_views[: len(indices)])

    def put(indices: list[int]) -> bool:
        return raw.move("set", [i % opts.pages for i in indices], src_views[: len(indices)])

    kind = "direct" if direct else "buffered"
    return _Contender(f"raw-{kind}-{opts.raw_threads}t", get, put, dst.view(), dst), raw


def _fill(contenders: list[_Contender], source: HostBuffer, pages: _Pages, opts: BeyondOptions) -> None:
    view = source.view()
    for lo in range(0, opts.pages, opts.batch):
        count = min(opts.batch, opts.pages - lo)
        pages.stamp(view, lo, count)
        for c in contenders:
            if c.fills and not c.set(list(range(lo, lo + count))):
                raise BenchError(f"{c.name}: filling pages {lo}..{lo + count - 1} failed")
            c.written += count if c.fills else 0


def _timed(c: _Contender, op: str, indices: list[int]) -> None:
    t0 = time.perf_counter()
    ok = (c.get if op == "get" else c.set)(indices)
    c.latencies[op].append(time.perf_counter() - t0)
    c.written += len(indices) if op == "set" else 0
    if not ok:
        raise BenchError(f"{c.name}: a {op} batch failed (a miss or an I/O error)")


def worker(opts: BeyondOptions) -> dict[str, Any]:
    """The measures (module docstring), in this process; the report as a dict."""
    pages = _Pages(opts.page_bytes, opts.kv)
    source = HostBuffer(opts.batch * opts.page_bytes, pin=False)
    per_round = max(1, min(opts.batches, -(-opts.pages // opts.batch)) // opts.rounds)
    rng = random.Random(0xB1660)
    with contextlib.ExitStack() as stack:
        raw_contender, raw = _raw(opts, source, stack)
        contenders = [_connector(opts, b, m, source, stack) for b in opts.backends for m in opts.modes]
        if "buffered" in opts.modes:  # the buffered path on the same file, filled once
            contenders.append(dataclasses.replace(_raw(opts, source, stack, direct=False)[0],
                                                  fills=False))
        contenders.append(raw_contender)
        for cgroup in dict.fromkeys(c for c in (opts.cgroup, opts.io_cgroup) if c):
            memcg.join(Path(cgroup))  # after the buffers: their memory is not the page cache's
        _fill(contenders, source, pages, opts)
        os.sync()
        drop_page_cache(Path(opts.workdir))
        fio = opts.fio and fio_available()
        fio_figures: dict[tuple[str, str], list[dict[str, Any]]] = {}
        fresh = opts.pages
        for op in ("get", "set"):
            for r in range(opts.rounds):
                order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]
                for b in range(per_round):
                    for c in order if b % 2 == 0 else order[::-1]:
                        if op == "get":
                            indices = [rng.randrange(opts.pages) for _ in range(opts.batch)]
                            _timed(c, op, indices)
                            pages.check(c.view, indices, f"{c.name} get")
                        else:
                            indices = list(range(fresh, fresh + opts.batch))
                            pages.stamp(source.view(), fresh, opts.batch)
                            os.sync()  # untimed: the last contender's dirty pages are not this one's
                            _timed(c, op, indices)
                    if op == "set":
                        fresh += opts.batch
                if fio:
                    fio_round(raw.path, opts.pages * opts.page_bytes, opts.page_bytes, op, opts.fio_seconds,
                              fio_figures)
        results = contender_rows({c.name: c.latencies for c in contenders}, opts.batch * opts.page_bytes,
                                 fio_figures, contenders[-1].name)
        compressed = _compressed(contenders, results, opts.page_bytes)
    return {"meta": {**dataclasses.asdict(opts), "pages": opts.pages, "memory_bytes": memory_total(),
                     "break_even_gb_s": break_even_gb_s(opts.kv_bytes_per_token, opts.prefill_tokens_per_s),
                     "fio": fio},
            "results": results, "compressed": compressed}


def contender_rows(latencies: dict[str, dict[str, list[float]]], batch_bytes: int,
                   fio: dict[tuple[str, str], list[dict[str, Any]]], raw_name: str) -> list[dict[str, Any]]:
    """The report's rows, gets then sets: per contender (``latencies[name][op]``: seconds per
    batch of ``batch_bytes``) and fio job (:func:`.raw_direct.fio_round`'s figures), its GB/s
    and that over ``raw_name``'s of the same op."""
    out: list[dict[str, Any]] = []
    for op in ("get", "set"):
        rows: list[dict[str, Any]] = []
        for name, lat in latencies.items():
            ms = [1e3 * t for t in lat[op]]
            rows.append({"contender": name, "op": op, "gb_s": len(ms) * batch_bytes / sum(lat[op]) / 1e9,
                         "p50_ms": quantile(ms, 0.5), "p99_ms": quantile(ms, 0.99), "batches": len(ms)})
        for (name, fop), figs in fio.items():
            if fop == op:
                rows.append({"contender": name, "op": op, "p50_ms": None, "p99_ms": None,
                             "gb_s": sum(f["bytes"] for f in figs) / sum(f["seconds"] for f in figs) / 1e9})
        raw = next(r["gb_s"] for r in rows if r["contender"] == raw_name)
        for row in rows:
            row["x_raw"] = row["gb_s"] / raw
        out += rows
    return out


def stored_ratio(pages: int, frames: int, frame_bytes: int, page_bytes: int) -> float:
    """Page bytes over stored bytes of ``pages`` written, ``frames`` of them stored as zstd
    frames of ``frame_bytes`` in all and the rest as they are."""
    stored = frame_bytes + (pages - frames) * page_bytes
    return pages * page_bytes / stored if stored > 0 else math.nan


def _compressed(contenders: list[_Contender], results: list[dict[str, Any]],
                page_bytes: int) -> list[dict[str, Any]]:
    """Per zstd contender: its stored ratio (from its connector's counters), its effective get
    GB/s and that over the same backend's buffered and ``o_direct`` gets of the same rounds."""
    get = {r["contender"]: r["gb_s"] for r in results if r["op"] == "get"}
    out: list[dict[str, Any]] = []
    for c in contenders:
        if c.mode != "zstd" or c.counters is None:
            continue
        n = c.counters()
        frames, frame_bytes = n.get("frames_written", 0), n.get("frame_bytes_written", 0)
        row: dict[str, Any] = {
            "contender": c.name, "backend": c.backend, "pages_written": c.written, "frames_written": frames,
            "frame_bytes_written": frame_bytes, "frames_read": n.get("frames_read", 0),
            "stored_ratio": stored_ratio(c.written, frames, frame_bytes, page_bytes),
            "get_gb_s": get[c.name]}
        for mode, name in (("buffered", c.backend), ("o_direct", f"{c.backend}+o_direct")):
            if name in get:
                row[f"over_{mode}_get"] = get[c.name] / get[name]
        out.append(row)
    return out


def main(argv: list[str]) -> int:
    """Worker entry: ``BEYOND_OPTIONS_JSON``; prints the report (or ``{"error"}``) as one
    JSON line."""
    opts = BeyondOptions(**json.loads(argv[0]))
    opts.backends, opts.modes = tuple(opts.backends), tuple(opts.modes)
    try:
        report = worker(opts)
    except (HiCacheL3Error, OSError) as exc:
        report = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
