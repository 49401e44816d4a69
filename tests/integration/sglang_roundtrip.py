"""Round trips through real SGLang 0.5.23 objects; run by tests/integration/test_sglang.py with
.venv-sglang/bin/python (SGLang is not installed in .venv).

    sglang_roundtrip.py SPEC_JSON

SPEC: {"connectors": [{"label": L, "connector": NAME, "settings": {...},
"extra_cases": [[KIND, LAYOUT], ...]}, ...],
"api_checks": bool}; SGLang is imported once for all of them. For MHA and MLA pools, in
page_first and layer_first layouts: build a real device pool on CPU and two real host pools
from it, construct our backend through StorageBackendFactory.create_backend("dynamic", ...),
write pages from pool A with batch_set_v1, read them into pool B with batch_get_v1 at other
indices, and compare bytes using SGLang's own get_data_page as the oracle. Prints one line
``REPORT {json}`` (failures per connector); exits 1 when any check failed.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang_api import api_features  # noqa: E402  (beside this file)
from sglang_draft import draft_roundtrip  # noqa: E402  (beside this file)
from sglang_hetero_tp import hetero_tp_roundtrip  # noqa: E402  (beside this file)
from sglang_hybrid import hybrid_roundtrip  # noqa: E402  (beside this file)

from hicache_l3.common.errors import ConfigError  # noqa: E402
from hicache_l3.sglang import HiCacheL3Storage  # noqa: E402
from hicache_l3.sglang.config import extra_config_for  # noqa: E402

PAGE = 16  # tokens per page
LAYERS = 4
DEVICE_TOKENS = 512
PAGES = 12
FAILURES: list[str] = []


def check(cond: bool, what: str) -> None:
    """Record a failure (the script goes on, to report every problem at once)."""
    if not cond:
        FAILURES.append(what)


def make_pools(kind: str, layout: str, n: int, heads: int = 2) -> list[Any]:
    """``n`` real SGLang host pools (CPU, unpinned) of one geometry, zero-filled (MHA: ``heads``
    KV heads of this rank)."""
    pools = []
    for _ in range(n):
        if kind == "mha":
            dev = MHATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, head_num=heads,
                                   head_dim=64, layer_num=LAYERS, device="cpu", enable_memory_saver=False,
                                   start_layer=0, end_layer=LAYERS - 1)
            info = dev.get_device_pool_infos()[0].buffer_info
            host = MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE,
                                        layout=layout, pin_memory=False, device="cpu",
                                        device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                        end_layer=LAYERS - 1)
        else:
            dev = MLATokenToKVPool(size=DEVICE_TOKENS, page_size=PAGE, dtype=torch.bfloat16, kv_lora_rank=96,
                                   qk_rope_head_dim=32, layer_num=LAYERS, device="cpu",
                                   enable_memory_saver=False, start_layer=0, end_layer=LAYERS - 1)
            info = dev.get_device_pool_infos()[0].buffer_info
            host = MLATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE,
                                        layout=layout, pin_memory=False, device="cpu",
                                        device_capacity_tokens=DEVICE_TOKENS, start_layer=0,
                                        end_layer=LAYERS - 1, target_layer_num=LAYERS)
        host.kv_buffer.view(torch.uint8).zero_()
        pools.append(host)
    return pools


def storage_config(extra: dict[str, Any], *, mla: bool, tp_rank: int = 0, tp_size: int = 1,
                   model: str | None = "test-org/model-7b",
                   layout: str = "page_first", dp_rank: int = 0) -> HiCacheStorageConfig:
    """A HiCacheStorageConfig as SGLang's cache controller builds it (``_generate_storage_config``:
    ``tp_lcm_size`` popped from the extra config, ``should_split_heads`` computed from it)."""
    extra = dict(extra)
    lcm = extra.pop("tp_lcm_size", None)
    split = bool(lcm) and not mla and layout == "page_head" and lcm > tp_size
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=True, is_page_first_layout=layout == "page_first",
        model_name=model, tp_lcm_size=lcm, should_split_heads=split, dp_rank=dp_rank, extra_config=extra,
    )


def backend(extra: dict[str, Any], pool: Any, **kw: Any) -> Any:
    """Construct and attach our backend exactly as SGLang's controller does."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **kw), pool)
    b.register_mem_pool_host(pool)
    b.on_host_pools_registered()
    return b


