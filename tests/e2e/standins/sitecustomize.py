"""Test-only stand-ins that let SGLang 0.5.23 serve on a CPU without sgl-kernel's CPU build.

Loaded by the SGLang *server* processes of tests/e2e only: the test puts this directory first
on their PYTHONPATH, so Python imports this file at start-up (``sitecustomize``). Nothing
here is part of hicache-l3, and nothing here touches the L2<->L3 path under test (SGLang's
HiCacheController calling our backend's batch_exists/batch_get_v1/batch_set_v1, and for a
hybrid model the v2 calls of its extra host pools, with host-pool indices, and the connector
moving those host-pool pages to and from its engine).
What it replaces, each the plain-torch equivalent of the op it stands for:

1. ``sgl_kernel.copy_all_layer_kv_cache_cpu`` and ``sgl_kernel.assign_req_to_token_pool_cpu``:
   SGLang's CPU engine imports them from sgl-kernel, whose CPU build is source-only
   (AVX-512/AMX) while the PyPI wheel is CUDA-only. They move token rows inside the device
   (here: CPU) KV pool and fill the request->token table: L1 bookkeeping.
2. CUDA host registration of the host (L2) pools: SGLang builds them with
   ``pin_memory=True`` and calls ``cudaHostRegister``, which needs a CUDA driver. The pool
   memory itself is allocated exactly as SGLang allocates it; only the registration with
   CUDA is skipped (there is no device to DMA from).
3. The device<->host KV copy ops (``transfer_kv_*``) that ``pool_host/mha.py`` imports from
   ``sgl_kernel.kvcacheio`` only on CUDA/ROCm/XPU: they copy token rows between the device
   (L1) pool and the host (L2) pool, i.e. the L1<->L2 hop, with the same row arithmetic as
   sgl-kernel's ops (byte rows, item sizes, layout strides as SGLang passes them).
4. For hybrid sliding-window (SWA) models only: SGLang's ``torch_native`` attention backend
   writes a sliding-window layer's K/V at the SWA pool's slots (``out_cache_loc`` translated
   by ``SWAKVPool.translate_loc_from_full_to_swa``) but reads them back at the untranslated
   full-pool slots of ``req_to_token`` (``TorchNativeAttnBackend.forward_extend`` /
   ``forward_decode``), i.e. rows that depend on the allocators' history. The GPU backends
   translate; the stand-in does the same for the read: while a sliding-window layer runs,
   the backend sees ``req_to_token`` translated to SWA slots. L1 compute only, and a no-op
   for models without an SWA pool (the Llama).
5. For TP > 1 (the heterogeneous-TP scenario): SGLang builds a PyNccl (CUDA) communicator
   for every TP group unless the platform is NPU/XPU; the stand-in turns it off, so the
   groups all-reduce through torch.distributed (gloo) on CPU. With 3. this includes the
   ``page_head`` host layout's copies (``transfer_kv_per_layer_ph_lf``,
   ``transfer_kv_all_layer_lf_ph``).

Everything is installed lazily: a module is patched right after SGLang imports it, so a
process that never imports SGLang (pip, the tokenizer of pytest's tools) is unaffected.
When ``HICACHE_L3_E2E_STATS`` names a file, the process also writes the ``stats()`` of each
hicache-l3 backend it attaches to that file (JSON, every 0.5 s), with the ``stats()`` of each
extra host pool's connector (hybrid models) under ``"extra_pools"``: reading our own counters
from the test, without any change to the backend.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

# ---- raw byte rows ----------------------------------------------------------------------------


def _rows(ptr: int, stride: int, nrows: int, width: int) -> Any:
    """A uint8 view of ``nrows`` rows of ``width`` bytes, ``stride`` bytes apart, at ``ptr``."""
    import torch

    nbytes = (nrows - 1) * stride + width
    flat = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    return flat.as_strided((nrows, width), (stride, 1))


def _copy_rows(src_ptr: int, src_stride: int, src_idx: Any, dst_ptr: int, dst_stride: int,
               dst_idx: Any, width: int) -> None:
    """dst row dst_idx[j] <- src row src_idx[j] (``width`` bytes each), like sgl-kernel's ops."""
    if src_idx.numel() == 0:
        return
    src_idx, dst_idx = src_idx.long().cpu(), dst_idx.long().cpu()
    src = _rows(src_ptr, src_stride, int(src_idx.max()) + 1, width)
    dst = _rows(dst_ptr, dst_stride, int(dst_idx.max()) + 1, width)
    dst[dst_idx] = src[src_idx]


