"""SGLang's built-in backend names served by hicache-l3: which names the environment asks us to
take over, and the extra config of our adapter under each name.

``HICACHE_L3_SGLANG_BACKENDS=file,mooncake`` (or ``all``) names the built-in backends to take
over (the plugin of :mod:`hicache_l3.sglang.plugin` registers them; the adapter classes are
in :mod:`hicache_l3.sglang.backend`).

Settings, lowest first: the defaults below; SGLang's own settings where they have a
counterpart (``SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR`` or ``file_storage_path`` for the
file root, default ``/tmp/hicache`` as in SGLang; ``SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR``
for the NIXL root; Mooncake's ``MOONCAKE_*`` variables, JSON file and extra-config keys,
read by the mooncake connector itself); ``HICACHE_L3_<CONNECTOR>_<FIELD>`` variables; a
table named after the connector in ``--hicache-storage-backend-extra-config`` (our format,
see :mod:`hicache_l3.sglang.config`). Other SGLang keys in the extra config are ignored and
named in a log line.

Nothing here imports SGLang or torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from hicache_l3.common.errors import ConfigError

log = logging.getLogger("hicache_l3.sglang.takeover")

ENV = "HICACHE_L3_SGLANG_BACKENDS"
TAKEOVER_CLASSES = {
    "file": "HiCacheL3AsFile",
    "mooncake": "HiCacheL3AsMooncake",
    "nixl": "HiCacheL3AsNixl",
    "hf3fs": "HiCacheL3AsHf3fs",
}
SGLANG_FILE_DEFAULT_DIR = "/tmp/hicache"  # HiCacheFile's default, kept so plain `file` works as before


def _mooncake_json() -> Mapping[str, str]:
    """SGLang's Mooncake JSON keys -> our settings (the config module, not the engine)."""
    from hicache_l3.connectors.mooncake import SGLANG_JSON

    return SGLANG_JSON


def takeover_names(value: str | None) -> list[str]:
    """The built-in names listed in ``HICACHE_L3_SGLANG_BACKENDS`` ("" = none, "all" = every
    one we serve); ConfigError naming the variable and any name we cannot serve."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    if names == ["all"]:
        return list(TAKEOVER_CLASSES)
    unknown = [n for n in names if n not in TAKEOVER_CLASSES]
    if unknown:
        raise ConfigError(f"{ENV}={value!r}: cannot take over {unknown}; choose from "
                          f"{sorted(TAKEOVER_CLASSES)} or 'all'")
    return list(dict.fromkeys(names))


def takeover_extra_config(name: str, extra: Mapping[str, Any] | None,
                          env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Our adapter's extra config for SGLang's built-in backend ``name`` (see module docstring)."""
    from hicache_l3.sglang.config import ADAPTER_KEYS, SGLANG_KEYS

    env = os.environ if env is None else env
    extra = dict(extra or {})
    table = extra.pop(name, None)
    settings: dict[str, Any] = {}
    ignored = []
    for key, value in extra.items():
        if key in ADAPTER_KEYS or key in SGLANG_KEYS:
            continue
        if name == "mooncake" and key in _mooncake_json():
            settings[_mooncake_json()[key]] = value
        elif name == "file" and key == "file_storage_path":
            settings["root"] = value
        else:
            ignored.append(key)
    if ignored:
        log.info("hicache-l3 as SGLang's %r backend: ignoring extra-config key(s) %s", name, sorted(ignored))
    if name == "file":  # SGLang's order: its env variable, then the extra-config key, then its default
        settings["root"] = (env.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or settings.get("root")
                            or SGLANG_FILE_DEFAULT_DIR)
    nixl_dir = env.get("SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR")
    if name == "nixl" and nixl_dir:
        settings.update(mode="file", root=nixl_dir)
    # our environment variables beat SGLang's settings; the table below beats both
    settings = {k: v for k, v in settings.items() if not env.get(f"HICACHE_L3_{name.upper()}_{k.upper()}")}
    if table is not None:
        if not isinstance(table, Mapping):
            raise ConfigError(f"hicache-l3: '{name}' in the extra config must be a table of settings")
        settings.update(table)
    out: dict[str, Any] = {"connector": name, "interface_v1": 1, name: settings}
    if extra.get("extra_backend_tag"):
        out["extra_backend_tag"] = extra["extra_backend_tag"]
    return out