def indices(pages: list[int]) -> torch.Tensor:
    """Host indices of whole pages, page i starting at ``indices[i * PAGE]``."""
    return torch.cat([torch.arange(p * PAGE, (p + 1) * PAGE, dtype=torch.int64) for p in pages])


def page_bytes(pool: Any, page: int) -> torch.Tensor:
    """Oracle: SGLang's own flat copy of one page, as bytes."""
    return pool.get_data_page(page * PAGE, flat=True).contiguous().view(torch.uint8).clone()


def roundtrip(connector: str, settings: dict[str, Any], kind: str, layout: str) -> dict[str, Any]:
    """One geometry: v1 zero-copy set/get, no rewrite of stored pages, leading hits, legacy path,
    namespace separation, MLA writer rules, stats, clear."""
    case = f"{connector}/{kind}/{layout}"
    run_id = uuid.uuid4().hex[:8]
    extra = extra_config_for(connector, settings, tag=f"it-{run_id}")
    mla = kind == "mla"
    pool_a, pool_b, pool_c = make_pools(kind, layout, 3)
    pool_a.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
    # MLA: A is the writer (tp rank 0), B a reader on tp rank 1 of the same shared namespace.
    a = backend(extra, pool_a, mla=mla, tp_rank=0, tp_size=2 if mla else 1, layout=layout)
    b = backend(extra, pool_b, mla=mla, tp_rank=1 if mla else 0, tp_size=2 if mla else 1, layout=layout)
    out: dict[str, Any] = {"case": case}
    try:
        keys = [f"{run_id}-{kind}-{layout}-{i:03d}" for i in range(PAGES)]
        src_pages = [1 + 2 * i for i in range(PAGES)][::-1]  # scattered, descending
        dst_pages = [2 + i for i in range(PAGES)]
        originals = [page_bytes(pool_a, p) for p in src_pages]
        check(a.batch_exists(keys) == 0, f"{case}: keys exist before any set")
        t0 = time.perf_counter()
        ok = a.batch_set_v1(keys, indices(src_pages))
        out["set_s"] = time.perf_counter() - t0
        check(ok == [True] * PAGES, f"{case}: batch_set_v1 returned {ok}")
        check(a.batch_exists(keys) == PAGES, f"{case}: batch_exists after set = {a.batch_exists(keys)}")
        many = [*keys, f"{run_id}-missing", *keys]  # long chain: leading hits stop at the gap
        check(b.batch_exists(many) == PAGES, f"{case}: leading hits over {len(many)} keys wrong")
        check(b.batch_exists([f"{run_id}-x{i}" for i in range(1000)]) == 0, f"{case}: 1000 missing keys")
        # pages already stored are not rewritten: change A's bytes, set again, read the old bytes
        for p in src_pages:
            pool_a.set_from_flat_data_page(p * PAGE, torch.zeros_like(pool_a.get_data_page(p * PAGE)))
        check(a.batch_set_v1(keys, indices(src_pages)) == [True] * PAGES, f"{case}: second set")
        t0 = time.perf_counter()
        got = b.batch_get_v1(keys, indices(dst_pages))
        out["get_s"] = time.perf_counter() - t0
        check(got == [True] * PAGES, f"{case}: batch_get_v1 returned {got}")
        same = [torch.equal(page_bytes(pool_b, d), o) for d, o in zip(dst_pages, originals)]
        check(all(same), f"{case}: pages read differ from pages written: {same}")
        for d in dst_pages:  # nothing outside the target pages was written
            pool_b.set_from_flat_data_page(d * PAGE, torch.zeros_like(pool_b.get_data_page(d * PAGE)))
        check(int(pool_b.kv_buffer.view(torch.uint8).count_nonzero()) == 0,
              f"{case}: batch_get_v1 wrote outside its pages")
        # per-key results: one missing key in the middle of a batch
        mixed = [keys[0], f"{run_id}-absent", keys[2]]
        check(b.batch_get_v1(mixed, indices(dst_pages[:3])) == [True, False, True],
              f"{case}: per-key get results wrong")
        # legacy copying path (what SGLang uses without interface_v1)
        lkeys = [f"{run_id}-legacy-{i}" for i in range(3)]
        pool_a.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
        values = [pool_a.get_data_page(p * PAGE, flat=True) for p in (4, 6, 8)]
        check(a.batch_set(lkeys, values) is True, f"{case}: legacy batch_set")
        check(a.exists(lkeys[1]) and not a.exists(f"{run_id}-nope"), f"{case}: legacy exists")
        targets = [pool_b.get_dummy_flat_data_page() for _ in lkeys]
        res = b.batch_get(lkeys, targets)
        check(all(r is not None for r in res), f"{case}: legacy batch_get missed")
        check(all(r is not None and torch.equal(r.view(torch.uint8), v.contiguous().view(torch.uint8))
                  for r, v in zip(res, values)), f"{case}: legacy pages differ")
        check(b.get(f"{run_id}-nope", pool_b.get_dummy_flat_data_page()) is None, f"{case}: legacy get miss")
        # the two paths store the same bytes (SGLang's flat page): legacy-written pages read
        # with batch_get_v1, v1-written pages read with the legacy batch_get
        check(b.batch_get_v1(lkeys, indices([10, 12, 14])) == [True] * 3, f"{case}: v1 get of legacy pages")
        check(all(torch.equal(page_bytes(pool_b, d), v.contiguous().view(torch.uint8))
                  for d, v in zip([10, 12, 14], values)), f"{case}: v1 read of legacy pages differs")
        vkeys = [f"{run_id}-v1-{i}" for i in range(2)]
        check(a.batch_set_v1(vkeys, indices([4, 6])) == [True, True], f"{case}: v1 set for legacy read")
        res = b.batch_get(vkeys, [pool_b.get_dummy_flat_data_page() for _ in vkeys])
        check(all(r is not None and torch.equal(r.view(torch.uint8), page_bytes(pool_a, p))
                  for r, p in zip(res, [4, 6])), f"{case}: legacy read of v1 pages differs")
        # namespaces: another model, another tag, another (non-MLA) TP rank see nothing
        others = [backend(extra, pool_c, mla=mla, model="other/model", layout=layout),
                  backend({**extra, "extra_backend_tag": f"other-{run_id}"}, pool_c, mla=mla, layout=layout)]
        if not mla:
            others.append(backend(extra, pool_c, mla=False, tp_rank=1, tp_size=2, layout=layout))
        for o in others:
            check(o.batch_exists(keys) == 0, f"{case}: {o!r} sees another namespace's pages")
            o.close()
        if mla:  # non-writer ranks never write
            nkeys = [f"{run_id}-nonwriter-{i}" for i in range(2)]
            check(b.batch_set_v1(nkeys, indices(dst_pages[:2])) == [True, True], f"{case}: non-writer set")
            check(a.batch_exists(nkeys) == 0, f"{case}: a non-writer MLA rank wrote pages")
        stats = a.get_stats()
        check(type(stats).__name__ == "StorageMetrics" and sum(stats.backup_pgs) >= PAGES,
              f"{case}: get_stats backup_pgs={getattr(stats, 'backup_pgs', None)}")
        check(sum(b.get_stats().prefetch_pgs) >= PAGES, f"{case}: get_stats prefetch_pgs")
        # clear() removes this namespace only
        other = backend({**extra, "extra_backend_tag": f"keep-{run_id}"}, pool_a, mla=mla, layout=layout)
        check(other.batch_set_v1(keys[:2], indices(src_pages[:2])) == [True, True], f"{case}: other set")
        a.clear()
        check(b.batch_exists(keys) == 0, f"{case}: clear() left pages behind")
        check(other.batch_exists(keys[:2]) == 2, f"{case}: clear() removed another namespace's pages")
        other.clear()
        other.close()
    finally:
        a.close()
        b.close()
    # after close: misses, never exceptions
    check(b.batch_get_v1(keys[:2], indices(dst_pages[:2])) == [False, False], f"{case}: get after close")
    check(b.batch_exists(keys) == 0, f"{case}: exists after close")
    return out


