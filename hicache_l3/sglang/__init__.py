"""SGLang integration. The adapter classes (``module_path = "hicache_l3.sglang"``) are
imported on first access, so the config, CLI and plugin never import SGLang or torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache_l3.sglang.backend import (
        HiCacheL3AsFile,
        HiCacheL3AsHf3fs,
        HiCacheL3AsMooncake,
        HiCacheL3AsNixl,
        HiCacheL3Storage,
    )

__all__ = ["HiCacheL3AsFile", "HiCacheL3AsHf3fs", "HiCacheL3AsMooncake", "HiCacheL3AsNixl",
           "HiCacheL3Storage"]


def __getattr__(name: str) -> Any:
    """The adapter classes of :mod:`.backend`, imported (with SGLang and torch) on first use."""
    if name in __all__:
        return getattr(importlib.import_module("hicache_l3.sglang.backend"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
