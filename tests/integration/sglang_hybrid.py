"""Hybrid models through real SGLang 0.5.23 objects (the v2 storage interface); imported by
sglang_roundtrip.py, which runs it once per connector in the SGLang venv.

Real SGLang host pools built on CPU (unpinned): an MHA KV pool as the anchor, a
``MambaPoolHost`` (temporal state float32, two conv states bfloat16: pages of several
segments of different sizes) and a second ``MHATokenToKVPoolHost`` as the sliding-window
(SWA) pool; and a real DSA device pool's MLA host pool with its ``DSAIndexerPoolHost``
(the indexer sidecar, 64-token pages). The backend is built by SGLang's factory and
attached exactly as SGLang's ``HybridCacheController`` does (``register_mem_pool_host``,
``register_mem_host_pool_v2`` for every entry, ``on_host_pools_registered``). Pages go out of pools A with
``batch_set_v1``/``batch_set_v2`` and into pools B with ``batch_get_v1``/``batch_get_v2``;
bytes are compared with SGLang's own ``get_data_page`` (the indexer buffer's page for DSA)
as the oracle.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache_l3.common.errors import ConfigError
from hicache_l3.sglang.config import extra_config_for

SLOTS = 16  # Mamba state slots on the device
DSA_PAGE = 64  # DSA requires 64-token pages


def make_mamba(layout: str = "page_first", conv_width: int = 3) -> Any:
    """A real SGLang Mamba host pool on CPU, random bytes in every state."""
    temporal = torch.zeros(2, SLOTS, 4, 8, dtype=torch.float32)
    conv = (torch.zeros(2, SLOTS, 16, conv_width, dtype=torch.bfloat16),
            torch.zeros(2, SLOTS, 8, conv_width, dtype=torch.bfloat16))
    pool = MambaPoolHost(MambaStateBufferInfo(temporal=temporal, conv=conv), host_to_device_ratio=2.0,
                         host_size=0, device_capacity=SLOTS, pin_memory=False, device="cpu", layout=layout)
    for buf in [pool.temporal_buffer, *pool.conv_buffer]:
        buf.view(torch.uint8).random_(0, 256)
    return pool


def state_bytes(pool: Any, slot: int) -> torch.Tensor:
    """Oracle: SGLang's own flat copy of one Mamba state slot, as bytes."""
    return pool.get_data_page(slot, flat=True).contiguous().view(torch.uint8).clone()


def attach(extra: dict[str, Any], kv: Any, sidecars: dict[Any, Any], storage_config: Callable[..., Any],
           **kw: Any) -> Any:
    """Build and attach our backend the way SGLang's HybridCacheController does."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **kw), kv)
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    for name, pool in sidecars.items():
        b.register_mem_host_pool_v2(pool, name)
    b.on_host_pools_registered()
    return b


def make_dsa(n: int) -> list[tuple[Any, Any]]:
    """``n`` pairs (MLA host pool, DSA indexer host pool) of a real DeepSeek-V3.2-style (DSA)
    device pool on CPU: the indexer pool's pages ride on the KV pages (64-token pages, the
    host indices of the KV pool), one segment per page; random bytes in the indexer."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost, make_dsa_indexer_pool_decl
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    out = []
    for _ in range(n):
        # index_buf_size given: SGLang would read the DCP width from its parallel state
        dev = DSATokenToKVPool(size=512, page_size=DSA_PAGE, kv_lora_rank=96, dtype=torch.bfloat16,
                               qk_rope_head_dim=32, layer_num=2, device="cpu", index_head_dim=128,
                               enable_memory_saver=False, kv_cache_dim=128, start_layer=0, end_layer=1,
                               index_buf_size=512 + DSA_PAGE)
        info = dev.get_device_pool_infos()[0].buffer_info
        kv = MLATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=DSA_PAGE,
                                  layout="page_first", pin_memory=False, device="cpu",
                                  device_capacity_tokens=512, start_layer=0, end_layer=1, target_layer_num=2)
        indexer = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(dev), kv, pin_memory=False)
        indexer.index_k_with_scale_buffer.view(torch.uint8).random_(0, 256)
        kv.kv_buffer.view(torch.uint8).random_(0, 256)
        out.append((kv, indexer))
    return out


