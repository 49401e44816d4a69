"""Heterogeneous TP through real SGLang 0.5.23 host pools; imported by sglang_roundtrip.py,
which runs it once per connector in the SGLang venv.

One model with 4 KV heads served at TP sizes 1, 2 and 4, every instance with
``tp_lcm_size = 4`` and the ``page_head`` host layout: real MHA host pools per rank (4, 2
and 1 heads), our backend built by SGLang's factory with the storage config SGLang's
controller builds (``should_split_heads`` where the TP size is below the lcm). Pages
written by one TP size are read by the others; the oracle is the TP=1 pool's bytes
sliced by head (``kv_buffer[k_or_v, page, heads]`` of the ``page_head`` layout).
Then: a page missing one head group is a miss everywhere; stores written without
``tp_lcm_size``, with another one, or in another layout are never read as head groups;
MLA with ``tp_lcm_size`` shares its latent pages across TP sizes; bad settings are
refused naming ``tp_lcm_size``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import torch
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from hicache_l3.common.errors import ConfigError
from hicache_l3.sglang.config import extra_config_for

HEADS = 4  # KV heads of the model
LCM = 4  # TP sizes 1, 2 and 4 share the store


def heads_of(pool: Any, page: int, lo: int, hi: int) -> torch.Tensor:
    """Oracle: K and V bytes of heads ``[lo, hi)`` of one page of a ``page_head`` pool."""
    return pool.kv_buffer[:, page, lo:hi].contiguous().view(torch.uint8).clone()


def hetero_tp_roundtrip(connector: str, settings: dict[str, Any], check: Callable[[bool, str], None],
                        make_pools: Callable[..., list[Any]], storage_config: Callable[..., Any],
                        indices: Callable[[list[int]], torch.Tensor],
                        page_bytes: Callable[[Any, int], torch.Tensor]) -> None:
    """TP=1, TP=2 and TP=4 instances of one model read each other's pages (see module docstring)."""
    case = f"{connector}/hetero-tp"
    run_id = uuid.uuid4().hex[:8]
    extra = {**extra_config_for(connector, settings, tag=f"htp-{run_id}"), "tp_lcm_size": LCM}
    opened: list[Any] = []

    def attach(cfg: dict[str, Any], pool: Any, **kw: Any) -> Any:
        b = StorageBackendFactory.create_backend("dynamic", storage_config(cfg, **kw), pool)
        b.register_mem_pool_host(pool)
        b.on_host_pools_registered()
        opened.append(b)
        return b

    def instance(tp: int, cfg: dict[str, Any] = extra, layout: str = "page_head") -> list[tuple[Any, Any]]:
        pools = make_pools("mha", layout, tp, heads=HEADS // tp)
        return [(attach(cfg, pool, mla=False, tp_rank=r, tp_size=tp, layout=layout), pool)
                for r, pool in enumerate(pools)]

    try:
        (t1, p1), = instance(1)
        t2 = instance(2)
        t4 = instance(4)
        check(t1.head_groups is not None and t1.head_groups.split == 4 and t2[1][0].head_groups.first == 2
              and t4[3][0].head_groups.split == 1, f"{case}: head groups {t1.head_groups}")
        check(t1.pointer_model is not None and t1.pointer_model.per == 2 * 4,
              f"{case}: no pointer model learned for the head groups: {t1.pointer_model}")
        p1.kv_buffer.view(torch.uint8).random_(0, 256)
        keys = [f"{run_id}-p{i}" for i in range(5)]
        src, dst = [1, 3, 5, 7, 9], [2, 4, 6, 8, 10]
        check(t1.batch_set_v1(keys, indices(src)) == [True] * 5, f"{case}: TP=1 set")
        # every rank of TP=2 and TP=4 reads its heads of TP=1's pages
        for tp, ranks in ((2, t2), (4, t4)):
            per = HEADS // tp
            for r, (b, pool) in enumerate(ranks):
                check(b.batch_exists([*keys, f"{run_id}-gap"]) == 5, f"{case}: TP={tp} rank {r} exists")
                check(b.batch_get_v1(keys, indices(dst)) == [True] * 5, f"{case}: TP={tp} rank {r} get")
                same = [torch.equal(heads_of(pool, d, 0, per), heads_of(p1, s, r * per, (r + 1) * per))
                        for s, d in zip(src, dst)]
                check(all(same), f"{case}: TP={tp} rank {r} read other heads: {same}")
        # SGLang's own pointer lists (get_split_heads_page_buffer_meta) give the same pages
        b, pool = t2[1]
        b.pointer_model = None
        check(b.batch_get_v1(keys[:2], indices([20, 21])) == [True, True]
              and all(torch.equal(heads_of(pool, d, 0, 2), heads_of(p1, s, 2, 4))
                      for s, d in ((1, 20), (3, 21))),
              f"{case}: TP=2 rank 1 through SGLang's split-heads pointer lists")
        # whole pages of the legacy copying path would mix TP sizes: refused, as misses
        flat = [p1.get_data_page(16, flat=True)]
        check(t1.batch_set([f"{run_id}-legacy"], flat) is False
              and t1.batch_get(keys[:1], [p1.get_dummy_flat_data_page()]) == [None],
              f"{case}: the legacy path served head groups")
        # the reverse: TP=2's ranks write, TP=1 reads whole pages
        for _, pool in t2:
            pool.kv_buffer.view(torch.uint8).random_(0, 256)
        back = [f"{run_id}-b{i}" for i in range(3)]
        for b, _ in t2:
            check(b.batch_set_v1(back, indices([11, 12, 13])) == [True] * 3, f"{case}: TP=2 set")
        check(t1.batch_get_v1(back, indices([14, 15, 16])) == [True] * 3, f"{case}: TP=1 get of TP=2 pages")
        for s, d in zip([11, 12, 13], [14, 15, 16]):
            want = torch.cat([t2[0][1].kv_buffer[:, s], t2[1][1].kv_buffer[:, s]], dim=1)
            got = p1.kv_buffer[:, d].contiguous().view(torch.uint8)
            check(torch.equal(got, want.contiguous().view(torch.uint8)), f"{case}: TP=1 page {d} from TP=2")
        # a page with one head group missing is a miss, for exists and get
        half = [f"{run_id}-half"]
        check(t2[0][0].batch_set_v1(half, indices([17])) == [True], f"{case}: TP=2 rank 0 alone set")
        check(t1.batch_exists([*back, *half]) == 3, f"{case}: TP=1 counts a page missing a head group")
        check(t1.batch_get_v1(half, indices([18])) == [False], f"{case}: TP=1 got a page missing a group")
        check(t2[0][0].batch_get_v1(half, indices([18])) == [True], f"{case}: rank 0 lost its own group")
        # no misreading across stores that differ in the split
        plain = {k: v for k, v in extra.items() if k != "tp_lcm_size"}
        others = {
            "without tp_lcm_size": instance(2, plain)[0][0],
            "with tp_lcm_size 2": instance(2, {**extra, "tp_lcm_size": 2})[0][0],
            "in page_first": instance(2, extra, "page_first")[0][0],
        }
        for what, o in others.items():
            check(o.batch_exists(keys) == 0 and o.batch_exists(back) == 0,
                  f"{case}: a store {what} reads head-group pages")
        plain_rank = others["without tp_lcm_size"]
        check(plain_rank.batch_set_v1(keys[:1], indices([19])) == [True], f"{case}: unsplit set")
        check(t2[0][0].batch_get_v1(keys[:1], indices([20])) == [True]
              and torch.equal(heads_of(t2[0][1], 20, 0, 2), heads_of(p1, src[0], 0, 2)),
              f"{case}: an unsplit store's page was read as a head group")
        # MLA: the latent page is not head-split; with tp_lcm_size TP sizes share one copy
        m1_pool, m2_pool, m3_pool = make_pools("mla", "page_first", 3)
        m1_pool.kv_buffer.view(torch.uint8).random_(0, 256)
        m1 = attach(extra, m1_pool, mla=True, tp_rank=0, tp_size=1)
        m2 = attach(extra, m2_pool, mla=True, tp_rank=1, tp_size=2)
        m_plain = attach(plain, m3_pool, mla=True, tp_rank=1, tp_size=2)
        check(m1.head_groups is None and m2.head_groups is None, f"{case}: MLA was head-split")
        check(m1.batch_set_v1(keys[:2], indices([1, 2])) == [True, True], f"{case}: MLA TP=1 set")
        check(m2.batch_get_v1(keys[:2], indices([3, 4])) == [True, True], f"{case}: MLA TP=2 get")
        check(all(torch.equal(page_bytes(m2_pool, d), page_bytes(m1_pool, s)) for s, d in ((1, 3), (2, 4))),
              f"{case}: MLA TP=2 read other bytes")
        check(m_plain.batch_exists(keys[:2]) == 0, f"{case}: MLA without tp_lcm_size shares across TP sizes")
        # refusals name the setting
        (bad_pool,) = make_pools("mha", "page_head", 1, heads=2)
        for cfg, kw, word in (({**extra, "tp_lcm_size": 3}, {"tp_size": 2}, "tp_lcm_size=3"),
                              ({**extra, "tp_lcm_size": 8}, {"tp_size": 2}, "tp_lcm_size=8"),
                              ({**extra, "interface_v1": 0}, {"tp_size": 2}, "interface_v1")):
            try:
                attach(cfg, bad_pool, mla=False, layout="page_head", **kw)
                check(False, f"{case}: {cfg.get('tp_lcm_size')}/{cfg['interface_v1']} was accepted")
            except (ConfigError, AssertionError) as exc:
                check(word in str(exc), f"{case}: refusal does not name {word}: {exc}")
        t1.clear()
        check(t2[1][0].batch_exists(keys) == 0, f"{case}: clear left head groups")
        for b in (*(b for b, _ in t2), m1, plain_rank):
            b.clear()
    finally:
        for b in opened:
            b.close()
