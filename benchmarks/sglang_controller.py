"""SGLang's in-tree ``file`` backend, hicache-l3's file connector and raw ``pwritev``/``preadv``
of the same pages, driven the way SGLang's HiCacheController drives them (benchmarks/README.md
says what each contender and output line is). Run with the SGLang venv (``make setup-sglang``;
``--help`` alone runs in ``.venv``)::

    .venv-sglang/bin/python benchmarks/sglang_controller.py [--pages 1024] [--reps 5]
        [--layers 4] [--steady-state] [--no-checksum] [--no-raw] [--no-stages]
        [--sglang-pointers] [--idle-ms 0] [--warmup 1] [--workdir DIR] [--json]

One real MHA host pool on the CPU (``page_first``; a page is ``--layers`` x 16 KiB). SGLang's
``file`` backend goes through ``HiCacheController._generic_page_set`` / ``_generic_page_get``,
ours (the ``dynamic`` backend, ``interface_v1``) through ``_page_set_zero_copy`` /
``_page_get_zero_copy``, in batches of STORAGE_BATCH_SIZE (128) pages. Raw contenders
(``raw-1t``, ``raw-2t``, ``raw-2t-batch``) are the bench's ``RawPosixBatch`` over the pointers
SGLang's pool gives. Every repetition: fresh keys and bytes, contenders in a rotating order,
an untimed ``sync()`` before each, pages zeroed between set and get, bytes verified. Reported:
per-repetition GB/s, medians, median ratios ours / theirs with their spread, the guest's
first-touch rate (it bounds fresh sets), and (unless ``--no-stages``) a per-stage breakdown
of one extra instrumented pass.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from hicache_l3.bench.backend_file import RawPosixBatch  # noqa: E402
from hicache_l3.bench.runner import cpu_info, describe_cpu, size_arg  # noqa: E402
from hicache_l3.common.memory import MemoryRegion  # noqa: E402
from hicache_l3.common.pages import PointerPages  # noqa: E402
from hicache_l3.sglang.config import extra_config_for  # noqa: E402
from hicache_l3.slab.format import Geometry  # noqa: E402

# SGLang itself is imported where it is used, so that --help runs without it (in .venv).
BATCH = 128  # SGLang's STORAGE_BATCH_SIZE: the pages of one controller call (checked in main)
PAGE_TOKENS = 16
HEADS, HEAD_DIM = 4, 64  # bf16: 2 * layers * 16 * 4 * 64 * 2 B per page (64 KiB for 4 layers)


FIRST_TOUCH_PROBE = 64 << 20  # bytes of new anonymous memory whose first touch is timed
_PAGE = mmap.PAGESIZE


def touch_new_memory(nbytes: int) -> float:
    """Map ``nbytes`` of new anonymous memory, write one byte in each of its pages, unmap
    it; seconds the writes took."""
    area = mmap.mmap(-1, nbytes)
    try:
        start = time.perf_counter()
        for off in range(0, nbytes, _PAGE):
            area[off] = 1
        return time.perf_counter() - start
    finally:
        area.close()


class StandIn:
    """What the controller methods touch: the host pool, the backend, the page size."""

    def __init__(self, host: Any, backend: Any) -> None:
        self.storage_host_pool = host
        self.mem_pool_host = host
        self.storage_backend = backend
        self.page_size = host.page_size


class Operation:
    """The prefetch operation the get paths receive (never terminated here)."""

    request_id = "bench"

    def is_terminated(self) -> bool:
        """Never."""
        return False


def host_pool(pages: int, layers: int = 4) -> Any:
    """A real SGLang MHA host pool on CPU with room for ``pages`` pages (plus padding) of a
    model with ``layers`` layers (16 KiB per layer and page)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = pages * PAGE_TOKENS
    dev = MHATokenToKVPool(size=tokens, page_size=PAGE_TOKENS, dtype=torch.bfloat16, head_num=HEADS,
                           head_dim=HEAD_DIM, layer_num=layers, device="cpu", enable_memory_saver=False,
                           start_layer=0, end_layer=layers - 1)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, host_to_device_ratio=1.0, host_size=0, page_size=PAGE_TOKENS,
                                layout="page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=layers - 1)
    del dev
    return host


