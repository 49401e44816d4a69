"""SGLang's built-in backend names served by hicache-l3 (``HICACHE_L3_SGLANG_BACKENDS``):
which names to take over, and our adapter's extra config under each. Settings, lowest
first: defaults, SGLang's own settings where they have a counterpart,
``HICACHE_L3_<CONNECTOR>_<FIELD>``, then the connector's table in the extra config.
Imports neither SGLang nor torch.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.safe_fs import default_root

log = logging.getLogger("hicache_l3.sglang.takeover")

ENV = "HICACHE_L3_SGLANG_BACKENDS"
TAKEOVER_CLASSES = {
    "file": "HiCacheL3AsFile",
    "mooncake": "HiCacheL3AsMooncake",
    "nixl": "HiCacheL3AsNixl",
    "hf3fs": "HiCacheL3AsHf3fs",
}
SGLANG_MOONCAKE_DEFAULT_SEGMENT = "4gb"  # MOONCAKE_GLOBAL_SEGMENT_SIZE's default in SGLang 0.5.23
SGLANG_HF3FS_ENV = "SGLANG_HICACHE_HF3FS_CONFIG_PATH"
# SGLang's 3FS JSON keys -> our hf3fs settings; the other keys have no meaning here.
SGLANG_HF3FS_JSON = {"file_path_prefix": "root", "file_size": "capacity_bytes", "numjobs": "io_threads",
                     "entries": "usrbio_entries"}
MIN_USRBIO_ENTRIES = 4
_announced: set[str] = set()


def _mooncake_json() -> Mapping[str, str]:
    """SGLang's Mooncake JSON keys -> our settings (the config module, not the engine)."""
    from hicache_l3.connectors.mooncake import SGLANG_JSON

    return SGLANG_JSON


def takeover_names(value: str | None) -> list[str]:
    """The built-in names listed in ``HICACHE_L3_SGLANG_BACKENDS`` ("all": every one we serve);
    ConfigError naming the variable and any name we cannot serve."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    if names == ["all"]:
        return list(TAKEOVER_CLASSES)
    unknown = [n for n in names if n not in TAKEOVER_CLASSES]
    if unknown:
        raise ConfigError(f"{ENV}={value!r}: cannot take over {unknown}; choose from "
                          f"{sorted(TAKEOVER_CLASSES)} or 'all'")
    return list(dict.fromkeys(names))


def hf3fs_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """Our hf3fs settings from the JSON file at ``SGLANG_HICACHE_HF3FS_CONFIG_PATH`` (none
    without it); ConfigError naming the file when it cannot be read."""
    path = env.get(SGLANG_HF3FS_ENV)
    if not path:  # SGLang's own fallback, /data/hicache.<rank>.bin, is a shared local path: not used
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{SGLANG_HF3FS_ENV}={path}: cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{SGLANG_HF3FS_ENV}={path}: expected a JSON object")
    out = {ours: data[theirs] for theirs, ours in SGLANG_HF3FS_JSON.items() if data.get(theirs) is not None}
    if not out.get("root"):
        raise ConfigError(f"{SGLANG_HF3FS_ENV}={path}: file_path_prefix is missing (the 3FS directory)")
    entries = out.get("usrbio_entries")
    if isinstance(entries, int) and entries < MIN_USRBIO_ENTRIES:
        out["usrbio_entries"] = MIN_USRBIO_ENTRIES
    ignored = sorted(set(data) - set(SGLANG_HF3FS_JSON))
    if ignored:
        log.info("hicache-l3 as SGLang's 'hf3fs' backend: %s keys %s have no counterpart (pages and "
                 "their index live on 3FS itself); ignored", path, ignored)
    return out


def mooncake_segment_share(settings: Mapping[str, Any], env: Mapping[str, str], ranks: int) -> int:
    """This rank's share of SGLang's ``global_segment_size`` (extra config, else its JSON file
    or environment, else SGLang's default), split over ``ranks`` (TP x PP) as SGLang does."""
    from hicache_l3.common.config import parse_size
    from hicache_l3.connectors.mooncake import _sglang_size, sglang_settings

    value = settings.get("global_segment_size")
    if value is None:
        value = sglang_settings(env).get("global_segment_size", SGLANG_MOONCAKE_DEFAULT_SEGMENT)
    total = parse_size(_sglang_size(value), "global_segment_size")
    return total // max(1, ranks)


def announce(builtin: str) -> None:
    """Log the start-up line once per process (the plugin's runs before SGLang's logging)."""
    if builtin in _announced:
        return
    _announced.add(builtin)
    log.info("hicache-l3: serving SGLang's %r storage backend (%s=%s)", builtin, ENV, os.environ.get(ENV, ""))


def takeover_extra_config(name: str, extra: Mapping[str, Any] | None,
                          env: Mapping[str, str] | None = None, ranks: int = 1) -> dict[str, Any]:
    """Our adapter's extra config for SGLang's built-in backend ``name``; ``ranks`` is
    tp_size x pp_size (Mooncake's segment is split across them)."""
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
    # SGLang's order: its env variable, then the extra-config key; then, instead of SGLang's
    # shared /tmp/hicache, a per-user root (another user could have created /tmp/hicache)
    if name == "file":
        settings["root"] = (env.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR") or settings.get("root")
                            or str(default_root("file")))
    if name == "mooncake" and not env.get("HICACHE_L3_MOONCAKE_GLOBAL_SEGMENT_SIZE"):
        settings["global_segment_size"] = mooncake_segment_share(settings, env, ranks)
    if name == "hf3fs":
        settings.update(hf3fs_settings(env))
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