def _ptrs(table: Any) -> list[int]:
    """The addresses in one of SGLang's uint64 pointer tables."""
    import torch

    return [int(p) for p in table.view(torch.int64).tolist()]


# ---- 1. sgl_kernel's CPU ops ------------------------------------------------------------------


def copy_all_layer_kv_cache_cpu(data_ptrs: Any, strides: Any, tgt_loc: Any, src_loc: Any) -> None:
    """Buffer i (address data_ptrs[i], rows of strides[i] bytes): row tgt_loc[j] <- src_loc[j]."""
    import torch

    src = src_loc.clone()  # in-place safe: read all source rows before writing any
    for ptr, stride in zip(_ptrs(data_ptrs), strides.view(torch.int64).tolist()):
        n = int(max(int(src.max()), int(tgt_loc.max()))) + 1 if src.numel() else 0
        if n == 0:
            continue
        rows = _rows(ptr, int(stride), n, int(stride))
        rows[tgt_loc.long()] = rows[src.long()].clone()


def assign_req_to_token_pool_cpu(req_pool_indices: Any, req_to_token: Any, start_offset: Any,
                                 end_offset: Any, out_cache_loc: Any, pool_len: int) -> None:
    """req_to_token[req i, start[i]:end[i]] <- the next end[i]-start[i] entries of out_cache_loc."""
    offset = 0
    for req, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        req_to_token[req, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _unavailable(name: str) -> Callable[..., None]:
    def op(*args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"sgl_kernel.{name} is not provided by the e2e test stand-in "
                                  "(tests/e2e/standins/sitecustomize.py)")
    op.__name__ = name
    return op


def _install_sgl_kernel() -> None:
    """A module ``sgl_kernel`` with the two CPU ops above. SGLang's CPU modules also import
    other sgl-kernel CPU ops at import time (speculative decoding, MoE, quantisation...) that
    this tiny dense model never calls: those names resolve to an op that raises
    NotImplementedError naming itself, so a call would fail loudly, never silently."""
    if "sgl_kernel" in sys.modules:
        return
    module = types.ModuleType("sgl_kernel", "test stand-in: tests/e2e/standins/sitecustomize.py")
    module.copy_all_layer_kv_cache_cpu = copy_all_layer_kv_cache_cpu  # type: ignore[attr-defined]
    module.assign_req_to_token_pool_cpu = assign_req_to_token_pool_cpu  # type: ignore[attr-defined]

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _unavailable(name)

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    sys.modules["sgl_kernel"] = module


# ---- 2. no CUDA host registration ---------------------------------------------------------------


def _patch_pool_host_common(module: types.ModuleType) -> None:
    def _no_cuda_host_register(buffer: Any, registration_granularity_bytes: int | None = None) -> None:
        setattr(buffer, module._CUDA_HOST_REGISTERED_RANGES_ATTR, [])

    module._cuda_host_register = _no_cuda_host_register  # type: ignore[attr-defined]


# ---- 3. device<->host KV copies (sgl_kernel.kvcacheio) ------------------------------------------


def transfer_kv_per_layer(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any,
                          dst_indices: Any, item_size: int) -> None:
    """One layer, layer_first host rows <-> device rows, both ``item_size`` bytes apart."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy_rows(src.data_ptr(), item_size, src_indices, dst.data_ptr(), item_size, dst_indices,
                   item_size)


def transfer_kv_per_layer_pf_lf(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any,
                                dst_indices: Any, layer_id: int, item_size: int,
                                src_layout_dim: int) -> None:
    """One layer, page_first host (token rows of ``src_layout_dim`` bytes) -> device rows."""
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        _copy_rows(src.data_ptr() + layer_id * item_size, src_layout_dim, src_indices,
                   dst.data_ptr(), item_size, dst_indices, item_size)


def transfer_kv_all_layer(src_k_layers: Any, dst_k_layers: Any, src_v_layers: Any,
                          dst_v_layers: Any, src_indices: Any, dst_indices: Any, item_size: int,
                          num_layers: int) -> None:
    """Every layer, per-layer pointer tables on both sides (layer_first host)."""
    for src_t, dst_t in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        for src, dst in list(zip(_ptrs(src_t), _ptrs(dst_t)))[:num_layers]:
            _copy_rows(src, item_size, src_indices, dst, item_size, dst_indices, item_size)


def transfer_kv_all_layer_lf_pf(src_k_layers: Any, dst_k: Any, src_v_layers: Any, dst_v: Any,
                                src_indices: Any, dst_indices: Any, item_size: int,
                                dst_layout_dim: int, num_layers: int) -> None:
    """Every layer, device pointer tables -> page_first host token rows."""
    for src_t, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        for layer, src in enumerate(_ptrs(src_t)[:num_layers]):
            _copy_rows(src, item_size, src_indices, dst.data_ptr() + layer * item_size,
                       dst_layout_dim, dst_indices, item_size)


def transfer_kv_direct(src_layers: Sequence[Any], dst_layers: Sequence[Any], src_indices: Any,
                       dst_indices: Any, page_size: int) -> None:
    """Token rows of each layer tensor, src_layers[i] -> dst_layers[i] (direct io, layer_first)."""
    s, d = src_indices.long().cpu(), dst_indices.long().cpu()
    for src, dst in zip(src_layers, dst_layers):
        dst[d] = src[s]


def transfer_kv_per_layer_direct_pf_lf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any],
                                       src_indices: Any, dst_indices: Any, layer_id: int,
                                       page_size: int) -> None:
    """One layer, page_first_direct host [page, layer, slot, ...] -> device token rows."""
    s, d = src_indices.long().cpu(), dst_indices.long().cpu()
    for src, dst in zip(src_ptrs, dst_ptrs):
        dst[d] = src[s // page_size, layer_id, s % page_size]


def transfer_kv_all_layer_direct_lf_pf(src_ptrs: Sequence[Any], dst_ptrs: Sequence[Any],
                                       src_indices: Any, dst_indices: Any, page_size: int) -> None:
    """Every layer (src: K layers then V layers), device rows -> page_first_direct host."""
    s, d = src_indices.long().cpu(), dst_indices.long().cpu()
    layers = len(src_ptrs) // 2
    for half, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            dst[d // page_size, layer, d % page_size] = src_ptrs[half * layers + layer][s]


def transfer_kv_per_layer_ph_lf(src_k: Any, dst_k: Any, src_v: Any, dst_v: Any, src_indices: Any,
                                dst_indices: Any, layer_id: int, item_size: int, src_layout_dim: int,
                                page_size: int, head_num: int) -> None:
    """One layer, page_head host [page, head, slot, layer, dim] -> device token rows."""
    s, d = src_indices.long().cpu(), dst_indices.long().cpu()
    for src, dst in ((src_k, dst_k), (src_v, dst_v)):
        dst.view(dst.shape[0], head_num, -1)[d] = src[s // page_size, :, s % page_size, layer_id]


def transfer_kv_all_layer_lf_ph(src_k_layers: Any, dst_k: Any, src_v_layers: Any, dst_v: Any,
                                src_indices: Any, dst_indices: Any, item_size: int,
                                dst_layout_dim: int, num_layers: int, page_size: int,
                                head_num: int) -> None:
    """Every layer, device pointer tables -> page_head host [page, head, slot, layer, dim]."""
    import torch

    if src_indices.numel() == 0:
        return
    s, d = src_indices.long().cpu(), dst_indices.long().cpu()
    n = int(s.max()) + 1
    for src_t, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        host = dst.view(torch.uint8).view(*dst.shape[:4], -1)
        for layer, ptr in enumerate(_ptrs(src_t)[:num_layers]):
            rows = _rows(ptr, item_size, n, item_size).view(n, head_num, -1)
            host[d // page_size, :, d % page_size, layer] = rows[s]


_KVCACHEIO: dict[str, Callable[..., None]] = {
    f.__name__: f for f in (
        transfer_kv_per_layer, transfer_kv_per_layer_pf_lf, transfer_kv_all_layer,
        transfer_kv_all_layer_lf_pf, transfer_kv_direct, transfer_kv_per_layer_direct_pf_lf,
        transfer_kv_all_layer_direct_lf_pf, transfer_kv_per_layer_ph_lf, transfer_kv_all_layer_lf_ph,
    )
}


def _patch_pool_host_mha(module: types.ModuleType) -> None:
    for name, func in _KVCACHEIO.items():
        if not hasattr(module, name):  # only what SGLang left undefined on this platform
            setattr(module, name, func)


# ---- 4. torch_native attention reads sliding-window layers at their SWA slots --------------------


class _TranslatedReqToToken:
    """The ``req_to_token`` table of a req->token pool, translated to SWA-pool slots."""

    def __init__(self, req_to_token: Any, kv_pool: Any) -> None:
        self.req_to_token = kv_pool.translate_loc_from_full_to_swa(req_to_token.long()).to(
            req_to_token.dtype)


def _patch_torch_native_backend(module: types.ModuleType) -> None:
    cls = module.TorchNativeAttnBackend

    def reading_swa_slots(forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any, *args: Any,
                **kwargs: Any) -> Any:
            pool = self.token_to_kv_pool
            if not (self.use_sliding_window_kv_pool and pool.layers_mapping[layer.layer_id][1]):
                return forward(self, q, k, v, layer, forward_batch, *args, **kwargs)
            full = self.req_to_token_pool
            self.req_to_token_pool = _TranslatedReqToToken(full.req_to_token, pool)
            try:
                return forward(self, q, k, v, layer, forward_batch, *args, **kwargs)
            finally:
                self.req_to_token_pool = full
        run.__name__ = forward.__name__
        return run

    cls.forward_extend = reading_swa_slots(cls.forward_extend)
    cls.forward_decode = reading_swa_slots(cls.forward_decode)


# ---- our own counters, read from outside ----------------------------------------------------------


def _patch_hicache_l3_backend(module: types.ModuleType) -> None:
    path = os.environ.get("HICACHE_L3_E2E_STATS")
    cls = vars(module).get("HiCacheL3Storage")  # not getattr: never trigger a lazy import
    if not path or cls is None or getattr(cls, "_e2e_stats", False):
        return
    cls._e2e_stats = True
    backends: weakref.WeakSet[Any] = weakref.WeakSet()
    register = cls.register_mem_pool_host

    def register_mem_pool_host(self: Any, mem_pool_host: Any) -> None:
        register(self, mem_pool_host)
        backends.add(self)

    cls.register_mem_pool_host = register_mem_pool_host

    def dump() -> None:
        import time

        while True:
            time.sleep(0.5)
            live = list(backends)
            if not live:  # SGLang's other processes import us too: only the scheduler writes
                continue
            try:
                stats = [{"extra_pools": {}, **b.stats()} for b in live]
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(stats, f, default=str)
                os.replace(tmp, path)
            except Exception as exc:  # never disturb the server
                print(f"hicache-l3 e2e stats dump failed: {exc!r}", file=sys.stderr)

    threading.Thread(target=dump, name="hicache-l3-e2e-stats", daemon=True).start()


# ---- lazy installation --------------------------------------------------------------------------

def _patch_parallel_state(module: types.ModuleType) -> None:
    """TP > 1 on CPU: SGLang builds a PyNccl (CUDA) communicator for every TP group unless
    the platform is NPU/XPU; on CPU the groups' all-reduce is torch.distributed's (gloo)."""
    inner = module.init_model_parallel_group

    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        kwargs["use_pynccl"] = False
        return inner(*args, **kwargs)

    module.init_model_parallel_group = init_model_parallel_group  # type: ignore[attr-defined]


_AFTER_IMPORT: dict[str, Callable[[types.ModuleType], None]] = {
    "sglang.srt.distributed.parallel_state": _patch_parallel_state,
    "sglang.srt.mem_cache.pool_host.common": _patch_pool_host_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_pool_host_mha,
    "sglang.srt.layers.attention.torch_native_backend": _patch_torch_native_backend,
    "hicache_l3.sglang": _patch_hicache_l3_backend,
    "hicache_l3.sglang.backend": _patch_hicache_l3_backend,
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, patch: Callable[[types.ModuleType], None]) -> None:
        self.inner, self.patch = inner, patch

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.inner.exec_module(module)
        self.patch(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after its own code has run."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        patch = _AFTER_IMPORT.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader, patch)
        return spec


if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a hung test: dump every stack
    _install_sgl_kernel()
    sys.meta_path.insert(0, _AfterImport())
