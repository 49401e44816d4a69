"""SGLang HiCache L3 backend over any hicache-l3 connector (SGLang's dynamic backend).

With ``interface_v1 = 1`` pages move zero-copy between the registered host pool and the
engine; the legacy ``batch_get``/``batch_set`` copy through one registered staging buffer.
Engine errors never raise into SGLang's threads: they are misses, logged rate-limited.
This module imports SGLang and torch; nothing else in the package imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransfer,
    PoolTransferResult,
)

from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.logs import RateLimitedLogger
from hicache_l3.common.pages import PointerPages
from hicache_l3.sglang.config import AdapterConfig, build_namespace
from hicache_l3.sglang.head_groups import HeadGroups, SplitHeadsView, groups_tag, head_groups
from hicache_l3.sglang.hybrid import (
    KV_POOL_NAMES,
    ExtraPool,
    distinct_tensors,
    open_extra_pool,
    open_registered,
    pool_attr,
    pool_name,
    restorable_prefixes,
    transfer_pages,
)
from hicache_l3.sglang.metrics import ReasonCounts, publish
from hicache_l3.sglang.page_meta import PointerModel, learned_pointers

log = logging.getLogger("hicache_l3.sglang")

STAGING_BYTES = 64 << 20  # legacy copying path: most bytes staged per connector call


def index_tensor(values: list[int]) -> torch.Tensor:
    """Host indices as SGLang's controller hands them (int64, CPU)."""
    return torch.tensor(values, dtype=torch.int64)


