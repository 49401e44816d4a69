"""SGLang 0.5.23's smaller storage features against real SGLang objects; imported by
sglang_roundtrip.py (run once, on the first connector of the spec, in the SGLang venv).

* ``extra_info.prefix_keys`` (``hicache_storage_pass_prefix_keys``): SGLang's own extra-config
  parser takes the flag out of a config ``sglang-args`` wrote, and the calls that carry
  prefix keys give exactly the answers of the calls without them (page keys are chained
  hashes already: the prefix adds nothing to a page's identity).
* attention DP (``dp_rank`` in ``HiCacheStorageConfig``; every DP scheduler's ``tp_rank`` is
  its attention-TP rank): replicas on the same attention-TP shard share pages, and
  different shards never see each other's, whatever their DP rank.
* the host-pool module under both names SGLang has had (``mem_cache.memory_pool_host``,
  ``mem_cache.pool_host``): a pool class defined under either module is served the same.
* SGLang's clear path (``HybridCacheController.clear_storage_backend``, behind
  ``POST /hicache/storage-backend/clear``) removes this namespace and its extra pools'
  pages, not another model's or tag's.
* ``get_stats``: SGLang's ``StorageMetrics`` with our per-pool, per-op, per-reason page
  counts since the last call, and the Prometheus counter ``hicache_l3_pages_total``.
"""

from __future__ import annotations

import types
import uuid
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolName, PoolTransfer

from hicache_l3.sglang.config import extra_config_for


