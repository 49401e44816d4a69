"""The loopback shim: an ``LD_PRELOAD`` library (``loopback_bind.c``, built as the optional
extension ``hicache_l3._loopback_bind``) that turns a bind to the wildcard address
(0.0.0.0, ``[::]``) into a bind to loopback; Mooncake's transfer engine has no setting for
that. :data:`SHIM` is its path, or None when it was not built (reason in :data:`WHY_NOT`).
"""

from __future__ import annotations

import importlib.util
import os


def _find() -> tuple[str | None, str]:
    spec = importlib.util.find_spec("hicache_l3._loopback_bind")
    if spec is None or spec.origin is None:
        return None, "hicache_l3._loopback_bind not built: reinstall with a C compiler (cc) present"
    return spec.origin, ""


SHIM, WHY_NOT = _find()


def preload_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``{"LD_PRELOAD": ...}`` that adds the shim to ``environ``'s (default: this process's)
    preload list; ``{}`` when the shim was not built."""
    if SHIM is None:
        return {}
    current = (os.environ if environ is None else environ).get("LD_PRELOAD", "")
    if SHIM in current.split():
        return {"LD_PRELOAD": current}
    return {"LD_PRELOAD": f"{SHIM} {current}".strip()}