def dsa_roundtrip(extra: dict[str, Any], case: str, run_id: str, check: Callable[[bool, str], None],
                  storage_config: Callable[..., Any]) -> None:
    """The DSA indexer sidecar (real ``DSAIndexerPoolHost``): v2 set from one pool set, get into
    another at other pages, bytes compared page by page; pages hit only where both exist."""
    (kv_a, ix_a), (kv_b, ix_b) = make_dsa(2)
    a = attach(extra, kv_a, {PoolName.INDEXER: ix_a}, storage_config, mla=True)
    b = attach(extra, kv_b, {PoolName.INDEXER: ix_b}, storage_config, mla=True)

    def pages(ps: list[int]) -> torch.Tensor:
        return torch.cat([torch.arange(p * DSA_PAGE, (p + 1) * DSA_PAGE, dtype=torch.int64) for p in ps])

    try:
        keys = [f"{run_id}-dsa{i}" for i in range(3)]
        src, dst = [1, 3, 5], [2, 4, 6]
        want = [ix_a.index_k_with_scale_buffer[p].clone() for p in src]
        check(a.batch_set_v1(keys, pages(src)) == [True] * 3, f"{case}: DSA KV set")
        res = a.batch_set_v2([PoolTransfer(PoolName.INDEXER, host_indices=pages(src[:2]), keys=keys[:2])])
        check(res == {PoolName.INDEXER: [True, True]}, f"{case}: DSA indexer set {res}")
        got = b.batch_exists_v2(keys, [PoolTransfer(PoolName.INDEXER, keys=keys)])
        check((got.kv_hit_pages, got.restorable_prefix_pages) == (2, [1, 2]), f"{case}: DSA exists {got}")
        res = b.batch_get_v2([PoolTransfer(PoolName.INDEXER, host_indices=pages(dst), keys=keys)])
        check(res == {PoolName.INDEXER: [True, True, False]}, f"{case}: DSA indexer get {res}")
        check(all(torch.equal(ix_b.index_k_with_scale_buffer[d], w) for d, w in zip(dst[:2], want[:2])),
              f"{case}: DSA indexer bytes differ")
        a.clear()
    finally:
        a.close()
        b.close()