def threads_check(extra: dict[str, Any]) -> None:
    """SGLang's prefetch-query, prefetch-I/O and backup threads at once on one backend:
    every page read back is the page written under its key."""
    import threading

    (pool,) = make_pools("mha", "page_first", 1)
    pool.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
    b = backend({**extra, "extra_backend_tag": f"threads-{uuid.uuid4().hex[:8]}"}, pool, mla=False)
    rounds, per = 6, 4  # pages 1..24 are written, 25..48 receive the reads
    originals = {p: page_bytes(pool, p) for p in range(1, rounds * per + 1)}
    errors: list[str] = []
    written = threading.Semaphore(0)

    def backup() -> None:
        for r in range(rounds):
            src = list(range(1 + r * per, 1 + (r + 1) * per))
            if b.batch_set_v1([f"t-{p}" for p in src], indices(src)) != [True] * per:
                errors.append(f"backup round {r} failed")
            written.release()

    def prefetch() -> None:
        for r in range(rounds):
            written.acquire()
            src = list(range(1 + r * per, 1 + (r + 1) * per))
            keys = [f"t-{p}" for p in src]
            if b.batch_exists(keys) != per:
                errors.append(f"exists round {r}")
            dst = [p + rounds * per for p in src]
            if b.batch_get_v1(keys, indices(dst)) != [True] * per:
                errors.append(f"get round {r}")
            elif not all(torch.equal(page_bytes(pool, d), originals[s]) for s, d in zip(src, dst)):
                errors.append(f"get round {r}: wrong bytes")

    def query() -> None:
        for _ in range(50):
            b.batch_exists([f"t-{p}" for p in range(1, rounds * per + 1)])

    workers = [threading.Thread(target=f) for f in (backup, prefetch, query)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    check(not any(w.is_alive() for w in workers), "threads: a worker hung")
    check(not errors, f"threads: {errors}")
    b.clear()
    b.close()


def api_checks(connector: str, settings: dict[str, Any]) -> None:
    """Start-up refusals and error handling that do not depend on the layout."""
    extra = extra_config_for(connector, settings)
    (pool,) = make_pools("mha", "page_first", 1)
    try:
        StorageBackendFactory.create_backend("dynamic", storage_config(extra, mla=False, model=None), pool)
        check(False, "no model name and no tag was accepted")
    except ConfigError as exc:
        check("extra_backend_tag" in str(exc), f"no-model error does not name extra_backend_tag: {exc}")
    tagged = backend({**extra, "extra_backend_tag": "named-by-tag"}, pool, mla=False, model=None)
    check(isinstance(tagged, HiCacheL3Storage) and "named-by-tag" in repr(tagged), "tag stands in for model")
    tagged.close()
    try:
        StorageBackendFactory.create_backend("dynamic", storage_config({**extra, "conector": 1}, mla=False),
                                             pool)
        check(False, "an unknown extra-config key was accepted")
    except ConfigError as exc:
        check("conector" in str(exc), f"unknown-key error does not name the key: {exc}")
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, mla=False), pool)
    b.register_mem_pool_host(pool)
    b.register_mem_host_pool_v2(pool, PoolName.KV)
    b.on_host_pools_registered()
    # a host pool without an attribute the adapter reads is a ConfigError naming it
    (odd,) = make_pools("mha", "page_first", 1)
    odd.__class__ = type("NoDtypeHostPool", (type(odd),), {})
    odd.__dict__.pop("dtype", None)
    check(not hasattr(odd, "dtype"), "test setup: the pool still has a dtype")
    try:
        backend(extra, odd, mla=False)
        check(False, "a host pool without dtype was accepted")
    except ConfigError as exc:
        check("'dtype'" in str(exc) and "NoDtypeHostPool" in str(exc), f"no-dtype error: {exc}")
    except AttributeError as exc:
        check(False, f"a host pool without dtype raised AttributeError: {exc}")
    # SGLang adds file_storage_path (--file-storage-path) to every backend's extra config
    fsp = backend({**extra, "file_storage_path": "/nonexistent/sglang-file-dir"}, pool, mla=False)
    check(isinstance(fsp, HiCacheL3Storage), "file_storage_path refused")
    fsp.close()
    threads_check(extra)
    # a layout SGLang gives no page description for is refused at attach, naming it
    for kind in ("mha", "mla"):
        (unified,) = make_pools(kind, "page_unified", 1)
        try:
            backend(extra, unified, mla=kind == "mla")
            check(False, f"{kind} page_unified was accepted")
        except ConfigError as exc:
            check("page_unified" in str(exc), f"page_unified refusal does not name the layout: {exc}")
    # an engine error inside a call becomes a miss, not an exception in SGLang's thread
    assert b.connector is not None
    b.connector.close()
    check(b.batch_set_v1(["k1"], indices([1])) == [False], "set on a failed engine")
    check(b.batch_get_v1(["k1"], indices([1])) == [False], "get on a failed engine")
    check(b.batch_exists(["k1"]) == 0, "exists on a failed engine")
    check(b.batch_get(["k1"], [pool.get_dummy_flat_data_page()]) == [None], "legacy get on a failed engine")
    b.close()


