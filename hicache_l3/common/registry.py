"""Connector names -> classes, imported on first use, with install hints.

``import hicache_l3`` never imports an engine package; :func:`open_connector` imports
the connector's module when asked for it and, if the engine's package is missing, raises
:class:`~hicache_l3.common.errors.EngineUnavailableError` saying what to install.
Third parties add their own with :func:`register_connector`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError
from hicache_l3.common.keys import Namespace

# name -> ("module:Class", pip extra that brings the engine package, or None)
_KNOWN: dict[str, tuple[str, str | None]] = {
    "file": ("hicache_l3.connectors.file:open_file_connector", None),
    "mooncake": ("hicache_l3.connectors.mooncake:MooncakeConnector", "mooncake"),
    "nixl": ("hicache_l3.connectors.nixl:NixlConnector", "nixl"),
    "hf3fs": ("hicache_l3.connectors.hf3fs:Hf3fsConnector", None),
}
_ALIASES = {"3fs": "hf3fs"}


def register_connector(name: str, target: str, extra: str | None = None) -> None:
    """Make ``open_connector(name)`` load ``target`` (``"package.module:Class"``)."""
    _KNOWN[name] = (target, extra)


def available_connectors() -> list[str]:
    """Names accepted by :func:`open_connector` (aliases excluded)."""
    return sorted(_KNOWN)


def resolve_name(name: str) -> str:
    """The canonical connector name for ``name`` (aliases resolved); ConfigError if unknown."""
    canonical = _ALIASES.get(name, name)
    if canonical not in _KNOWN:
        raise ConfigError(
            f"unknown connector {name!r}; choose one of {available_connectors()} "
            f"(aliases: {sorted(_ALIASES)})"
        )
    return canonical


def load_connector(name: str) -> Any:
    """The class (or factory) behind ``name``, importing its module now."""
    canonical = resolve_name(name)
    target, extra = _KNOWN[canonical]
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"pip install 'hicache-l3[{extra}]'" if extra else "reinstall hicache-l3"
        raise EngineUnavailableError(
            f"connector {canonical!r} needs a package that is not installed "
            f"({exc.name or exc}): {hint}"
        ) from exc
    return getattr(module, attr)


def open_connector(
    name: str,
    namespace: Namespace | Mapping[str, Any],
    settings: Mapping[str, Any] | None = None,
    **overrides: Any,
) -> Connector[Any]:
    """Open connector ``name`` on ``namespace`` with ``settings`` (plus keyword overrides).

    Settings not given are read from ``HICACHE_L3_<NAME>_<FIELD>`` environment
    variables, then the field defaults. Raises ConfigError for bad settings and
    EngineUnavailableError when the engine package is missing or the engine cannot be
    reached.
    """
    if not isinstance(namespace, Namespace):
        namespace = Namespace.from_dict(dict(namespace))
    factory = load_connector(name)
    merged = dict(settings or {})
    merged.update(overrides)
    if isinstance(factory, type) and issubclass(factory, Connector):
        return factory.open(merged, namespace)
    connector: Connector[Any] = factory(merged, namespace)
    return connector
