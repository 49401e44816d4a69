"""The loopback shim: an ``LD_PRELOAD`` library (``hicache_l3/engines/loopback_bind.c``,
built by pip as the optional extension ``hicache_l3._loopback_bind``) that turns a bind to
the wildcard address (0.0.0.0, ``[::]``) into a bind to loopback.

Mooncake's transfer engine listens on all interfaces (its handshake port on 0.0.0.0, its
TCP data port on ``[::]``) and has no setting to change that; the engine launcher preloads
the shim into every process it starts, and an operator can preload it into SGLang (README
"Security"). :data:`SHIM` is its path, or None when it was not built (no C compiler at
install time), with the reason in :data:`WHY_NOT`.
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