def storage_config(extra: dict[str, Any]) -> Any:
    """The storage config SGLang's controller builds for a single-rank MHA model."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="bench/model",
        extra_config=extra,
    )


def batches(keys: list[str], indices: torch.Tensor) -> list[tuple[list[str], torch.Tensor]]:
    """The 128-page batches the controller sends."""
    out = []
    for lo in range(0, len(keys), BATCH):
        ks = keys[lo : lo + BATCH]
        out.append((ks, indices[lo * PAGE_TOKENS : (lo + len(ks)) * PAGE_TOKENS]))
    return out


def page_view(host: Any, pages: int) -> torch.Tensor:
    """Pool pages 1..pages (K and V halves of ``page_first``), as a view of kv_buffer."""
    view: torch.Tensor = host.kv_buffer[:, PAGE_TOKENS : (pages + 1) * PAGE_TOKENS]
    return view


def as_bytes(view: torch.Tensor) -> torch.Tensor:
    """A byte copy of a (strided) view, for exact comparison."""
    return view.contiguous().view(-1).view(torch.uint8)


def run_one(name: str, standin: StandIn, zero_copy: bool, keys: list[str], indices: torch.Tensor,
            expected: torch.Tensor, idle_s: float = 0.0) -> dict[str, float]:
    """Time set then get of every page through the controller method of this backend kind
    (``idle_s`` of sleep between them, off the clock)."""
    from sglang.srt.managers.cache_controller import HiCacheController

    host = standin.storage_host_pool
    pages = page_view(host, len(keys))
    work = batches(keys, indices)
    set_fn = HiCacheController._page_set_zero_copy if zero_copy else HiCacheController._generic_page_set
    get_fn = HiCacheController._page_get_zero_copy if zero_copy else HiCacheController._generic_page_get
    op = Operation()
    t0 = time.perf_counter()
    for ks, idx in work:
        if not set_fn(standin, ks, idx):
            raise RuntimeError(f"{name}: set of a batch failed")
    t_set = time.perf_counter() - t0
    pages.zero_()
    time.sleep(idle_s)
    t0 = time.perf_counter()
    for ks, idx in work:
        got = get_fn(standin, op, ks, idx)
        if got != len(ks):
            raise RuntimeError(f"{name}: get returned {got} of {len(ks)} pages")
    t_get = time.perf_counter() - t0
    if not torch.equal(as_bytes(pages), expected):
        raise RuntimeError(f"{name}: bytes read back differ from the bytes written")
    return {"set_s": t_set, "get_s": t_get}


# ---- raw pwritev / preadv of SGLang's own page pointers ------------------------------------
class RawContender:
    """``raw-1t``, ``raw-2t`` (batches dealt round-robin to two threads) or ``raw-2t-batch``
    (each batch in two halves on two threads): the bench's ``RawPosixBatch`` over the page
    pointers SGLang's host pool gives, one call per 128-page batch planned before any clock."""

    def __init__(self, work: str, host: Any, indices: torch.Tensor, pages: int, page_bytes: int,
                 threads: int, per_batch: bool = False) -> None:
        self.name = f"raw-{threads}t" + ("-batch" if per_batch else "")
        self.total = pages * page_bytes
        self.dir = work
        self.fresh: list[str] = []  # the fresh files written so far (kept until close)
        self.target = RawPosixBatch(Path(work, f"{self.name}-overwrite"), self.total,
                                    parts=threads if per_batch else 1)
        self.target.prepare([MemoryRegion.from_tensor(host.kv_buffer)], page_bytes)
        ptrs, sizes = host.get_page_buffer_meta(indices)
        meta = PointerPages(ptrs, sizes, len(ptrs) // pages)
        self.plans = [self.target.plan_at(meta[lo : lo + BATCH], lo * page_bytes)
                      for lo in range(0, pages, BATCH)]
        self.shares = 1 if per_batch else threads  # batches in flight at once
        self.pool = ThreadPoolExecutor(threads) if self.shares > 1 else None

    def _all(self, op: str, fd: int) -> None:
        """Every batch into or from ``fd``, in order on the caller or dealt round-robin."""
        def share(plans: list[Any]) -> None:
            for plan in plans:
                self.target.move(op, fd, plan)

        if self.pool is None:
            share(self.plans)
            return
        for future in [self.pool.submit(share, self.plans[t :: self.shares]) for t in range(self.shares)]:
            future.result()

    def run(self, pages: torch.Tensor, expected: torch.Tensor, rep: int,
            idle_s: float = 0.0) -> dict[str, float]:
        """Time set into a fresh fallocated file (kept until :meth:`close`, as a growing store
        keeps its slabs), set over the overwrite file, then get (after ``idle_s``, off the clock)."""
        fresh = os.path.join(self.dir, f"{self.name}-fresh-{rep}")
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.fresh.append(fresh)
        try:
            os.posix_fallocate(fd, 0, self.total)
            t0 = time.perf_counter()
            self._all("set", fd)
            t_fresh = time.perf_counter() - t0
        finally:
            os.close(fd)
        t0 = time.perf_counter()
        self._all("set", self.target.fd)
        t_set = time.perf_counter() - t0
        pages.zero_()
        time.sleep(idle_s)
        t0 = time.perf_counter()
        self._all("get", self.target.fd)
        t_get = time.perf_counter() - t0
        if not torch.equal(as_bytes(pages), expected):
            raise RuntimeError(f"{self.name}: bytes read back differ from the bytes written")
        return {"set_s": t_set, "set_fresh_s": t_fresh, "get_s": t_get}

    def close(self) -> None:
        """Close the files and the threads, remove the fresh files."""
        self.target.close()
        for path in self.fresh:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self.fresh.clear()
        if self.pool is not None:
            self.pool.shutdown()


# ---- per-stage breakdown (timers wrapped around our path's stages, by this script only) -------
STAGES = ("controller", "sglang pointer lists", "adapter", "validation", "planning", "io",
          "index commit", "metrics")


class StageTimer:
    """Exclusive nanoseconds per stage: a wrapped call's time minus its wrapped callees'.

    Only calls made on the benchmark's thread are wrapped (the connector's I/O threads run
    inside the ``io`` stage)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self._stack: list[list[int]] = []
        self._undo: list[Callable[[], None]] = []

    def timed(self, fn: Callable[..., Any], stage: str) -> Callable[..., Any]:
        """``fn`` with its exclusive time added to ``stage``."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            self._stack.append([0])
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter_ns() - t0
                self.ns[stage] += elapsed - self._stack.pop()[0]
                if self._stack:
                    self._stack[-1][0] += elapsed
        return wrapper

    def wrap(self, obj: Any, name: str, stage: str) -> None:
        """Replace ``obj.name`` (on the instance) by its timed version until :meth:`undo`."""
        had = name in vars(obj)
        old = vars(obj).get(name)
        setattr(obj, name, self.timed(getattr(obj, name), stage))
        self._undo.append(lambda: setattr(obj, name, old) if had else delattr(obj, name))

    def undo(self) -> None:
        """Remove every wrapper."""
        while self._undo:
            self._undo.pop()()


def stage_breakdown(standin: StandIn, keys: list[str], indices: torch.Tensor) -> dict[str, dict[str, float]]:
    """One set and one get pass of our path with stage timers: ms per 1024 pages per stage."""
    from sglang.srt.managers.cache_controller import HiCacheController

    backend = standin.storage_backend
    connector = backend.connector
    store = connector._store_for_io()
    timer = StageTimer()
    wraps = [(standin.storage_host_pool, "get_page_buffer_meta", "sglang pointer lists"),
             (backend, "batch_set_v1", "adapter"), (backend, "batch_get_v1", "adapter"),
             (backend, "_zero_copy", "adapter"), (backend, "_pages", "adapter"),
             (backend, "_record", "metrics"),
             (connector, "batch_set", "validation"), (connector, "batch_get", "validation"),
             (connector, "_transfer", "validation"), (connector.metrics, "observe", "metrics"),
             (connector, "_set", "planning"), (connector, "_get", "planning"),
             (connector.transport, "write", "io"), (connector.transport, "read", "io"),
             (store, "commit", "index commit"), (store, "touch", "index commit")]
    if getattr(connector.transport, "reads_plans", False):  # the planned get (slab/plan.py)
        wraps.append((connector.transport, "read_plan", "io"))
    if hasattr(store, "touch_columns"):  # the planned get's LRU touch
        wraps.append((store, "touch_columns", "index commit"))
    out: dict[str, dict[str, float]] = {}
    scale = 1024 / len(keys) / 1e6
    try:
        for obj, name, stage in wraps:
            timer.wrap(obj, name, stage)
        op = Operation()
        set_fn = timer.timed(HiCacheController._page_set_zero_copy, "controller")
        get_fn = timer.timed(HiCacheController._page_get_zero_copy, "controller")
        work = batches(keys, indices)
        t0 = time.perf_counter_ns()
        for ks, idx in work:
            if not set_fn(standin, ks, idx):
                raise RuntimeError("stage pass: set of a batch failed")
        wall = time.perf_counter_ns() - t0
        out["set"] = {st: timer.ns.get(st, 0) * scale for st in STAGES} | {"total": wall * scale}
        timer.ns.clear()
        t0 = time.perf_counter_ns()
        for ks, idx in work:
            if get_fn(standin, op, ks, idx) != len(ks):
                raise RuntimeError("stage pass: get missed pages")
        wall = time.perf_counter_ns() - t0
        out["get"] = {st: timer.ns.get(st, 0) * scale for st in STAGES} | {"total": wall * scale}
    finally:
        timer.undo()
    return out


def print_stages(name: str, stages: dict[str, dict[str, float]]) -> None:
    """The breakdown as a small table (ms per 1024 pages, exclusive per stage)."""
    print(f"stages of {name} (ms per 1024 pages, exclusive; one instrumented pass):", file=sys.stderr)
    print(f"  {'stage':<22}{'set':>9}{'get':>9}", file=sys.stderr)
    for st in (*STAGES, "total"):
        print(f"  {st:<22}{stages['set'][st]:>9.2f}{stages['get'][st]:>9.2f}", file=sys.stderr)


# ---- --beyond-memory: a store several times the page cache, random gets from the device ------
BODIES = 64  # distinct page bodies: page i is body i % BODIES with i stamped in its first values
BEYOND_SLACK = 256 << 20  # the cgroup's limit beyond --beyond-cache: this process's own allocations


class StampedPages:
    """Page ``i`` of a beyond-memory store: body ``i % BODIES`` (random 16-bit values of one
    pool page's shape) with ``i`` in its first four values, so any page read back is checked."""

    def __init__(self, host: Any) -> None:
        shape = page_view(host, 1).shape
        gen = torch.Generator().manual_seed(0xB1660)
        self.bodies = [torch.randint(-32768, 32767, shape, generator=gen, dtype=torch.int16)
                       for _ in range(BODIES)]

    def page(self, i: int) -> torch.Tensor:
        """Page ``i`` (a new tensor of the pool page's shape)."""
        page = self.bodies[i % BODIES].clone()
        page.view(-1)[:4] = torch.tensor([(i >> (15 * k)) & 0x7FFF for k in range(4)], dtype=torch.int16)
        return page

    def stamp(self, host: Any, ids: list[int]) -> None:
        """Pages ``ids`` into pool pages 1..len(ids)."""
        view = page_view(host, len(ids)).view(torch.int16)
        for j, i in enumerate(ids):
            view[:, j * PAGE_TOKENS : (j + 1) * PAGE_TOKENS] = self.page(i)

    def check(self, host: Any, ids: list[int], what: str) -> None:
        """RuntimeError unless pool pages 1..len(ids) hold pages ``ids``."""
        view = page_view(host, len(ids)).view(torch.int16)
        for j, i in enumerate(ids):
            if not torch.equal(view[:, j * PAGE_TOKENS : (j + 1) * PAGE_TOKENS], self.page(i)):
                raise RuntimeError(f"{what}: page {i} came back with other bytes")

    def check_flat(self, views: list[memoryview], ids: list[int], what: str) -> None:
        """RuntimeError unless ``views`` hold pages ``ids`` as contiguous bytes."""
        for view, i in zip(views, ids):
            if view != as_bytes(self.page(i)).numpy().tobytes():
                raise RuntimeError(f"{what}: page {i} came back with other bytes")


Batch = Callable[[list[int]], bool]


def beyond_memory(args: argparse.Namespace, host: Any, work: str, open_ours: Callable[..., Any],
                  page_bytes: int, cpu: dict[str, Any]) -> dict[str, Any]:
    """Ours through the controller (buffered and ``o_direct``) on stores of ``--beyond-store``
    bytes while this process may keep ``--beyond-cache`` of page cache (a memory cgroup it
    joins, when it can make one), against raw O_DIRECT random blocks of the page size from 16
    threads on a file of the same size (and fio when installed): random 128-page gets over the
    whole store, then evicting sets of fresh keys, interleaved; every page read verified.
    Prints the report (hicache-l3 bench --beyond-memory's format) and returns it."""
    from sglang.srt.managers.cache_controller import HiCacheController

    from hicache_l3.bench import memcg
    from hicache_l3.bench.beyond import (
        H100_LLAMA31_8B_PREFILL_TOKENS_PER_S,
        LLAMA31_8B_KV_BYTES_PER_TOKEN,
        break_even_gb_s,
        contender_rows,
        format_report,
    )
    from hicache_l3.bench.raw_direct import RawDirect, fio_available, fio_round
    from hicache_l3.bench.runner import drop_page_cache
    from hicache_l3.common.memory import HostBuffer
    from hicache_l3.slab.auto_direct import memory_total

    limit = args.beyond_cache + BEYOND_SLACK
    cgroup, why = memcg.create(limit, f"hicache-l3-sgbench-{os.getpid()}")
    store_bytes = args.beyond_store or (4 * limit if cgroup else 2 * memory_total())
    pages = max(BATCH, store_bytes // page_bytes)
    capacity = pages * Geometry(page_bytes).stride
    stamps = StampedPages(host)
    indices = torch.arange(PAGE_TOKENS, (BATCH + 1) * PAGE_TOKENS, dtype=torch.int64)
    op = Operation()
    raw = RawDirect(Path(work, "raw-direct.dat"), pages, page_bytes, threads=16)
    raw_buf = HostBuffer(BATCH * page_bytes, pin=False)
    raw_views = [raw_buf.view()[j * page_bytes : (j + 1) * page_bytes] for j in range(BATCH)]
    ours = {"hicache-l3-file": open_ours("beyond-buffered", capacity_bytes=capacity),
            "hicache-l3-file+o_direct": open_ours("beyond-direct", capacity_bytes=capacity, o_direct=True)}

    def keys(ids: list[int]) -> list[str]:
        return [f"beyond-{i:011d}" for i in ids]

    def our_pair(standin: Any) -> tuple[Batch, Batch]:
        def get(ids: list[int]) -> bool:
            at = indices[: len(ids) * PAGE_TOKENS]
            return bool(HiCacheController._page_get_zero_copy(standin, op, keys(ids), at) == len(ids))

        def put(ids: list[int]) -> bool:
            at = indices[: len(ids) * PAGE_TOKENS]
            return bool(HiCacheController._page_set_zero_copy(standin, keys(ids), at))
        return get, put

    def raw_stamp(ids: list[int]) -> None:  # off the clock, as the pool's stamping is for ours
        for view, i in zip(raw_views, ids):
            view[:] = as_bytes(stamps.page(i)).numpy().tobytes()

    def raw_put(ids: list[int]) -> bool:
        return raw.move("set", [i % pages for i in ids], raw_views[: len(ids)])

    contenders: dict[str, tuple[Batch, Batch]] = {name: our_pair(s) for name, s in ours.items()}
    contenders["raw-direct-16t"] = (lambda ids: raw.move("get", ids, raw_views[: len(ids)]), raw_put)
    lat: dict[str, dict[str, list[float]]] = {name: {"get": [], "set": []} for name in contenders}
    fio_figures: dict[tuple[str, str], list[dict[str, Any]]] = {}
    rng = random.Random(0xB1660)
    try:
        if cgroup:
            memcg.join(cgroup)  # after the pools and buffers: their memory is not the page cache's
        else:
            print(f"no memory cgroup ({why}): the store is 2x the machine's memory", file=sys.stderr)
        print(f"filling {len(contenders)} stores of {pages:,} pages of {page_bytes >> 10} KiB "
              f"({pages * page_bytes / 2**30:.2f} GiB each)", file=sys.stderr)
        for lo in range(0, pages, BATCH):
            ids = list(range(lo, min(pages, lo + BATCH)))
            stamps.stamp(host, ids)
            raw_stamp(ids)
            for name, (_, put) in contenders.items():
                if not put(ids):
                    raise RuntimeError(f"{name}: filling pages {lo}.. failed")
        os.sync()
        drop_page_cache(Path(work))
        fresh = pages
        for what in ("get", "set"):
            for r in range(args.reps):
                names = list(contenders)
                names = names[r % len(names):] + names[: r % len(names)]
                for b in range(args.beyond_batches):
                    if what == "get":
                        ids = [rng.randrange(pages) for _ in range(BATCH)]
                    else:
                        ids = list(range(fresh, fresh + BATCH))
                        fresh += BATCH
                    for name in names if b % 2 == 0 else names[::-1]:
                        get, put = contenders[name]
                        if what == "get":
                            page_view(host, BATCH).zero_()
                        else:
                            if name in ours:
                                stamps.stamp(host, ids)
                            else:
                                raw_stamp(ids)
                        t0 = time.perf_counter()
                        ok = get(ids) if what == "get" else put(ids)
                        lat[name][what].append(time.perf_counter() - t0)
                        if not ok:
                            raise RuntimeError(f"{name}: a {what} batch failed")
                        if what == "get" and name in ours:
                            stamps.check(host, ids, f"{name} get")
                        elif what == "get":
                            stamps.check_flat(raw_views, ids, f"{name} get")
                if fio_available():
                    fio_round(raw.path, pages * page_bytes, page_bytes, what, 2.0, fio_figures)
        fallback = {name: s.storage_backend.connector.stats()["ops"]["counters"].get("direct_fallback", 0)
                    for name, s in ours.items()}
    finally:
        raw.close()
        if cgroup:
            memcg.join(cgroup.parent)  # back out, so that the cgroup can go
            memcg.remove(cgroup)
    results = contender_rows(lat, BATCH * page_bytes, fio_figures, "raw-direct-16t")
    even = break_even_gb_s(LLAMA31_8B_KV_BYTES_PER_TOKEN, H100_LLAMA31_8B_PREFILL_TOKENS_PER_S)
    meta = {"cpu": cpu, "store_bytes": pages * page_bytes, "pages": pages, "page_bytes": page_bytes,
            "cache_bytes": limit, "cgroup": bool(cgroup), "cgroup_why_not": why,
            "memory_bytes": memory_total(), "batch": BATCH, "rounds": args.reps, "raw_threads": 16,
            "kv_bytes_per_token": LLAMA31_8B_KV_BYTES_PER_TOKEN,
            "prefill_tokens_per_s": H100_LLAMA31_8B_PREFILL_TOKENS_PER_S, "break_even_gb_s": even,
            "path": "HiCacheController._page_get_zero_copy / _page_set_zero_copy",
            "direct_fallback": fallback}
    report = {"meta": meta, "results": results}
    print(format_report(report), file=sys.stderr)
    print(f"pages the o_direct store moved through the page cache (pool segments not 4 KiB-aligned): "
          f"{fallback}", file=sys.stderr)
    return report


# ---- the run -----------------------------------------------------------------------------------
def fresh_keys(tag: str, pages: int) -> list[str]:
    """Keys no earlier repetition used."""
    return [hashlib.sha256(f"{tag}-{i}-{time.time_ns()}".encode()).hexdigest() for i in range(pages)]


def ratio_values(rows: list[dict[str, Any]], num: str, den: str) -> list[float]:
    """``row[num] / row[den]`` of every repetition that has both: with times, ``den``'s speed
    over ``num``'s."""
    return [r[num] / r[den] for r in rows if num in r and den in r]


def median_ratio(rows: list[dict[str, Any]], num: str, den: str) -> float | None:
    """Median over repetitions of :func:`ratio_values`; None when no row has both."""
    values = ratio_values(rows, num, den)
    return statistics.median(values) if values else None


def main() -> int:
    """Run the comparison; print tables (and a JSON line with --json)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1024, help="pages each contender sets and gets a repetition")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (fresh keys and bytes each)")
    ap.add_argument("--layers", type=int, default=4,
                    help="model layers: page bytes = layers x 16 KiB (4: 64 KiB, 64: 1 MiB)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (every contender)")
    ap.add_argument("--workdir", default=None,
                    help="directory for every contender's files (default: a temp dir)")
    ap.add_argument("--steady-state", action="store_true",
                    help="also run our connector at capacity (capacity_bytes = --pages slots), "
                         "so every set reuses an evicted slot")
    ap.add_argument("--no-checksum", action="store_true",
                    help="also run our connector with checksum=none (hicache-l3-file-nocsum, a fresh "
                         "store): what the XXH3 of every page costs on this machine")
    ap.add_argument("--no-raw", action="store_true", help="skip the raw pwritev/preadv contenders")
    ap.add_argument("--no-stages", action="store_true", help="skip the per-stage breakdown")
    ap.add_argument("--sglang-pointers", action="store_true",
                    help="our backend asks SGLang's get_page_buffer_meta for every batch's pointer "
                         "lists (the reference path) instead of its learned pointer model")
    ap.add_argument("--idle-ms", type=float, default=0.0,
                    help="sleep this long between each contender's set and its get, off the clock "
                         "(a server's get comes after idle time: threads asleep, caches cold)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    ap.add_argument("--beyond-memory", action="store_true",
                    help="instead: ours (buffered and o_direct) on a store several times the page cache "
                         "this process may use (a memory cgroup; needs root), random 128-page gets over "
                         "the whole store and evicting sets through the controller, against raw O_DIRECT "
                         "(16 threads) and fio; --reps rounds of --beyond-batches batches each")
    ap.add_argument("--beyond-store", type=size_arg, default=0,
                    help="--beyond-memory: bytes of pages per store (default: 4x the cgroup's limit; "
                         "without a cgroup, 2x the machine's memory)")
    ap.add_argument("--beyond-cache", type=size_arg, default=512 << 20,
                    help="--beyond-memory: the page cache this process may use (default 512MiB); the "
                         "cgroup's limit adds 256MiB for the process's own allocations and dirty pages")
    ap.add_argument("--beyond-batches", type=int, default=32,
                    help="--beyond-memory: timed batches per contender, op and round (default 32)")
    args = ap.parse_args()
    if args.pages < 1 or args.reps < 1 or args.warmup < 0 or args.layers < 1:
        ap.error("--pages, --reps and --layers must be >= 1, --warmup >= 0")
    if args.steady_state and args.warmup < 1:
        ap.error("--steady-state needs --warmup >= 1 (the warm-up fills the store to capacity)")
    if args.beyond_memory and (args.beyond_batches < 1 or args.beyond_cache < (64 << 20)):
        ap.error("--beyond-batches must be >= 1 and --beyond-cache at least 64MiB")

    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    if STORAGE_BATCH_SIZE != BATCH:
        raise SystemExit(f"SGLang's STORAGE_BATCH_SIZE is {STORAGE_BATCH_SIZE}, this script's BATCH {BATCH}")
    cpu = cpu_info()
    print(describe_cpu(cpu), file=sys.stderr)
    first_touch = FIRST_TOUCH_PROBE / max(touch_new_memory(FIRST_TOUCH_PROBE), 1e-9) / 1e9
    print(f"guest memory, first touch: {first_touch:.2f} GB/s (every fresh-store set, ours and raw's, "
          "writes into page-cache memory the run has not used yet)", file=sys.stderr)
    work = tempfile.mkdtemp(prefix="hicache-l3-sgbench-", dir=args.workdir)
    host = host_pool(args.pages, args.layers)
    page_bytes = host.get_size_per_token() * PAGE_TOKENS
    # Pages 1..pages of the pool (page 0 is SGLang's padding page); contiguous, as after a backup.
    indices = torch.arange(PAGE_TOKENS, (args.pages + 1) * PAGE_TOKENS, dtype=torch.int64)
    sglang_file = StorageBackendFactory.create_backend(
        "file", storage_config({"file_storage_path": os.path.join(work, "sglang-file")}), host)
    sglang_file.register_mem_pool_host(host)
    ours: dict[str, Any] = {}

    def open_ours(name: str, **settings: Any) -> StandIn:
        root = {"root": os.path.join(work, name), **settings}
        backend = StorageBackendFactory.create_backend(
            "dynamic", storage_config(extra_config_for("file", root)), host)
        backend.register_mem_pool_host(host)
        backend.on_host_pools_registered()
        if args.sglang_pointers:
            backend.pointer_model = None
        ours[name] = backend
        return StandIn(host, backend)

    if args.beyond_memory:
        try:
            report = beyond_memory(args, host, work, open_ours, page_bytes, cpu)
        finally:
            for backend in ours.values():
                backend.close()
            shutil.rmtree(work, ignore_errors=True)
        if args.json:
            print(json.dumps(report))
        return 0
    contenders: list[tuple[str, Any]] = [("sglang-file", (StandIn(host, sglang_file), False)),
                                         ("hicache-l3-file", (open_ours("hicache-l3-file"), True))]
    if args.steady_state:
        capacity = args.pages * Geometry(page_bytes).stride
        contenders.append(("hicache-l3-file-steady",
                           (open_ours("hicache-l3-file-steady", capacity_bytes=capacity), True)))
    if args.no_checksum:
        nocsum = open_ours("hicache-l3-file-nocsum", checksum="none")
        contenders.append(("hicache-l3-file-nocsum", (nocsum, True)))
    raws: list[RawContender] = []
    rows: list[dict[str, Any]] = []
    stages: dict[str, Any] = {}
    evictions: dict[str, int] = {}
    pointer_models = {name: repr(backend.pointer_model) for name, backend in ours.items()}
    try:
        if not args.no_raw:
            for threads, per_batch in ((1, False), (2, False), (2, True)):
                raw = RawContender(work, host, indices, args.pages, page_bytes, threads, per_batch)
                raws.append(raw)
                contenders.append((raw.name, raw))
        gb = args.pages * page_bytes / 1e9
        for rep in range(-args.warmup, args.reps):
            row: dict[str, Any] = {"rep": rep}
            shift = rep % len(contenders)
            for name, what in contenders[shift:] + contenders[:shift]:
                os.sync()  # the previous contender's dirty pages written back off the clock
                host.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
                expected = as_bytes(page_view(host, args.pages))
                if isinstance(what, RawContender):
                    times = what.run(page_view(host, args.pages), expected, rep, args.idle_ms / 1e3)
                else:
                    standin, zero_copy = what
                    times = run_one(name, standin, zero_copy, fresh_keys(f"{name}-{rep}", args.pages),
                                    indices, expected, args.idle_ms / 1e3)
                for k, v in times.items():
                    row[f"{name}:{k}"] = v
            if rep < 0:
                continue  # warm-up: first files, slabs and directories; fills the steady store
            rows.append(row)
            print(f"rep {rep}: " + "; ".join(
                f"{name} set {gb / row[name + ':set_s']:.2f}"
                + (f" (fresh {gb / row[name + ':set_fresh_s']:.2f})" if name + ":set_fresh_s" in row else "")
                + f" get {gb / row[name + ':get_s']:.2f}" for name, _ in contenders) + " GB/s",
                file=sys.stderr)
        if not args.no_stages:
            for name, backend in ours.items():
                keys = fresh_keys(f"{name}-stages", args.pages)
                stages[name] = stage_breakdown(StandIn(host, backend), keys, indices)
        evictions = {name: backend.connector._store_for_io().evictions for name, backend in ours.items()}
    finally:
        for raw in raws:
            raw.close()
        for backend in ours.values():
            backend.close()
        shutil.rmtree(work, ignore_errors=True)

    medians = {f"{name}:{k}": statistics.median(r[f"{name}:{k}"] for r in rows)
               for name, _ in contenders for k in ("set_s", "set_fresh_s", "get_s")
               if f"{name}:{k}" in rows[0]}
    # ratios: time of the other / time of ours = our speed / the other's speed (> 1: ours faster)
    pairs: dict[str, tuple[str, str]] = {
        "set_vs_sglang": ("sglang-file:set_s", "hicache-l3-file:set_s"),
        "get_vs_sglang": ("sglang-file:get_s", "hicache-l3-file:get_s"),
    }
    for rn in (r.name for r in raws):
        pairs[f"set_vs_{rn}_fresh"] = (f"{rn}:set_fresh_s", "hicache-l3-file:set_s")
        pairs[f"get_vs_{rn}"] = (f"{rn}:get_s", "hicache-l3-file:get_s")
        if args.no_checksum:
            pairs[f"nocsum_set_vs_{rn}_fresh"] = (f"{rn}:set_fresh_s", "hicache-l3-file-nocsum:set_s")
            pairs[f"nocsum_get_vs_{rn}"] = (f"{rn}:get_s", "hicache-l3-file-nocsum:get_s")
        if args.steady_state:
            pairs[f"steady_set_vs_{rn}_overwrite"] = (f"{rn}:set_s", "hicache-l3-file-steady:set_s")
            pairs[f"steady_get_vs_{rn}"] = (f"{rn}:get_s", "hicache-l3-file-steady:get_s")
    ratios = {key: median_ratio(rows, *pair) for key, pair in pairs.items()}
    # the spread of each ratio over the repetitions: a median near a target says little alone
    spreads = {key: [min(values), max(values)] if (values := ratio_values(rows, *pair)) else None
               for key, pair in pairs.items()}

    print(f"\nmedians over {args.reps} reps of {args.pages} x {page_bytes // 1024} KiB pages, "
          f"batches of {BATCH}, {describe_cpu(cpu)}", file=sys.stderr)
    print(f"  {'contender':<24}{'set GB/s':>10}{'fresh set':>11}{'get GB/s':>10}", file=sys.stderr)
    for name, _ in contenders:
        fresh = medians.get(f"{name}:set_fresh_s")
        print(f"  {name:<24}{gb / medians[name + ':set_s']:>10.2f}"
              f"{'' if fresh is None else f'{gb / fresh:.2f}':>11}{gb / medians[name + ':get_s']:>10.2f}",
              file=sys.stderr)
    print(f"slots reused by eviction: {evictions}", file=sys.stderr)
    print(f"pointer lists: {pointer_models} (None: SGLang's get_page_buffer_meta)", file=sys.stderr)
    print("ratios (median of per-rep ratios, our speed / theirs; the lowest and highest rep):",
          file=sys.stderr)
    width = max(map(len, ratios), default=0) + 2
    for key, value in ratios.items():
        spread = spreads[key]
        print(f"  {key:<{width}}{'-' if value is None else f'{value:.2f}'}"
              f"{'' if spread is None else f'  ({spread[0]:.2f}-{spread[1]:.2f})'}", file=sys.stderr)
    for name, st in stages.items():
        print_stages(name, st)
    summary = {
        "pages": args.pages, "page_bytes": page_bytes, "reps": args.reps, "layout": "page_first",
        "warmup": args.warmup, "batch_pages": BATCH, "verified": True, "cpu": cpu,
        "steady_state": args.steady_state, "idle_ms": args.idle_ms, "first_touch_gbps": first_touch,
        "set_ratio_median": ratios["set_vs_sglang"], "get_ratio_median": ratios["get_vs_sglang"],
        "ratios": ratios, "ratio_spreads": spreads, "median_s": medians, "evictions": evictions,
        "pointer_models": pointer_models,
        "stages_ms_per_1024_pages": stages, "rows": rows,
    }
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