def main() -> int:
    """Run every connector of the spec; print a JSON report with the failures per connector."""
    spec = json.loads(sys.argv[1])
    report: dict[str, Any] = {}
    if spec.get("api_checks"):
        first = spec["connectors"][0]
        api_checks(first["connector"], first["settings"])
        try:
            api_features(first["connector"], first["settings"], check, make_pools, backend, indices,
                         page_bytes)
        except Exception as exc:
            FAILURES.append(f"api features: {exc!r}")
        report["api"] = {"failures": list(FAILURES)}
    for item in spec["connectors"]:
        start = len(FAILURES)
        cases = []
        plan = [(k, lay) for k in ("mha", "mla") for lay in ("page_first", "layer_first")]
        plan += [tuple(c) for c in item.get("extra_cases", [])]
        for kind, layout in plan:
            try:
                cases.append(roundtrip(item["connector"], item["settings"], kind, layout))
            except Exception as exc:
                FAILURES.append(f"{item['connector']}/{kind}/{layout}: {exc!r}")
        if spec.get("hybrid", True):
            try:
                hybrid_roundtrip(item["connector"], item["settings"], check, make_pools, storage_config,
                                 indices, page_bytes, PAGE)
                cases.append({"case": f"{item['connector']}/hybrid"})
            except Exception as exc:
                FAILURES.append(f"{item['connector']}/hybrid: {exc!r}")
        if spec.get("hetero_tp", True):
            try:
                hetero_tp_roundtrip(item["connector"], item["settings"], check, make_pools, storage_config,
                                    indices, page_bytes)
                cases.append({"case": f"{item['connector']}/hetero-tp"})
            except Exception as exc:
                FAILURES.append(f"{item['connector']}/hetero-tp: {exc!r}")
        if spec.get("draft", True):
            try:
                draft_roundtrip(item["connector"], item["settings"], check, make_pools, storage_config,
                                indices, page_bytes)
                cases.append({"case": f"{item['connector']}/draft"})
            except Exception as exc:
                FAILURES.append(f"{item['connector']}/draft: {exc!r}")
        report[item["label"]] = {"cases": cases, "failures": FAILURES[start:]}
    print("REPORT " + json.dumps(report))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
