"""Opt-in SGLang plugin (``sglang.srt.plugins``): serves the built-in backend names listed
in ``HICACHE_L3_SGLANG_BACKENDS`` with hicache-l3, on SGLang's zero-copy page path; does
nothing when it is unset. Imports neither SGLang nor torch at import time.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hicache_l3.sglang.takeover import ENV, TAKEOVER_CLASSES, takeover_names

log = logging.getLogger("hicache_l3.sglang.plugin")

ATTACH_TARGET = "sglang.srt.managers.cache_controller.HiCacheController.attach_storage_backend"


def use_zero_copy(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """After ``attach_storage_backend``: give our backend the zero-copy page functions."""
    from hicache_l3.sglang.backend import HiCacheL3Storage

    if isinstance(getattr(controller, "storage_backend", None), HiCacheL3Storage):
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
        log.info("hicache-l3: %s uses the zero-copy page path", type(controller.storage_backend).__name__)


def install() -> None:
    """Take over the backends named in ``HICACHE_L3_SGLANG_BACKENDS``; nothing when unset."""
    names = takeover_names(os.environ.get(ENV))
    if not names:
        return
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name in names:
        StorageBackendFactory.register_backend(name, "hicache_l3.sglang", TAKEOVER_CLASSES[name])
    HookRegistry.register(ATTACH_TARGET, use_zero_copy, HookType.AFTER)
    log.info("hicache-l3: serving SGLang's %s storage backend(s) (%s)", ", ".join(names), ENV)
