"""SGLang's in-tree ``file`` backend vs hicache-l3's file connector, driven the way SGLang's
HiCacheController drives them. Run with the SGLang venv::

    .venv-sglang/bin/python benchmarks/sglang_controller.py [--pages 1024] [--reps 5] [--json]

One real MHA host pool (CPU, ``page_first``, 64 KiB pages). SGLang's ``file`` backend
(``HiCacheFile``, as ``--hicache-storage-backend file`` builds it) is called through
``HiCacheController._generic_page_set`` / ``_generic_page_get`` and ours (the ``dynamic``
backend with ``interface_v1``) through ``_page_set_zero_copy`` / ``_page_get_zero_copy``:
the controller's own methods, called on a stand-in object holding the real host pool and
backend, in batches of SGLang's STORAGE_BATCH_SIZE (128) pages as its backup and prefetch
threads send them. Every repetition uses fresh keys and fresh random page bytes, runs the
two backends one after the other (alternating which goes first), zeroes the pages between
set and get, and verifies the bytes read back. One untimed warm-up repetition of both
comes first (``--warmup``). Reported: per repetition the time and GB/s
of each, the ratio SGLang-time / ours, and the median ratio for set and for get.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from hicache_l3.sglang.config import extra_config_for  # noqa: E402

PAGE_TOKENS = 16
LAYERS, HEADS, HEAD_DIM = 4, 4, 64  # bf16: 2 * 4 * 16 * 4 * 64 * 2 B = 64 KiB per page


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


def host_pool(pages: int) -> Any:
    """A real SGLang MHA host pool on CPU with room for ``pages`` pages (plus padding)."""
    tokens = pages * PAGE_TOKENS
    dev = MHATokenToKVPool(size=tokens, page_size=PAGE_TOKENS, dtype=torch.bfloat16, head_num=HEADS,
                           head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                           start_layer=0, end_layer=LAYERS - 1)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = MHATokenToKVPoolHost(info, host_to_device_ratio=1.0, host_size=0, page_size=PAGE_TOKENS,
                                layout="page_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0, end_layer=LAYERS - 1)
    del dev
    return host


def storage_config(extra: dict[str, Any]) -> HiCacheStorageConfig:
    """The storage config SGLang's controller builds for a single-rank MHA model."""
    return HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
        enable_storage_metrics=False, is_page_first_layout=True, model_name="bench/model",
        extra_config=extra,
    )


def batches(keys: list[str], indices: torch.Tensor) -> list[tuple[list[str], torch.Tensor]]:
    """The 128-page batches the controller sends."""
    out = []
    for lo in range(0, len(keys), STORAGE_BATCH_SIZE):
        ks = keys[lo : lo + STORAGE_BATCH_SIZE]
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
            expected: torch.Tensor) -> dict[str, float]:
    """Time set then get of every page through the controller method of this backend kind."""
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
    t0 = time.perf_counter()
    for ks, idx in work:
        got = get_fn(standin, op, ks, idx)
        if got != len(ks):
            raise RuntimeError(f"{name}: get returned {got} of {len(ks)} pages")
    t_get = time.perf_counter() - t0
    if not torch.equal(as_bytes(pages), expected):
        raise RuntimeError(f"{name}: bytes read back differ from the bytes written")
    return {"set_s": t_set, "get_s": t_get}


def main() -> int:
    """Run the comparison; print a table (and a JSON line with --json)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions first (both backends)")
    ap.add_argument("--workdir", default=None,
                    help="directory for both backends' files (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print a JSON summary as the last line")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="hicache-l3-sgbench-", dir=args.workdir)
    host = host_pool(args.pages)
    page_bytes = host.get_size_per_token() * PAGE_TOKENS
    # Pages 1..pages of the pool (page 0 is SGLang's padding page); contiguous, as after a backup.
    indices = torch.arange(PAGE_TOKENS, (args.pages + 1) * PAGE_TOKENS, dtype=torch.int64)
    sglang_file = StorageBackendFactory.create_backend(
        "file", storage_config({"file_storage_path": os.path.join(work, "sglang-file")}), host)
    sglang_file.register_mem_pool_host(host)
    ours = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config_for("file", {"root": os.path.join(work, "hicache-l3")})), host)
    ours.register_mem_pool_host(host)
    ours.on_host_pools_registered()
    contenders = [("sglang-file", StandIn(host, sglang_file), False),
                  ("hicache-l3-file", StandIn(host, ours), True)]
    rows: list[dict[str, Any]] = []
    try:
        for rep in range(-args.warmup, args.reps):
            times: dict[str, dict[str, float]] = {}
            order = contenders if rep % 2 == 0 else contenders[::-1]
            for name, standin, zero_copy in order:
                keys = [hashlib.sha256(f"{name}-{rep}-{i}-{time.time_ns()}".encode()).hexdigest()
                        for i in range(args.pages)]
                host.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
                expected = as_bytes(page_view(host, args.pages))
                times[name] = run_one(name, standin, zero_copy, keys, indices, expected)
            if rep < 0:
                continue  # warm-up: first files, slabs and directories of both backends
            s, o = times["sglang-file"], times["hicache-l3-file"]
            row = {"rep": rep, "sglang_set_s": s["set_s"], "ours_set_s": o["set_s"],
                   "sglang_get_s": s["get_s"], "ours_get_s": o["get_s"],
                   "set_ratio": s["set_s"] / o["set_s"], "get_ratio": s["get_s"] / o["get_s"]}
            rows.append(row)
            gb = args.pages * page_bytes / 1e9
            print(f"rep {rep}: set sglang {gb / s['set_s']:.2f} GB/s, ours {gb / o['set_s']:.2f} GB/s "
                  f"(x{row['set_ratio']:.1f}); get sglang {gb / s['get_s']:.2f} GB/s, ours "
                  f"{gb / o['get_s']:.2f} GB/s (x{row['get_ratio']:.1f})", file=sys.stderr)
    finally:
        ours.close()
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        "pages": args.pages, "page_bytes": page_bytes, "reps": args.reps, "layout": "page_first",
        "warmup": args.warmup, "batch_pages": STORAGE_BATCH_SIZE, "verified": True,
        "set_ratio_median": statistics.median(r["set_ratio"] for r in rows),
        "get_ratio_median": statistics.median(r["get_ratio"] for r in rows),
        "rows": rows,
    }
    print(f"median ratio (SGLang file time / hicache-l3 file time): set x{summary['set_ratio_median']:.1f}, "
          f"get x{summary['get_ratio_median']:.1f} over {args.reps} reps of {args.pages} x "
          f"{page_bytes // 1024} KiB pages", file=sys.stderr)
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
