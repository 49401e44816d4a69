"""Speculative decoding's draft pools through real SGLang 0.5.23 objects (the v2 interface);
imported by sglang_roundtrip.py, which runs it once per connector in the SGLang venv.

SGLang gives a draft model's KV its own host pool, registered as ``PoolName.DRAFT`` (an MHA
or MLA host pool, whatever the target's kind: an EAGLE-MHA draft rides beside an MLA
target), with ``DRAFT_INDEXER`` (a ``DSAIndexerPoolHost`` laid on the draft's host pool)
for a DSA draft and ``DRAFT_SWA`` (trailing-pages hit policy) for a sliding-window draft.
Real host pools of those classes are built on CPU and attached as SGLang's
``HybridCacheController`` does; pages go out with ``batch_set_v2`` and come back with
``batch_get_v2`` at other host indices, bytes compared with SGLang's own page accessors.
Checked: draft pages never read as target pages under the same hash; an MHA draft beside
an MLA target is per TP rank (every rank writes and reads its own heads), an MLA draft is
one copy written by the storage writer.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang_hybrid import DSA_PAGE, attach, make_dsa

from hicache_l3.sglang.config import extra_config_for


def draft_dsa(n: int) -> list[tuple[Any, Any, Any]]:
    """``n`` triples (target MLA host pool, draft MLA host pool, draft indexer host pool named
    ``DRAFT_INDEXER`` on the draft's pool), as SGLang builds a DSA draft; random bytes."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    out = []
    for kv, _ in make_dsa(n):
        dev = DSATokenToKVPool(size=512, page_size=DSA_PAGE, kv_lora_rank=96, dtype=torch.bfloat16,
                               qk_rope_head_dim=32, layer_num=1, device="cpu", index_head_dim=128,
                               enable_memory_saver=False, kv_cache_dim=128, start_layer=0, end_layer=0,
                               index_buf_size=512 + DSA_PAGE)
        info = dev.get_device_pool_infos()[0].buffer_info
        draft = MLATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=DSA_PAGE,
                                     layout="page_first", pin_memory=False, device="cpu",
                                     device_capacity_tokens=512, start_layer=0, end_layer=0,
                                     target_layer_num=1)
        indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dev, name=PoolName.DRAFT_INDEXER), draft,
                                     pin_memory=False)
        indexer.index_k_with_scale_buffer.view(torch.uint8).random_(0, 256)
        draft.kv_buffer.view(torch.uint8).random_(0, 256)
        out.append((kv, draft, indexer))
    return out


