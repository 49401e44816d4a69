"""SGLang integration: the HiCache storage backend (:mod:`.backend`), its extra config
(:mod:`.config`), the ``sglang-args``/``check`` commands (:mod:`.cli`) and the opt-in plugin
that serves SGLang's built-in backend names (:mod:`.plugin`).

SGLang loads our backend with ``module_path = "hicache_l3.sglang"`` and
``class_name = "HiCacheL3Storage"``: the adapter classes are attributes of this package,
imported on first access, so that the config, the CLI and the plugin (which SGLang imports
in every process) never import SGLang or torch.
"""

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