def hybrid_roundtrip(connector: str, settings: dict[str, Any], check: Callable[[bool, str], None],
                     make_pools: Callable[..., list[Any]], storage_config: Callable[..., Any],
                     indices: Callable[[list[int]], torch.Tensor], page_bytes: Callable[[Any, int], Any],
                     page: int) -> None:
    """v2 set/get/exists of Mamba and SWA pages beside the KV pages; see the module docstring."""
    case = f"{connector}/hybrid"
    run_id = uuid.uuid4().hex[:8]
    extra = extra_config_for(connector, settings, tag=f"hy-{run_id}")
    kv_a, kv_b, swa_a, swa_b = make_pools("mha", "page_first", 4)
    for pool in (kv_a, swa_a):
        pool.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
    mamba_a, mamba_b = make_mamba(), make_mamba()
    mamba_b.temporal_buffer.zero_()
    for buf in mamba_b.conv_buffer:
        buf.zero_()
    a = attach(extra, kv_a, {PoolName.MAMBA: mamba_a, PoolName.SWA: swa_a}, storage_config, mla=False)
    b = attach(extra, kv_b, {PoolName.MAMBA: mamba_b, PoolName.SWA: swa_b}, storage_config, mla=False)
    try:
        n = 6
        keys = [f"{run_id}-h{i}" for i in range(n)]
        src, dst = [1 + 2 * i for i in range(n)], [20 + i for i in range(n)]
        src_slots, dst_slots = [2, 4, 6, 8, 10, 12], [1, 3, 5, 7, 9, 11]
        kv_orig = [page_bytes(kv_a, p) for p in src]
        swa_orig = [page_bytes(swa_a, p) for p in src]
        st_orig = [state_bytes(mamba_a, s) for s in src_slots]
        check(a.batch_set_v1(keys, indices(src)) == [True] * n, f"{case}: KV batch_set_v1")
        # Mamba states only at pages 3 and 6 (checkpoints), SWA for every page
        res = a.batch_set_v2([
            PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([src_slots[2], src_slots[5]]),
                         keys=[keys[2], keys[5]], hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(PoolName.SWA, host_indices=indices(src), keys=keys),
        ])
        check(res == {PoolName.MAMBA: [True, True], PoolName.SWA: [True] * n},
              f"{case}: batch_set_v2 returned {res}")
        check(set(res) == {PoolName.MAMBA, PoolName.SWA} and all(type(k) is PoolName for k in res),
              f"{case}: results are not keyed by the transfers' names: {list(res)}")
        # exists: KV everywhere, Mamba trailing window of 1 at 3 and 6, SWA everywhere
        got = b.batch_exists_v2(keys, [
            PoolTransfer(PoolName.MAMBA, keys=[keys[-1]], hit_policy=PoolHitPolicy.TRAILING_PAGES),
            PoolTransfer(PoolName.SWA, keys=keys[-2:], hit_policy=PoolHitPolicy.TRAILING_PAGES),
        ])
        check((got.kv_hit_pages, got.restorable_prefix_pages) == (6, [3, 6]),
              f"{case}: batch_exists_v2 gave {got}")
        check(got.extra_pool_hit_pages.get(PoolName.MAMBA) == 6 and got.extra_pool_hit_pages.get("kv") == 6,
              f"{case}: per-pool hits {got.extra_pool_hit_pages}")
        got = b.batch_exists_v2([*keys[:5], f"{run_id}-gap"], [
            PoolTransfer(PoolName.MAMBA, keys=[keys[4]], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        check((got.kv_hit_pages, got.restorable_prefix_pages) == (3, [3]), f"{case}: gap/trailing {got}")
        got = b.batch_exists_v2(keys, [PoolTransfer(PoolName.MAMBA, keys=keys)])  # all_pages
        check(got.kv_hit_pages == 0 and got.restorable_prefix_pages == [], f"{case}: all_pages {got}")
        # reads into pool set B, other slots; the same hash holds a KV page, an SWA page, a state
        check(b.batch_get_v1(keys, indices(dst)) == [True] * n, f"{case}: KV batch_get_v1")
        res = b.batch_get_v2([
            PoolTransfer(PoolName.MAMBA, keys=[keys[2], keys[5], keys[0]],
                         host_indices=torch.tensor([dst_slots[2], dst_slots[5], dst_slots[0]])),
            PoolTransfer(PoolName.SWA, host_indices=indices(dst), keys=keys),
        ])
        check(res == {PoolName.MAMBA: [True, True, False], PoolName.SWA: [True] * n},
              f"{case}: batch_get_v2 returned {res}")
        check(all(torch.equal(page_bytes(kv_b, d), o) for d, o in zip(dst, kv_orig)), f"{case}: KV bytes")
        check(all(torch.equal(page_bytes(swa_b, d), o) for d, o in zip(dst, swa_orig)), f"{case}: SWA bytes")
        pools = b.stats().get("extra_pools", {})  # each extra pool's own counters, by name
        check(pools.get("mamba", {}).get("ops", {}).get("get", {}).get("ok") == 2
              and pools.get("swa", {}).get("ops", {}).get("get", {}).get("ok") == n,
              f"{case}: per-pool stats {sorted(pools)}")
        check(torch.equal(state_bytes(mamba_b, dst_slots[2]), st_orig[2])
              and torch.equal(state_bytes(mamba_b, dst_slots[5]), st_orig[5]), f"{case}: Mamba bytes")
        # (what a miss leaves in its target slot is not specified: nixl's OBJ backend writes there)
        # bad transfers are per-pool misses, never exceptions
        res = b.batch_get_v2([
            PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1, 2, 3]), keys=[keys[2]]),
            PoolTransfer(PoolName.INDEXER, host_indices=indices(dst[:1]), keys=keys[:1]),
        ])
        check(res == {PoolName.MAMBA: [False], PoolName.INDEXER: [False]}, f"{case}: bad transfers {res}")
        # namespaces: another state shape and another model see none of these states
        (kv_c,) = make_pools("mha", "page_first", 1)
        for other_extra, model, conv_width in ((extra, "test-org/model-7b", 4), (extra, "other/model", 3)):
            o = attach(other_extra, kv_c, {PoolName.MAMBA: make_mamba(conv_width=conv_width)}, storage_config,
                       mla=False, model=model)
            pool = o.extra_pools["mamba"]
            check(pool.connector.batch_exists([keys[2], keys[5]]) == [False, False],
                  f"{case}: a Mamba pool of another {('shape', 'model')[conv_width == 3]} sees these states")
            o.close()
        # MLA: Mamba states are per TP rank and written by every rank; shared sidecars only by rank 0
        mla_extra = {**extra, "extra_backend_tag": f"hy-mla-{run_id}"}
        m0_kv, m1_kv, m0_side, m1_side = make_pools("mla", "page_first", 4)
        m1_side.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
        m0, m1 = (attach(mla_extra, kv, {PoolName.MAMBA: make_mamba(), PoolName.INDEXER: side},
                         storage_config, mla=True, tp_rank=rank, tp_size=2)
                  for rank, kv, side in ((0, m0_kv, m0_side), (1, m1_kv, m1_side)))
        res = m1.batch_set_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([3]), keys=keys[:1]),
                               PoolTransfer(PoolName.INDEXER, host_indices=indices([2]), keys=keys[:1])])
        check(res == {PoolName.MAMBA: [True], PoolName.INDEXER: [True]}, f"{case}: MLA rank-1 set {res}")
        check(m1.extra_pools["mamba"].connector.batch_exists(keys[:1]) == [True], f"{case}: rank 1 state")
        check(m0.extra_pools["mamba"].connector.batch_exists(keys[:1]) == [False],
              f"{case}: rank 0 sees rank 1's Mamba state")
        check(m0.extra_pools["indexer"].connector.batch_exists(keys[:1]) == [False],
              f"{case}: a non-writer MLA rank wrote a shared sidecar")
        for m in (m0, m1):
            m.clear()
            m.close()
        dsa_roundtrip({**extra, "extra_backend_tag": f"hy-dsa-{run_id}"}, case, run_id, check, storage_config)
        # clear() removes the extra pools' pages too
        a.clear()
        left = b.extra_pools["mamba"].connector.batch_exists([keys[2]])
        check(left == [False], f"{case}: clear left states")
    finally:
        a.close()
        b.close()
    res = b.batch_get_v2([PoolTransfer(PoolName.MAMBA, host_indices=torch.tensor([1]), keys=keys[:1])])
    check(res == {PoolName.MAMBA: [False]}, f"{case}: get_v2 after close {res}")
    # a Mamba pool SGLang cannot describe page by page is refused at attach, naming it
    (kv_d,) = make_pools("mha", "page_first", 1)
    bad = make_mamba()
    bad.slot_state_device_tensors = [torch.zeros(SLOTS, 4)]  # registered side states: no zero-copy
    try:
        attach(extra, kv_d, {PoolName.MAMBA: bad}, storage_config, mla=False).close()
        check(False, f"{case}: a Mamba pool with slot side states was accepted")
    except ConfigError as exc:
        check("'mamba'" in str(exc), f"{case}: refusal does not name the pool: {exc}")