def _pool_buffers(host: Any) -> list[torch.Tensor]:
    """The host pool's tensors that hold page bytes (registered once with the connector)."""
    found: list[torch.Tensor] = []
    kv = getattr(host, "kv_buffer", None)
    if isinstance(kv, torch.Tensor):
        found.append(kv)
    elif isinstance(kv, (list, tuple)):
        found.extend(t for t in kv if isinstance(t, torch.Tensor))
    if getattr(host, "layout", None) == "page_first_kv_split":
        for name in ("k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
            t = getattr(host, name, None)
            if isinstance(t, torch.Tensor):
                found.append(t)
    return distinct_tensors(found)  # views such as MHA's k_buffer/v_buffer lie inside kv_buffer


class HiCacheL3Storage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` backed by the hicache-l3 connector named in the extra config.

    ConfigError at construction for a bad extra config or a model without name or tag, and
    at :meth:`register_mem_pool_host` for a pool it cannot serve. Thread-safe.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        self.adapter = AdapterConfig.from_extra_config(storage_config.extra_config)
        self.adapter.validate_settings()
        if not storage_config.model_name and not self.adapter.tag:
            build_namespace(model_name=None, tag="", kv_dtype="-", layout="-", page_size=1)  # raises
        self.is_writer = bool(storage_config.is_storage_writer)
        self.connector: Connector[Any] | None = None
        self.namespace: Namespace | None = None
        self._rank_namespace: Namespace | None = None  # this rank's shard (extra pools' base)
        self.mem_pool_host: Any = None
        self.page_tokens = 0  # host indices per page (logical page size)
        # None: pointers from SGLang's get_page_buffer_meta (the reference path)
        self.pointer_model: PointerModel | None = None
        self.page_bytes = 0
        # heterogeneous TP: pages stored per head group (None: one object per page)
        self.head_groups: HeadGroups | None = None
        self._meta_host: Any = None  # what SGLang's page pointers come from (the pool, or its head groups)
        self._objects_per_page = 1  # stored objects per page (head groups of this rank)
        self._lock = threading.Lock()
        self._staging_lock = threading.Lock()
        self._staging: torch.Tensor | None = None
        self._log = RateLimitedLogger(log)
        self._metrics_lock = threading.Lock()
        self._prefetch_pgs: list[int] = []
        self._backup_pgs: list[int] = []
        self._prefetch_bw: list[float] = []
        self._backup_bw: list[float] = []
        self._reasons = ReasonCounts()
        self.extra_pools: dict[str, ExtraPool] = {}
        self._pending_pools: dict[str, Any] = {}
        if not self.adapter.interface_v1:
            log.warning(
                "hicache-l3: the extra config lacks \"interface_v1\": 1, so SGLang will copy every "
                "page through the legacy batch_get/batch_set path; add it for zero-copy transfers"
            )

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Complete the namespace from the pool, open the connector, register the pool's
        buffers once. Raises ConfigError naming the layout/pool when it cannot be served."""
        with self._lock:
            if self.connector is not None:
                if mem_pool_host is self.mem_pool_host:
                    return
                raise ConfigError("hicache-l3: a host pool is already registered with this backend")
            host = mem_pool_host
            layout = str(getattr(host, "layout", ""))
            page_tokens = int(getattr(host, "logical_page_size", None) or pool_attr(host, "page_size"))
            kv_dtype = str(pool_attr(host, "dtype")).removeprefix("torch.")
            pool_page_size = int(pool_attr(host, "page_size"))
            sc = self.storage_config
            groups = head_groups(sc, host)
            if groups is not None and not self.adapter.interface_v1:
                raise ConfigError("hicache-l3: tp_lcm_size (pages stored per head group) needs "
                                  "\"interface_v1\": 1 in the extra config")
            split = groups is not None and groups.split > 1
            meta_host = SplitHeadsView(host, groups.split) if groups is not None and split else host
            try:
                ptrs, sizes = meta_host.get_page_buffer_meta(torch.arange(page_tokens, dtype=torch.int64))
            except Exception as exc:
                raise ConfigError(
                    f"hicache-l3: host pool {type(host).__name__} with layout {layout!r} gives no page "
                    f"buffer description ({exc!r}); use --hicache-mem-layout page_first, "
                    "page_first_direct, page_head or layer_first"
                ) from exc
            if not ptrs or len(ptrs) != len(sizes):
                raise ConfigError(f"hicache-l3: host pool {type(host).__name__} ({layout}) describes "
                                  f"a page as {len(ptrs)} segments")
            tag = self.adapter.tag
            fmt = getattr(host, "storage_format_tag", None)
            if fmt:
                tag = f"{tag}+fmt={fmt}" if tag else f"fmt={fmt}"
            any_tp_size = bool(sc.is_mla_model and sc.tp_lcm_size)  # one latent copy for every TP size
            shard = dict(model_name=sc.model_name, kv_dtype=kv_dtype, layout=layout, page_size=pool_page_size,
                         mla_shared=bool(sc.is_mla_model), pp_rank=sc.pp_rank, pp_size=sc.pp_size,
                         cp_rank=sc.attn_cp_rank, cp_size=sc.attn_cp_size,
                         dcp_rank=sc.dcp_rank, dcp_size=sc.dcp_size)
            rank_namespace = build_namespace(tag=tag, tp_rank=sc.tp_rank,
                                             tp_size=1 if any_tp_size else sc.tp_size, **shard)
            namespace = rank_namespace if groups is None else build_namespace(
                tag=groups_tag(tag, groups), tp_rank=0, tp_size=groups.lcm, **shard)
            if sc.tp_lcm_size and groups is None and not sc.is_mla_model:
                log.warning("hicache-l3: tp_lcm_size=%s has no effect with host layout %r: pages are "
                            "stored per TP rank and size; use --hicache-mem-layout page_head to share "
                            "them across TP sizes", sc.tp_lcm_size, layout)
            connector = open_registered(self.adapter.connector, namespace, self.adapter.settings,
                                        _pool_buffers(host), tuple(zip(ptrs, sizes)),
                                        f"{type(host).__name__} ({layout})")
            self.mem_pool_host = host
            self.page_tokens = page_tokens
            self.pointer_model = learned_pointers(meta_host, page_tokens, index_tensor,
                                                  f"host pool ({layout})")
            self.page_bytes = int(sum(sizes))
            self.head_groups = groups
            self._meta_host = meta_host
            self._objects_per_page = 1 if groups is None else groups.split
            self.namespace = namespace
            self._rank_namespace = rank_namespace
            self.connector = connector
            log.info("hicache-l3: %s connector attached (%s, %d bytes per page in %d segments%s)",
                     self.adapter.connector, namespace.describe(), self.page_bytes, len(ptrs),
                     "" if groups is None else f", head groups {groups.suffixes} of {groups.lcm}")
            pending, self._pending_pools = self._pending_pools, {}
        for name, pool in pending.items():
            self.register_mem_host_pool_v2(pool, name)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Register a hybrid model's extra host pool (once per name) with a connector and
        namespace of its own. ConfigError naming a pool it cannot serve."""
        name = pool_name(host_pool_name)
        with self._lock:
            if name in KV_POOL_NAMES:
                return
            if self.connector is None or self._rank_namespace is None:
                self._pending_pools[name] = host_pool  # opened once the KV pool is attached
                return
            known = self.extra_pools.get(name)
            if known is not None:
                if known.host is host_pool:
                    return
                raise ConfigError(f"hicache-l3: another host pool is already registered as {name!r}")
            self.extra_pools[name] = open_extra_pool(
                name, host_pool, base=self._rank_namespace, tp_rank=self.storage_config.tp_rank,
                connector_name=self.adapter.connector, settings=self.adapter.settings,
                probe=lambda n: torch.arange(n, dtype=torch.int64), make_indices=index_tensor,
            )

    def on_host_pools_registered(self) -> None:
        """End of SGLang's attach: every extra pool registered so far has its connector."""
        if self._pending_pools:
            raise ConfigError(f"hicache-l3: extra host pools {sorted(self._pending_pools)} were "
                              "registered without a KV host pool (register_mem_pool_host)")
        if self.extra_pools:
            log.info("hicache-l3: serving extra host pools %s through the v2 interface",
                     sorted(self.extra_pools))

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        """Load each transfer's pages (key i into its pool at ``host_indices[i * page_size]``);
        ``{transfer.name: one bool per key}``, True only for the exact stored bytes."""
        return {t.name: self._v2_transfer("get", t) for t in transfers}

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        """Store each transfer's pages under its keys (pages already stored are not rewritten);
        ``{transfer.name: one bool per key}``."""
        return {t.name: self._v2_transfer("set", t) for t in transfers}

    def _v2_transfer(self, op: str, transfer: PoolTransfer) -> list[bool]:
        keys = list(transfer.keys or [])
        name = pool_name(transfer.name)
        if name in KV_POOL_NAMES:
            if op == "set" and keys and not self.is_writer:
                return [True] * len(keys)
            if transfer.host_indices is None:
                return [False] * len(keys)
            return self._zero_copy(op, keys, transfer.host_indices)
        pool = self.extra_pools.get(name)
        if pool is None:
            if keys:
                self._log.warning(f"v2-{op}-unknown-{name}", "hicache-l3: batch_%s_v2 for pool %r, "
                                  "which was not registered (register_mem_host_pool_v2)", op, name)
            return [False] * len(keys)
        return transfer_pages(op, pool, keys, transfer.host_indices, self.is_writer, self._log)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The usable prefix of ``keys`` over the KV pages and every pool of ``pool_transfers``
        under their hit policies (``all_pages``, ``trailing_pages``); engine errors are misses."""
        kv_pages = self.batch_exists(keys, extra_info)
        hit_count: dict[Any, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = pool_name(transfer.name)
            pool = self.extra_pools.get(name)
            present = [False] * kv_pages
            if name in KV_POOL_NAMES:
                present = [True] * kv_pages
            elif pool is not None:
                try:
                    present = pool.connector.batch_exists(list(keys[:kv_pages]))
                except Exception as exc:
                    self._log.warning("v2-exists-exc", "hicache-l3: batch_exists_v2 of pool %r failed: %r",
                                      name, exc)
            policy = str(getattr(transfer.hit_policy, "value", transfer.hit_policy))
            can = restorable_prefixes(policy, present, len(transfer.keys or ()))
            if policy not in ("all_pages", "trailing_pages"):
                self._log.warning(f"v2-policy-{policy}", "hicache-l3: hit policy %r of pool %r is not "
                                  "supported; its pages count as misses", policy, name)
            if can:
                hit_count[transfer.name] = max(can)
            restorable &= can
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hit_count, ordered)

    def _pages(self, n: int, host_indices: torch.Tensor) -> PointerPages:
        """The ``n`` pages at ``host_indices[i * page_tokens]`` (``split`` objects a page with
        head groups), from the learned pointer model when it applies, else SGLang's
        ``get_page_buffer_meta``."""
        assert self.mem_pool_host is not None
        need = n * self.page_tokens
        indices = host_indices if host_indices.numel() == need else host_indices[:need]
        if indices.numel() != need:
            raise ValueError(f"{n} keys but {host_indices.numel()} host indices "
                             f"(page size {self.page_tokens})")
        if not indices.is_cpu:
            indices = indices.cpu()
        model = self.pointer_model
        if model is not None:
            got = (model.pointers_at(indices.data_ptr(), n)
                   if indices.dtype is torch.int64 and indices.is_contiguous() else None)
            if got is None:
                got = model.pointer_array(indices, n)
            if got is not None:
                return PointerPages(got[0], got[1], model.per // self._objects_per_page)
        ptrs, sizes = self._meta_host.get_page_buffer_meta(indices)
        per, rest = divmod(len(ptrs), n * self._objects_per_page)
        if rest or per == 0 or len(sizes) != len(ptrs):
            raise ValueError(f"host pool described {n} pages with {len(ptrs)} segments")
        return PointerPages(ptrs, sizes, per)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load page i (key ``keys[i]``) into the pool at ``host_indices[i * page_size]``;
        one bool per key, True only for the exact stored bytes."""
        return self._zero_copy("get", keys, host_indices)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pool pages at ``host_indices[i * page_size]`` under ``keys[i]``; one bool
        per key. Non-writer MLA ranks store nothing and report success."""
        if keys and not self.is_writer:
            return [True] * len(keys)
        return self._zero_copy("set", keys, host_indices)

    def _zero_copy(self, op: str, keys: list[str], host_indices: torch.Tensor) -> list[bool]:
        """``batch_{op}_v1``; engine errors and a detached backend are misses."""
        if not keys:
            return []
        connector = self.connector
        if connector is None:
            self._log.warning(f"{op}-unattached", "hicache-l3: batch_%s_v1 with no connector "
                              "(before register_mem_pool_host, or after close)", op)
            return [False] * len(keys)
        start = time.perf_counter()
        move = connector.batch_get if op == "get" else connector.batch_set
        groups = self.head_groups
        try:
            pages = self._pages(len(keys), host_indices)
            if groups is not None:
                ok = groups.fold(move(groups.keys(keys), pages))
            else:
                ok = move(keys if type(keys) is list else list(keys), pages)
        except Exception as exc:
            self._log.warning(f"{op}-exc", "hicache-l3: batch_%s_v1 of %d pages failed: %r",
                              op, len(keys), exc)
            return [False] * len(keys)
        if op == "get":
            self._record(self._prefetch_pgs, self._prefetch_bw, ok, start)
        else:
            self._record(self._backup_pgs, self._backup_bw, ok, start)
        return ok

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many keys, from the first, are stored (any batch size; 0 on engine errors)."""
        if not keys:
            return 0
        connector = self.connector
        if connector is None:
            return 0
        groups = self.head_groups
        try:
            if groups is not None:
                return groups.leading_pages(connector.leading_hits(groups.keys(keys)))
            return connector.leading_hits(list(keys))
        except Exception as exc:
            self._log.warning("exists-exc", "hicache-l3: batch_exists of %d keys failed: %r", len(keys), exc)
            return 0

    def exists(self, key: str) -> bool:
        """True when ``key`` is stored in this namespace."""
        return self.batch_exists([key]) == 1

    def _staging_buffer(self) -> tuple[torch.Tensor, int]:
        """The registered staging tensor and how many pages it holds (allocated on first use)."""
        assert self.connector is not None and self.page_bytes > 0
        if self._staging is None:
            slots = max(1, STAGING_BYTES // self.page_bytes)
            staging = torch.empty(slots * self.page_bytes, dtype=torch.uint8)
            self.connector.register(staging)
            self._staging = staging
        return self._staging, self._staging.numel() // self.page_bytes

    def _as_bytes(self, tensor: torch.Tensor) -> torch.Tensor | None:
        flat = tensor.reshape(-1)
        if flat.numel() * flat.element_size() != self.page_bytes:
            self._log.warning("legacy-size", "hicache-l3: legacy page of %d bytes, expected %d",
                              flat.numel() * flat.element_size(), self.page_bytes)
            return None
        return flat.contiguous().view(torch.uint8)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Legacy: store ``values[i]`` (flat page tensors) under ``keys[i]`` through the staging
        buffer; True when every page is stored."""
        if not keys or not self.is_writer:
            return True
        if self.connector is None or values is None or len(values) != len(keys) or self.head_groups:
            return False  # head groups: the zero-copy path only (whole pages would mix TP sizes)
        try:
            with self._staging_lock:
                staging, slots = self._staging_buffer()
                pb, base = self.page_bytes, staging.data_ptr()
                all_ok = True
                for lo in range(0, len(keys), slots):
                    chunk_keys, chunk_pages = [], []
                    present = self.connector.batch_exists(list(keys[lo : lo + slots]))
                    for j, (key, value) in enumerate(zip(keys[lo : lo + slots], values[lo : lo + slots])):
                        if present[j]:
                            continue  # already stored: not written again
                        data = self._as_bytes(value)
                        if data is None:
                            all_ok = False
                            continue
                        staging[j * pb : (j + 1) * pb].copy_(data)
                        chunk_keys.append(key)
                        chunk_pages.append(((base + j * pb, pb),))
                    if chunk_keys:
                        start = time.perf_counter()
                        ok = self.connector.batch_set(chunk_keys, chunk_pages)
                        self._record(self._backup_pgs, self._backup_bw, ok, start)
                        all_ok = all_ok and all(ok)
                return all_ok
        except Exception as exc:
            self._log.warning("lset-exc", "hicache-l3: legacy batch_set of %d pages failed: %r",
                              len(keys), exc)
            return False

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        """Legacy: store one flat page tensor under ``key``."""
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Legacy: load ``keys[i]`` into ``target_locations[i]`` (flat page tensors) through the
        staging buffer; the filled tensor per hit, None per miss."""
        out: list[torch.Tensor | None] = [None] * len(keys)
        if not keys or self.connector is None or target_locations is None or self.head_groups:
            return out
        try:
            with self._staging_lock:
                staging, slots = self._staging_buffer()
                pb, base = self.page_bytes, staging.data_ptr()
                for lo in range(0, len(keys), slots):
                    chunk = list(keys[lo : lo + slots])
                    pages = [((base + j * pb, pb),) for j in range(len(chunk))]
                    start = time.perf_counter()
                    ok = self.connector.batch_get(chunk, pages)
                    self._record(self._prefetch_pgs, self._prefetch_bw, ok, start)
                    for j, hit in enumerate(ok):
                        target = target_locations[lo + j]
                        if not hit or target is None:
                            continue
                        flat = target.reshape(-1)
                        if flat.numel() * flat.element_size() != pb or not flat.is_contiguous():
                            continue
                        flat.view(torch.uint8).copy_(staging[j * pb : (j + 1) * pb])
                        out[lo + j] = target
        except Exception as exc:
            self._log.warning("lget-exc", "hicache-l3: legacy batch_get of %d pages failed: %r",
                              len(keys), exc)
        return out

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Legacy: load ``key`` into the flat page tensor ``target_location``; None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def _record(self, pgs: list[int], bws: list[float], ok: Sequence[bool], start: float) -> None:
        hits = ok.count(True) if type(ok) is list else sum(ok)
        if not hits:
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        with self._metrics_lock:
            pgs.append(hits)
            bws.append(hits * self.page_bytes / elapsed / 1e9)

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` since the last call, then reset; attribute
        ``hicache_l3``: pages per pool, op and result since the last call (also added to
        the Prometheus counter ``hicache_l3_pages_total``)."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        metrics = StorageMetrics()
        connectors = {"kv": self.connector, **{n: p.connector for n, p in self.extra_pools.items()}}
        try:
            deltas = self._reasons.delta({n: c.metrics.snapshot() for n, c in connectors.items()
                                          if c is not None})
            publish(deltas, int(self.storage_config.tp_rank or 0))
        except Exception as exc:  # metrics never fail SGLang's scheduler loop
            self._log.warning("stats-exc", "hicache-l3: per-reason storage metrics failed: %r", exc)
            deltas = {}
        metrics.hicache_l3 = deltas
        with self._metrics_lock:
            metrics.prefetch_pgs.extend(self._prefetch_pgs)
            metrics.backup_pgs.extend(self._backup_pgs)
            metrics.prefetch_bandwidth.extend(self._prefetch_bw)
            metrics.backup_bandwidth.extend(self._backup_bw)
            self._prefetch_pgs.clear()
            self._backup_pgs.clear()
            self._prefetch_bw.clear()
            self._backup_bw.clear()
        return metrics

    def stats(self) -> dict[str, Any]:
        """The KV connector's stats, with ``"extra_pools"`` (by pool name) for a hybrid
        model; ``{}`` once closed."""
        if self.connector is None:
            return {}
        out = self.connector.stats()
        if self.extra_pools:
            out["extra_pools"] = {name: pool.connector.stats() for name, pool in self.extra_pools.items()}
        return out

    def clear(self) -> None:
        """Remove this namespace's pages and those of its extra pools."""
        connectors = [self.connector] + [p.connector for p in self.extra_pools.values()]
        for connector in connectors:
            if connector is None:
                continue
            try:
                connector.clear()
            except Exception as exc:
                self._log.warning("clear-exc", "hicache-l3: clear failed: %r", exc)

    def close(self) -> None:
        """Close the connectors (idempotent); later calls are misses."""
        connector, self.connector = self.connector, None
        pools = list(self.extra_pools.values())
        for pool in pools:
            pool.connector.close()
        if connector is not None:
            connector.close()

    def __repr__(self) -> str:
        ns = self.namespace.describe() if self.namespace else "not attached"
        return f"<{type(self).__name__} {self.adapter.connector} {ns}>"


class _BuiltinName(HiCacheL3Storage):
    """Our adapter under one of SGLang's built-in backend names (the opt-in plugin), with
    the connector of that name and settings translated by ``takeover_extra_config``."""

    builtin: ClassVar[str] = ""

    def __init__(self, storage_config: HiCacheStorageConfig, mem_pool_host: Any = None):
        from hicache_l3.sglang.takeover import announce, takeover_extra_config

        announce(self.builtin)
        ranks = max(1, int(storage_config.tp_size or 1)) * max(1, int(storage_config.pp_size or 1))
        extra = takeover_extra_config(self.builtin, storage_config.extra_config, ranks=ranks)
        super().__init__(dataclasses.replace(storage_config, extra_config=extra))

    @classmethod
    def from_env_config(cls, bytes_per_page: int, dtype: Any, storage_config: HiCacheStorageConfig
                        ) -> _BuiltinName:
        """SGLang's constructor call for ``hf3fs`` (page size and dtype come from the pool)."""
        return cls(storage_config)


class HiCacheL3AsFile(_BuiltinName):
    """``--hicache-storage-backend file`` served by our file connector."""

    builtin = "file"


class HiCacheL3AsMooncake(_BuiltinName):
    """``--hicache-storage-backend mooncake`` served by our Mooncake connector."""

    builtin = "mooncake"


class HiCacheL3AsNixl(_BuiltinName):
    """``--hicache-storage-backend nixl`` served by our NIXL connector."""

    builtin = "nixl"


class HiCacheL3AsHf3fs(_BuiltinName):
    """``--hicache-storage-backend hf3fs`` served by our 3FS connector."""

    builtin = "hf3fs"
