"""Connector names -> classes and config classes by dotted path, imported on first use
(config classes without their engine), with install hints. Third parties register with
:func:`register_connector` or the ``hicache_l3.connectors`` entry-point group.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import Any

from hicache_l3.common.config import ConnectorConfig
from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError
from hicache_l3.common.keys import Namespace

ENTRY_POINT_GROUP = "hicache_l3.connectors"

log = logging.getLogger("hicache_l3.registry")


@dataclasses.dataclass(frozen=True)
class KnownConnector:
    """Where a connector lives: ``target`` opens it (``"module:Class"``, a Connector
    subclass, or ``"module:function"``, a factory ``(settings, namespace) -> Connector``);
    ``config`` is its config class (``"module:Class"``; None: the target's
    ``config_class``); ``extra`` is the pip extra that brings its engine (None: none)."""

    target: str
    config: str | None = None
    extra: str | None = None

    def install_hint(self) -> str:
        """What to run when the connector's module or engine cannot be imported."""
        return f"pip install 'hicache-l3[{self.extra}]'" if self.extra else "reinstall hicache-l3"


_KNOWN: dict[str, KnownConnector] = {
    "file": KnownConnector("hicache_l3.connectors.file:open_file_connector",
                           "hicache_l3.connectors.file:FileConfig"),
    "mooncake": KnownConnector("hicache_l3.connectors.mooncake:MooncakeConnector",
                               "hicache_l3.connectors.mooncake:MooncakeConfig", "mooncake"),
    "nixl": KnownConnector("hicache_l3.connectors.nixl:open_nixl_connector",
                           "hicache_l3.connectors.nixl.base:NixlConfig", "nixl"),
    "hf3fs": KnownConnector("hicache_l3.connectors.hf3fs:Hf3fsConnector",
                            "hicache_l3.connectors.hf3fs:Hf3fsConfig"),
    "faulty": KnownConnector("hicache_l3.connectors.faulty:open_faulty_connector",
                             "hicache_l3.connectors.faulty:FaultConfig"),
    "memory": KnownConnector("hicache_l3.connectors.memory:MemoryConnector",
                             "hicache_l3.connectors.memory:MemoryConfig"),
}
_BUILTIN = frozenset(_KNOWN)
_ALIASES = {"3fs": "hf3fs"}
_lock = threading.Lock()
_entry_points_read = False


def register_connector(name: str, target: str, extra: str | None = None, *,
                       config: str | None = None, clobber: bool = False) -> None:
    """Make ``open_connector(name)`` load ``target`` (``"package.module:Class"``); ``config``
    names its config class, ``extra`` the pip extra of the install hint. A name already
    registered otherwise raises ConfigError unless ``clobber=True``."""
    if ":" not in target:
        raise ConfigError(f"connector {name!r}: target {target!r} must be 'package.module:Class'")
    _read_entry_points()
    entry = KnownConnector(target, config, extra)
    with _lock:
        old = _KNOWN.get(name)
        if name in _ALIASES or (old is not None and old != entry and not clobber):
            raise ConfigError(
                f"connector {name!r} is already registered "
                f"({old.target if old else 'an alias of ' + _ALIASES[name]}); "
                "pass clobber=True to replace it")
        _KNOWN[name] = entry


def registration(name: str) -> KnownConnector:
    """Where connector ``name`` lives (aliases resolved); ConfigError if unknown."""
    return _KNOWN[resolve_name(name)]


def available_connectors(builtin_only: bool = False) -> list[str]:
    """Names accepted by :func:`open_connector` (aliases excluded), or only built-in ones."""
    if builtin_only:
        return sorted(_BUILTIN)
    _read_entry_points()
    return sorted(_KNOWN)


def resolve_name(name: str) -> str:
    """The canonical connector name for ``name`` (aliases resolved); ConfigError if unknown."""
    canonical = _ALIASES.get(name, name)
    if canonical not in _KNOWN:
        _read_entry_points()
    if canonical not in _KNOWN:
        raise ConfigError(
            f"unknown connector {name!r}; choose one of {available_connectors()} "
            f"(aliases: {sorted(_ALIASES)})"
        )
    return canonical


def _import(target: str, name: str, entry: KnownConnector) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineUnavailableError(
            f"connector {name!r} needs a package that is not installed "
            f"({exc.name or exc}): {entry.install_hint()}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"connector {name!r}: {module_name} has no attribute {attr!r}") from None


def load_connector(name: str) -> Any:
    """The class (or factory) behind ``name``, importing its module now."""
    canonical = resolve_name(name)
    entry = _KNOWN[canonical]
    return _import(entry.target, canonical, entry)


def config_class(name: str) -> type[ConnectorConfig]:
    """The config class of connector ``name``, without importing its engine where named."""
    canonical = resolve_name(name)
    entry = _KNOWN[canonical]
    found = (_import(entry.config, canonical, entry) if entry.config
             else getattr(load_connector(canonical), "config_class", None))
    if not (isinstance(found, type) and issubclass(found, ConnectorConfig)):
        raise ConfigError(f"connector {canonical!r}: no config class (register it with config=...)")
    return found


def _read_entry_points() -> None:
    """Register the entry points once (nothing imported); a taken name is skipped, warned."""
    global _entry_points_read
    if _entry_points_read:
        return
    with _lock:
        if _entry_points_read:
            return
        _entry_points_read = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            entry = KnownConnector(f"{ep.module}:{ep.attr}")
            if ep.name in _KNOWN or ep.name in _ALIASES:
                if _KNOWN.get(ep.name) != entry:
                    log.warning("hicache-l3: entry point %s = %r ignored: connector %r is "
                                "already registered", ep.name, ep.value, ep.name)
                continue
            _KNOWN[ep.name] = entry


def open_connector(
    name: str,
    namespace: Namespace | Mapping[str, Any],
    settings: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Connector[Any]:
    """Open connector ``name`` on ``namespace`` with ``settings`` (plus keyword overrides;
    the rest from ``HICACHE_L3_<NAME>_<FIELD>``, then defaults). ConfigError for bad
    settings, EngineUnavailableError when the engine is missing or unreachable."""
    if not isinstance(namespace, Namespace):
        namespace = Namespace.from_dict(dict(namespace))
    factory = load_connector(name)
    merged = dict(settings or {})
    merged.update(overrides)
    if isinstance(factory, type) and issubclass(factory, Connector):
        return factory.open(merged, namespace)
    return factory(merged, namespace)
