"""SGLang configuration: parse our backend's ``--hicache-storage-backend-extra-config``
(top-level keys plus one table of settings per connector), build its key namespace, read
and write the config file. Imports no SGLang.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hicache_l3.common.config import tomllib
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import available_connectors, config_class, resolve_name
from hicache_l3.common.safe_fs import default_root, write_private_file

log = logging.getLogger("hicache_l3.sglang.config")

ADAPTER_MODULE = "hicache_l3.sglang"
ADAPTER_CLASS = "HiCacheL3Storage"
BACKEND_NAME = "hicache-l3"

# Keys of the extra config that SGLang itself reads; accepted and ignored by the adapter.
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size"})
# SGLang's --file-storage-path: the file connector's root when none is set, ignored otherwise
FILE_STORAGE_PATH = "file_storage_path"
ADAPTER_KEYS = frozenset({"connector", "extra_backend_tag"})

# Settings for an engine on this machine, written by `sglang-args` unless --set overrides them.
LOCAL_DEFAULTS: dict[str, dict[str, Any]] = {
    "file": {"root": str(default_root("file"))},  # per-user, created 0700 (safe_fs)
    "mooncake": {"master_address": "127.0.0.1:50051", "global_segment_size": "4GiB"},
    "nixl": {"mode": "file", "root": str(default_root("nixl"))},
    "hf3fs": {"root": "/mnt/3fs/hicache-l3"},
}


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """The adapter's part of SGLang's extra config: which connector, its settings, the tag,
    and whether SGLang uses the zero-copy interface (``interface_v1``)."""

    connector: str
    settings: dict[str, Any]
    tag: str
    interface_v1: bool

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> AdapterConfig:
        """Parse SGLang's ``extra_config`` dict; ConfigError naming any bad or unknown key.
        Tables of other connectors are ignored."""
        if not extra:
            raise ConfigError(
                "hicache-l3: --hicache-storage-backend-extra-config is empty; it must name "
                f"connector (one of {available_connectors()}); see `hicache-l3 sglang-args --help`"
            )
        if "connector" not in extra:
            raise ConfigError(
                f"hicache-l3: extra config has no 'connector' key; set it to one of "
                f"{available_connectors()}"
            )
        connector = resolve_name(str(extra["connector"]))
        known = set(SGLANG_KEYS) | set(ADAPTER_KEYS) | set(available_connectors())
        known |= {"3fs", FILE_STORAGE_PATH}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"hicache-l3: unknown key(s) {unknown} in the extra config; top-level keys are "
                f"{sorted(SGLANG_KEYS | ADAPTER_KEYS)} and one table per connector "
                f"({available_connectors()}) holding its settings"
            )
        table = extra.get(connector, extra.get("3fs", {}) if connector == "hf3fs" else {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"hicache-l3: '{connector}' must be a table of settings, got {table!r}")
        tag = extra.get("extra_backend_tag") or ""
        if not isinstance(tag, str):
            raise ConfigError(f"hicache-l3: extra_backend_tag must be a string, got {tag!r}")
        try:
            interface_v1 = bool(int(extra.get("interface_v1", 0)))
        except (TypeError, ValueError):
            raise ConfigError(
                f"hicache-l3: interface_v1 must be 0 or 1, got {extra.get('interface_v1')!r}"
            ) from None
        settings = dict(table)
        file_path = extra.get(FILE_STORAGE_PATH)
        if file_path:
            own_root = settings.get("root") or os.environ.get("HICACHE_L3_FILE_ROOT")
            if connector == "file" and not own_root:
                settings["root"] = str(file_path)
            else:
                log.debug("hicache-l3: ignoring %s=%r (SGLang's --file-storage-path): the %s "
                          "connector's own settings say where pages go", FILE_STORAGE_PATH, file_path,
                          connector)
        return cls(connector, settings, tag, interface_v1)

    def validate_settings(self) -> None:
        """Load the connector's config on the settings (ConfigError naming a bad one), engine-free."""
        config_class(self.connector).load(self.connector, self.settings)


def build_namespace(*, model_name: str | None, tag: str, tp_rank: int = 0, mla_shared: bool = False,
                    **fields: Any) -> Namespace:
    """The key namespace of one SGLang rank (``fields``: the other :class:`Namespace` fields;
    the TP rank dropped when MLA-shared). Without a model name the user tag stands in for it;
    with neither, ConfigError (pages of unknown models must never be shared)."""
    if not model_name and not tag:
        raise ConfigError(
            "hicache-l3: SGLang gave no model name (storage_config.model_name is None) and the "
            "extra config sets no extra_backend_tag; set extra_backend_tag to a name unique to "
            "this model and its weights, so that pages of different models never mix"
        )
    return Namespace(model=model_name or f"tag:{tag}", tag=tag, mla_shared=mla_shared,
                     tp_rank=0 if mla_shared else tp_rank, **fields)


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a config file the way SGLang reads ``@file``: by extension, JSON, TOML or YAML."""
    path = Path(path)
    ext = path.suffix.lower()
    try:
        if ext == ".json":
            data = json.loads(path.read_text())
        elif ext == ".toml":
            data = tomllib.loads(path.read_text())
        elif ext in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                raise ConfigError(f"{path}: reading YAML needs PyYAML (pip install pyyaml)") from None
            data = yaml.safe_load(path.read_text())
        else:
            raise ConfigError(f"{path}: unsupported config format {ext!r}; use .json, .toml or .yaml")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    except ValueError as exc:  # JSON and TOML decode errors
        raise ConfigError(f"{path}: not valid {ext[1:].upper()}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the config must be a table/object, got {type(data).__name__}")
    return data


def extra_config_for(connector: str, settings: Mapping[str, Any], tag: str = "") -> dict[str, Any]:
    """The complete extra config selecting ``connector`` with ``settings`` (zero-copy path)."""
    connector = resolve_name(connector)
    out: dict[str, Any] = {
        "backend_name": BACKEND_NAME,
        "module_path": ADAPTER_MODULE,
        "class_name": ADAPTER_CLASS,
        "interface_v1": 1,
        "connector": connector,
    }
    if tag:
        out["extra_backend_tag"] = tag
    out[connector] = dict(settings)
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def dump_config(config: Mapping[str, Any], path: Path) -> None:
    """Write ``config`` as JSON, TOML or YAML by ``path``'s extension: atomically, mode 0600
    also over an existing file, never through a symlink (it may hold credentials)."""
    ext = path.suffix.lower()
    if ext == ".json":
        text = json.dumps(config, indent=2) + "\n"
    elif ext == ".toml":
        lines, tables = [], []
        for key, value in config.items():
            if isinstance(value, Mapping):
                tables.append((key, value))
            else:
                lines.append(f"{key} = {_toml_value(value)}")
        for name, table in tables:
            lines.append(f"\n[{name}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in table.items())
        text = "\n".join(lines) + "\n"
    elif ext in (".yaml", ".yml"):
        text = json.dumps(config, indent=2) + "\n"  # JSON is valid YAML
    else:
        raise ConfigError(f"{path}: unsupported config format {ext!r}; use .json, .toml or .yaml")
    write_private_file(path, text)