def draft_roundtrip(connector: str, settings: dict[str, Any], check: Callable[[bool, str], None],
                    make_pools: Callable[..., list[Any]], storage_config: Callable[..., Any],
                    indices: Callable[[list[int]], torch.Tensor],
                    page_bytes: Callable[[Any, int], Any]) -> None:
    """Draft, draft-indexer and draft-SWA pools beside the target's KV (see module docstring)."""
    case = f"{connector}/draft"
    run_id = uuid.uuid4().hex[:8]
    extra = extra_config_for(connector, settings, tag=f"dr-{run_id}")
    opened: list[Any] = []

    def up(cfg: dict[str, Any], kv: Any, sidecars: dict[Any, Any], **kw: Any) -> Any:
        b = attach(cfg, kv, sidecars, storage_config, **kw)
        opened.append(b)
        return b

    try:
        # MHA target (4 heads) with an MHA draft (1 head) and a sliding-window draft pool
        kv_a, kv_b = make_pools("mha", "page_first", 2, heads=4)
        d_a, d_b, s_a, s_b = make_pools("mha", "page_first", 4, heads=1)
        for pool in (kv_a, d_a, s_a):
            pool.kv_buffer.view(torch.uint8).random_(0, 256)
        a = up(extra, kv_a, {PoolName.DRAFT: d_a, PoolName.DRAFT_SWA: s_a}, mla=False)
        b = up(extra, kv_b, {PoolName.DRAFT: d_b, PoolName.DRAFT_SWA: s_b}, mla=False)
        n = 4
        keys = [f"{run_id}-d{i}" for i in range(n)]
        src, dst = [1, 3, 5, 7], [2, 4, 6, 8]
        check(a.batch_set_v1(keys, indices(src)) == [True] * n, f"{case}: target KV set")
        res = a.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices(src), keys=keys),
                              PoolTransfer(PoolName.DRAFT_SWA, host_indices=indices(src[2:]), keys=keys[2:],
                                           hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        check(res == {PoolName.DRAFT: [True] * n, PoolName.DRAFT_SWA: [True, True]},
              f"{case}: draft set {res}")
        got = b.batch_exists_v2(keys, [
            PoolTransfer(PoolName.DRAFT, keys=keys),
            PoolTransfer(PoolName.DRAFT_SWA, keys=keys[-1:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        check((got.kv_hit_pages, got.restorable_prefix_pages) == (n, [3, 4]), f"{case}: draft exists {got}")
        res = b.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices(dst), keys=keys),
                              PoolTransfer(PoolName.DRAFT_SWA, host_indices=indices(dst), keys=keys)])
        check(res == {PoolName.DRAFT: [True] * n, PoolName.DRAFT_SWA: [False, False, True, True]},
              f"{case}: draft get {res}")
        check(all(torch.equal(page_bytes(d_b, d), page_bytes(d_a, s)) for s, d in zip(src, dst)),
              f"{case}: draft bytes differ")
        check(all(torch.equal(page_bytes(s_b, d), page_bytes(s_a, s)) for s, d in zip(src[2:], dst[2:])),
              f"{case}: draft SWA bytes differ")
        # a draft page is not a target page: draft-only hashes give no KV hit, and the reverse
        only = [f"{run_id}-draft-only"]
        a.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([9]), keys=only)])
        check(b.batch_exists(only) == 0, f"{case}: a draft page counted as a target KV page")
        check(b.extra_pools["draft"].connector.batch_exists([f"{run_id}-kv-only"]) == [False]
              and a.batch_set_v1([f"{run_id}-kv-only"], indices([9])) == [True]
              and b.extra_pools["draft"].connector.batch_exists([f"{run_id}-kv-only"]) == [False],
              f"{case}: a target page visible as a draft page")
        a.clear()
        check(b.extra_pools["draft"].connector.batch_exists(keys) == [False] * n,
              f"{case}: clear left drafts")
        # MLA target at TP=2: an MHA draft is per rank, an MLA draft one copy from the writer
        mla_extra = {**extra, "extra_backend_tag": f"dr-mla-{run_id}"}
        t0, t1 = make_pools("mla", "page_first", 2)
        h0, h1 = make_pools("mha", "page_first", 2, heads=1)
        m0, m1 = make_pools("mla", "page_first", 2)
        for pool in (h0, h1, m0):
            pool.kv_buffer.view(torch.uint8).random_(0, 256)
        r0 = up(mla_extra, t0, {PoolName.DRAFT: h0}, mla=True, tp_rank=0, tp_size=2)
        r1 = up(mla_extra, t1, {PoolName.DRAFT: h1}, mla=True, tp_rank=1, tp_size=2)
        k = [f"{run_id}-mhad"]
        check(r1.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([2]), keys=k)])
              == {PoolName.DRAFT: [True]}, f"{case}: rank-1 MHA draft set")
        check(r1.extra_pools["draft"].connector.batch_exists(k) == [True],
              f"{case}: a non-writer rank did not store its MHA draft heads")
        check(r0.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([3]), keys=k)])
              == {PoolName.DRAFT: [False]}, f"{case}: rank 0 read rank 1's MHA draft heads")
        check(r1.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([4]), keys=k)])
              == {PoolName.DRAFT: [True]} and torch.equal(page_bytes(h1, 4), page_bytes(h1, 2)),
              f"{case}: rank 1 lost its MHA draft heads")
        w0 = up({**mla_extra, "extra_backend_tag": f"dr-mlad-{run_id}"}, t0, {PoolName.DRAFT: m0},
                mla=True, tp_rank=0, tp_size=2)
        w1 = up({**mla_extra, "extra_backend_tag": f"dr-mlad-{run_id}"}, t1, {PoolName.DRAFT: m1},
                mla=True, tp_rank=1, tp_size=2)
        k2 = [f"{run_id}-mlad0", f"{run_id}-mlad1"]
        w1.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([5, 6]), keys=k2)])
        check(w0.extra_pools["draft"].connector.batch_exists(k2) == [False, False],
              f"{case}: a non-writer rank wrote the shared MLA draft")
        w0.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([1, 2]), keys=k2)])
        check(w1.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=indices([7, 8]), keys=k2)])
              == {PoolName.DRAFT: [True, True]}
              and all(torch.equal(page_bytes(m1, d), page_bytes(m0, s)) for s, d in ((1, 7), (2, 8))),
              f"{case}: MLA draft not shared by the ranks")
        for x in (r0, r1, w0):
            x.clear()
        # DSA draft: the draft indexer pool on the draft's MLA pool
        (ta, da, ia), (tb, db, ib) = draft_dsa(2)
        dsa_extra = {**extra, "extra_backend_tag": f"dr-dsa-{run_id}"}
        xa = up(dsa_extra, ta, {PoolName.DRAFT: da, PoolName.DRAFT_INDEXER: ia}, mla=True)
        xb = up(dsa_extra, tb, {PoolName.DRAFT: db, PoolName.DRAFT_INDEXER: ib}, mla=True)

        def pages(ps: list[int]) -> torch.Tensor:
            return torch.cat([torch.arange(p * DSA_PAGE, (p + 1) * DSA_PAGE, dtype=torch.int64) for p in ps])

        dk = [f"{run_id}-dsa{i}" for i in range(2)]
        check(xa.batch_set_v1(dk, pages([1, 3])) == [True, True], f"{case}: DSA target set")
        res = xa.batch_set_v2([PoolTransfer(PoolName.DRAFT, host_indices=pages([1, 3]), keys=dk),
                               PoolTransfer(PoolName.DRAFT_INDEXER, host_indices=pages([1, 3]), keys=dk)])
        check(res == {PoolName.DRAFT: [True, True], PoolName.DRAFT_INDEXER: [True, True]},
              f"{case}: DSA draft set {res}")
        res = xb.batch_get_v2([PoolTransfer(PoolName.DRAFT, host_indices=pages([2, 4]), keys=dk),
                               PoolTransfer(PoolName.DRAFT_INDEXER, host_indices=pages([2, 4]), keys=dk)])
        check(res == {PoolName.DRAFT: [True, True], PoolName.DRAFT_INDEXER: [True, True]},
              f"{case}: DSA draft get {res}")
        check(all(torch.equal(ib.index_k_with_scale_buffer[d], ia.index_k_with_scale_buffer[s])
                  and torch.equal(db.get_data_page(d * DSA_PAGE).view(torch.uint8),
                                  da.get_data_page(s * DSA_PAGE).view(torch.uint8))
                  for s, d in ((1, 2), (3, 4))), f"{case}: DSA draft bytes differ")
        xa.clear()
    finally:
        for x in opened:
            x.close()
