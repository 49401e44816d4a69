"""Opt-in SGLang plugin: ``--hicache-storage-backend file|mooncake|nixl|hf3fs`` served by hicache-l3.

Installed as an entry point of SGLang's general plugin group (``sglang.srt.plugins``),
which SGLang loads in every process. It does nothing unless the environment names the
built-in backends to take over::

    HICACHE_L3_SGLANG_BACKENDS=file,mooncake   # or "all"
    python -m sglang.launch_server ... --enable-hierarchical-cache --hicache-storage-backend file

For each name it registers our adapter under that name in SGLang's
``StorageBackendFactory`` (SGLang logs "Backend 'file' is already registered,
overwriting"), and it hooks ``HiCacheController.attach_storage_backend`` so that our
backend gets SGLang's zero-copy page path whatever its name: SGLang picks that path by
name, and the in-tree ``file`` name would otherwise land on the copying legacy path.

The settings each name gets are described in :mod:`hicache_l3.sglang.takeover`. To go back
to SGLang's backends, unset the variable (or set ``SGLANG_PLUGINS`` to a list without
``hicache_l3``).

Nothing here imports SGLang or torch at import time: SGLang imports this module in every
process, opted in or not.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from hicache_l3.sglang.takeover import ENV, TAKEOVER_CLASSES, takeover_names

log = logging.getLogger("hicache_l3.sglang.plugin")

ATTACH_TARGET = "sglang.srt.managers.cache_controller.HiCacheController.attach_storage_backend"


def use_zero_copy(result: Any, controller: Any, *args: Any, **kwargs: Any) -> None:
    """After ``attach_storage_backend``: give our backend the zero-copy page functions
    (SGLang chose them by backend name)."""
    from hicache_l3.sglang.backend import HiCacheL3Storage

    if isinstance(getattr(controller, "storage_backend", None), HiCacheL3Storage):
        controller.page_get_func = controller._page_get_zero_copy
        controller.page_set_func = controller._page_set_zero_copy
        log.info("hicache-l3: %s uses the zero-copy page path", type(controller.storage_backend).__name__)


def install() -> None:
    """Entry point of the ``sglang.srt.plugins`` group: take over the backends named in
    ``HICACHE_L3_SGLANG_BACKENDS``; nothing when it is unset."""
    names = takeover_names(os.environ.get(ENV))
    if not names:
        return
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for name in names:
        StorageBackendFactory.register_backend(name, "hicache_l3.sglang", TAKEOVER_CLASSES[name])
    HookRegistry.register(ATTACH_TARGET, use_zero_copy, HookType.AFTER)
    log.info("hicache-l3: serving SGLang's %s storage backend(s) (%s)", ", ".join(names), ENV)
