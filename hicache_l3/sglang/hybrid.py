"""Hybrid models' extra host pools (SGLang's v2 storage interface): each pool kind gets a
connector of its own on the same engine, in a namespace naming the pool, its dtypes,
layout and segment sizes, so its pages are never read as another kind's. Imports torch
and SGLang only through the objects it is handed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError, MemoryRegistrationError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.logs import RateLimitedLogger
from hicache_l3.common.pages import Page
from hicache_l3.common.registry import open_connector
from hicache_l3.sglang.page_meta import PointerModel, learned_pointers

log = logging.getLogger("hicache_l3.sglang")

KV_POOL_NAMES = frozenset({"kv", "__default__"})
TP_SHARDED_POOLS = frozenset({"mamba"})  # per TP rank even when the model's KV is MLA-shared
ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"


def pool_name(name: Any) -> str:
    """The plain string of a ``PoolName`` (or of a plain string)."""
    return str(getattr(name, "value", name))


@dataclasses.dataclass
class ExtraPool:
    """One registered extra host pool and the connector holding its pages."""

    name: str
    host: Any
    connector: Connector[Any]
    page_tokens: int  # host indices per key (Mamba: 1 state slot)
    shared: bool  # MLA-shared across TP ranks: only the storage writer writes
    # None: pointers from SGLang's get_page_buffer_meta (the reference path; None forces it)
    pointer_model: PointerModel | None = None

    def pages(self, n: int, host_indices: Any) -> list[Page]:
        """The segments of the ``n`` pages at ``host_indices[i * page_tokens]``, in the
        pool's order (learned pointer model, else ``get_page_buffer_meta``)."""
        indices = host_indices.reshape(-1)
        if indices.device.type != "cpu":
            indices = indices.cpu()
        model = self.pointer_model
        got = model.pointers(indices, n) if model is not None else None
        if got is not None and model is not None:
            ptrs, sizes, per = got[0], got[1], model.per
        else:
            ptrs, sizes = self.host.get_page_buffer_meta(indices)
            per, rest = divmod(len(ptrs), n)
            if rest or per == 0 or len(sizes) != len(ptrs):
                raise ValueError(f"pool {self.name!r} described {n} pages with {len(ptrs)} segments")
        if per == 1:
            return list(zip(zip(ptrs, sizes)))
        return list(zip(*(zip(ptrs[r::per], sizes[r::per]) for r in range(per))))


def pool_attr(host: Any, name: str, pool: str = "") -> Any:
    """``host.<name>``, or ConfigError naming the pool and the attribute it lacks."""
    try:
        return getattr(host, name)
    except AttributeError:
        what = f"{pool!r} ({type(host).__name__})" if pool else type(host).__name__
        raise ConfigError(
            f"hicache-l3: host pool {what} has no attribute {name!r}, which the adapter reads to "
            "build its key namespace; this pool type is not supported"
        ) from None


def head_sharded(host: Any) -> bool:
    """Whether an extra pool's pages differ per TP rank (MHA host pools)."""
    if any(cls.__name__ == "MHATokenToKVPoolHost" for cls in type(host).__mro__):
        return True
    return getattr(host, "head_num", None) is not None and getattr(host, "kv_lora_rank", None) is None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def pool_buffers(host: Any) -> list[Any]:
    """The distinct tensors holding an extra pool's pages (``get_hybrid_pool_buffer``, else
    ``kv_buffer``)."""
    getter = getattr(host, "get_hybrid_pool_buffer", None)
    found = list(getter()) if getter is not None else []
    if not found:
        kv = getattr(host, "kv_buffer", None)
        found = list(kv) if isinstance(kv, (list, tuple)) else [kv]
    return distinct_tensors([t for t in found if t is not None and hasattr(t, "data_ptr")])


def distinct_tensors(found: Sequence[Any]) -> list[Any]:
    """``found`` without empty tensors and without tensors lying inside another one."""
    spans = sorted(((t.data_ptr(), t.numel() * t.element_size(), i)
                    for i, t in enumerate(found) if t.numel()), key=lambda s: (s[0], -s[1]))
    out: list[Any] = []
    end = 0
    for start, size, i in spans:
        if start + size <= end:
            continue
        out.append(found[i])
        end = max(end, start + size)
    return out