def api_features(connector: str, settings: dict[str, Any], check: Callable[[bool, str], None],
                 make_pools: Callable[..., list[Any]], backend: Callable[..., Any],
                 indices: Callable[[list[int]], torch.Tensor], page_bytes: Callable[[Any, int], Any]) -> None:
    """See the module docstring."""
    import json
    import tempfile

    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    case = f"{connector}/api"
    run_id = uuid.uuid4().hex[:8]
    extra = extra_config_for(connector, settings, tag=f"api-{run_id}")
    opened: list[Any] = []

    def up(cfg: dict[str, Any], pool: Any, **kw: Any) -> Any:
        b = backend(cfg, pool, **kw)
        opened.append(b)
        return b

    try:
        # prefix_keys: SGLang's parser takes the flag; answers do not depend on the prefix
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump({**extra, "hicache_storage_pass_prefix_keys": True}, f)
            f.flush()
            parsed, *_, pass_prefix = HybridCacheController.parse_storage_backend_extra_config(f"@{f.name}")
        check(pass_prefix is True and "hicache_storage_pass_prefix_keys" not in parsed,
              f"{case}: SGLang's parser kept the prefix-keys flag: {sorted(parsed)}")
        pa, pb = make_pools("mha", "page_first", 2)
        pa.kv_buffer.view(torch.uint8).random_(0, 256)
        a, b = up(parsed, pa, mla=False), up(parsed, pb, mla=False)
        keys = [f"{run_id}-k{i}" for i in range(4)]
        info = HiCacheStorageExtraInfo(prefix_keys=[f"{run_id}-before{i}" for i in range(3)])
        check(a.batch_set_v1(keys, indices([1, 2, 3, 4]), info) == [True] * 4,
              f"{case}: set with prefix keys")
        check(b.batch_exists(keys, info) == b.batch_exists(keys) == 4, f"{case}: exists with prefix keys")
        check(b.batch_get_v1(keys, indices([5, 6, 7, 8]), info) == [True] * 4
              and all(torch.equal(page_bytes(pb, s + 4), page_bytes(pa, s)) for s in [1, 2, 3, 4]),
              f"{case}: get with prefix keys")
        res = b.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=indices([9, 10]), keys=keys[2:])], info)
        check(res == {PoolName.KV: [True, True]}, f"{case}: v2 get with prefix keys {res}")
        check(b.batch_exists_v2(keys, [], info).kv_hit_pages == 4, f"{case}: v2 exists with prefix keys")
        # get_stats: per-reason deltas since the last call, and the Prometheus counter
        a.get_stats()
        b.get_stats()
        check(b.batch_get_v1([keys[0], f"{run_id}-absent"], indices([11, 12])) == [True, False],
              f"{case}: mixed get")
        stats = b.get_stats()
        got = getattr(stats, "hicache_l3", None)
        check(type(stats).__name__ == "StorageMetrics" and got is not None
              and got.get("kv", {}).get("get") == {"ok": 1, "miss": 1}, f"{case}: get_stats reasons {got}")
        check(b.get_stats().hicache_l3.get("kv", {}).get("get") is None, f"{case}: get_stats did not reset")
        from prometheus_client import REGISTRY
        value = REGISTRY.get_sample_value("hicache_l3_pages_total",
                                          {"pool": "kv", "op": "get", "result": "miss", "tp_rank": "0"})
        check(value is not None and value >= 1, f"{case}: Prometheus counter {value}")
        # attention DP: same attention-TP shard shares, another shard never sees
        dp_pools = make_pools("mha", "page_first", 3)
        dp_pools[0].kv_buffer.view(torch.uint8).random_(0, 256)
        d0 = up(extra, dp_pools[0], mla=False, tp_rank=0, tp_size=2, dp_rank=0)
        d1 = up(extra, dp_pools[1], mla=False, tp_rank=0, tp_size=2, dp_rank=1)
        d1r1 = up(extra, dp_pools[2], mla=False, tp_rank=1, tp_size=2, dp_rank=1)
        dk = [f"{run_id}-dp{i}" for i in range(2)]
        check(d0.batch_set_v1(dk, indices([1, 2])) == [True, True], f"{case}: DP 0 set")
        check(d1.batch_get_v1(dk, indices([3, 4])) == [True, True]
              and torch.equal(page_bytes(dp_pools[1], 3), page_bytes(dp_pools[0], 1)),
              f"{case}: DP replica 1 does not share DP 0's pages of its shard")
        check(d1r1.batch_exists(dk) == 0, f"{case}: another attention-TP shard sees DP 0's pages")
        # the host-pool module under both names: the class's module does not matter
        import importlib

        for module in ("sglang.srt.mem_cache.memory_pool_host", "sglang.srt.mem_cache.pool_host"):
            check(importlib.import_module(module) is not None, f"{case}: {module} missing")
        (old_style,) = make_pools("mha", "page_first", 1)
        old_cls = types.new_class("MHATokenToKVPoolHost", (type(old_style),))
        old_cls.__module__ = "sglang.srt.mem_cache.memory_pool_host"
        old_style.__class__ = old_cls
        o = up(extra, old_style, mla=False)
        check(o.batch_get_v1(keys[:1], indices([13])) == [True]
              and torch.equal(page_bytes(old_style, 13), page_bytes(pa, 1)),
              f"{case}: a pool class under mem_cache.memory_pool_host is served otherwise")
        # SGLang's clear path: this namespace and its extra pools, nothing else
        (pk,) = make_pools("mha", "page_first", 1)
        (side,) = make_pools("mha", "page_first", 1, heads=1)
        keep_tag = up({**extra, "extra_backend_tag": f"keep-{run_id}"}, pk, mla=False)
        keep_model = up(extra, pk, mla=False, model="other/model")
        for k in (keep_tag, keep_model):
            check(k.batch_set_v1(keys[:2], indices([1, 2])) == [True, True], f"{case}: other namespace set")
        a.register_mem_host_pool_v2(side, PoolName.DRAFT)
        a.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([1]), keys=keys[:1])])
        check(a.extra_pools["draft"].connector.batch_exists(keys[:1]) == [True], f"{case}: draft set")
        controller = types.SimpleNamespace(enable_storage=True, storage_backend=a)
        check(HybridCacheController.clear_storage_backend(controller) is True, f"{case}: SGLang's clear")
        draft_left = a.extra_pools["draft"].connector.batch_exists(keys[:1])
        check(b.batch_exists(keys) == 0 and draft_left == [False],
              f"{case}: SGLang's clear left pages of this namespace")
        check(keep_tag.batch_exists(keys[:2]) == 2 and keep_model.batch_exists(keys[:2]) == 2,
              f"{case}: SGLang's clear removed another namespace's pages")
        for x in (keep_tag, keep_model, d0):
            x.clear()
    finally:
        for x in opened:
            x.close()