def open_extra_pool(
    name: str,
    host: Any,
    *,
    base: Namespace,
    tp_rank: int,
    connector_name: str,
    settings: dict[str, Any],
    probe: Callable[[Any], Any],
    make_indices: Callable[[list[int]], Any] | None = None,
) -> ExtraPool:
    """Open the connector of extra pool ``name`` and register the pool's buffers once.
    ``base``: this rank's KV namespace; ``probe(n)`` builds ``arange(n)``,
    ``make_indices(ints)`` an index tensor (to learn the pointer model). ConfigError naming
    the pool when SGLang cannot describe its pages."""
    layout = str(getattr(host, "layout", "") or "-")
    page_tokens = int(pool_attr(host, "page_size", name) or 1)
    dtypes = [_dtype_name(pool_attr(host, "dtype", name))]
    for extra in ("temporal_dtype", "conv_dtype", "indexer_dtype"):
        value = getattr(host, extra, None)
        if value is not None and _dtype_name(value) not in dtypes:
            dtypes.append(_dtype_name(value))
    try:
        ptrs, sizes = host.get_page_buffer_meta(probe(page_tokens))
    except Exception as exc:
        raise ConfigError(
            f"hicache-l3: host pool {name!r} ({type(host).__name__}, layout {layout!r}) gives no "
            f"page description for zero-copy storage I/O ({exc!r}); run this model without "
            "--hicache-storage-backend, or with a layout SGLang describes (page_first)"
        ) from exc
    if not ptrs or len(ptrs) != len(sizes):
        raise ConfigError(f"hicache-l3: host pool {name!r} ({type(host).__name__}) describes a page "
                          f"as {len(ptrs)} segments")
    shared = base.mla_shared and name not in TP_SHARDED_POOLS and not head_sharded(host)
    seg_list = [int(s) for s in sizes]
    segs = "x".join(map(str, seg_list)) if len(seg_list) <= 8 else (
        f"{len(seg_list)}seg{sum(seg_list)}b{hashlib.sha256(repr(seg_list).encode()).hexdigest()[:8]}")
    tag = f"{base.tag}+pool={name}+segs={segs}" if base.tag else f"pool={name}+segs={segs}"
    namespace = dataclasses.replace(
        base, kv_dtype="/".join(dtypes), layout=layout, page_size=page_tokens, tag=tag,
        mla_shared=shared, tp_rank=0 if shared else tp_rank,
    )
    pool_settings = dict(settings)
    if connector_name == "mooncake":
        pool_settings["global_segment_size"] = 0  # objects go into the segments already mounted
        if str(pool_settings.get("preferred_segment", "")) == "local":
            pool_settings["preferred_segment"] = ""  # "local" needs a segment of this client
    connector = open_registered(connector_name, namespace, pool_settings, pool_buffers(host),
                                tuple(zip(ptrs, sizes)), f"{name!r} ({type(host).__name__})")
    log.info("hicache-l3: %s connector attached for the %r pool (%s, %d bytes per page in %d segments)",
             connector_name, name, namespace.describe(), sum(int(s) for s in sizes), len(ptrs))
    model = None
    if make_indices is not None:
        model = learned_pointers(host, page_tokens, make_indices, f"the {name!r} pool")
    return ExtraPool(name, host, connector, page_tokens, shared, model)


def open_registered(connector_name: str, namespace: Namespace, settings: dict[str, Any],
                    buffers: Sequence[Any], page: Page, what: str) -> Connector[Any]:
    """Open a connector and register ``buffers`` with it; MemoryRegistrationError naming host
    pool ``what`` when ``page`` (a probed page) lies outside them. Closed on any failure."""
    connector = open_connector(connector_name, namespace, settings)
    try:
        for tensor in buffers:
            connector.register(tensor)
        if not connector.regions.covers(page):
            raise MemoryRegistrationError(f"hicache-l3: pages of host pool {what} lie outside the "
                                          "buffers it exposes; it cannot be served zero-copy")
    except Exception:
        connector.close()
        raise
    return connector


def transfer_pages(
    op: str, pool: ExtraPool, keys: list[str], host_indices: Any, is_writer: bool, warn: RateLimitedLogger
) -> list[bool]:
    """``batch_{op}_v2`` of one extra pool: per-key results; a length mismatch or an engine
    error are misses (logged rate-limited)."""
    n = len(keys)
    if not n:
        return []
    if op == "set" and pool.shared and not is_writer:
        return [True] * n  # the storage writer stores the same bytes
    if host_indices is None or int(host_indices.numel()) != n * pool.page_tokens:
        got = None if host_indices is None else int(host_indices.numel())
        warn.warning(f"v2-{op}-len", "hicache-l3: batch_%s_v2 of pool %r: %d keys but %s host indices "
                     "(%d per key)", op, pool.name, n, got, pool.page_tokens)
        return [False] * n
    try:
        pages = pool.pages(n, host_indices)
        move = pool.connector.batch_get if op == "get" else pool.connector.batch_set
        return move(keys, pages)
    except Exception as exc:
        warn.warning(f"v2-{op}-exc", "hicache-l3: batch_%s_v2 of %d pages of pool %r failed: %r",
                     op, n, pool.name, exc)
        return [False] * n


def restorable_prefixes(policy: str, present: list[bool], window: int) -> set[int]:
    """The prefix lengths (pages) one pool can restore: ``all_pages`` needs every page up to
    the end, ``trailing_pages`` the last ``window``; another policy restores nothing."""
    total = len(present)
    if policy == ALL_PAGES:
        end = present.index(False) if False in present else total
        return set(range(1, end + 1))
    if policy == TRAILING_PAGES:
        window = max(1, window)
        return {p for p in range(1, total + 1) if all(present[max(0, p - window) : p])}
    return set()
