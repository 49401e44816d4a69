"""Typed connector settings loadable from a dict, a TOML file or the environment
(``HICACHE_L3_<CONNECTOR>_<FIELD>``). Loading is strict: an unknown key or a bad value
raises :class:`~hicache_l3.common.errors.ConfigError` naming it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from hicache_l3.common.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as a dependency (pyproject.toml: tomli)
    import tomli as tomllib

__all__ = ["ConnectorConfig", "parse_size", "setting", "tomllib"]

C = TypeVar("C", bound="ConnectorConfig")

_SIZE_RE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGTP]?)(i?)B?\s*", re.IGNORECASE)


def parse_size(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string such as ``"64KiB"``, ``"1 GB"``, ``"4096"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}: size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m:
            number, unit, binary = m.groups()
            base = 1024 if (binary or unit == "") else 1000
            power = "KMGTP".find(unit.upper()) + 1 if unit else 0
            return int(float(number) * base**power)
    raise ConfigError(f"{name}: {value!r} is not a size (try 65536, '64KiB' or '1GB')")


def parse_sets(items: list[str]) -> dict[str, str]:
    """``--set KEY=VALUE`` items as settings; ConfigError naming an item without ``=`` or a key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def setting(default: Any, help: str, *, size: bool = False, secret: bool = False) -> Any:
    """Declare a config field with its help text (``size=True`` parses sizes,
    ``secret=True`` hides the value from ``repr`` and logs)."""
    meta = {"help": help, "size": size, "secret": secret}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta, repr=not secret)


@dataclasses.dataclass
class ConnectorConfig:
    """Base of every connector's settings. Subclasses add fields with :func:`setting`."""

    page_bytes: int | None = setting(
        None, "bytes per page; pages of another size are refused (default: first page seen)",
        size=True,
    )

    @classmethod
    def field_help(cls) -> dict[str, tuple[Any, str]]:
        """``{name: (default, help)}`` for every field, in declaration order."""
        out = {}
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else None
            )
            out[f.name] = (default, f.metadata.get("help", ""))
        return out

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any], source: str = "config") -> C:
        """Build from a mapping; unknown keys and bad values raise :class:`ConfigError`."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ConfigError(
                f"{source}: unknown setting(s) {unknown} for {cls.__name__}; "
                f"known: {sorted(fields)}"
            )
        hints = get_type_hints(cls)
        kwargs = {
            name: _coerce(value, hints[name], fields[name], f"{source}: {name}")
            for name, value in data.items()
        }
        try:
            config = cls(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        config.validate()
        return config

    @classmethod
    def from_toml(cls: type[C], path: str | Path, table: str | None = None) -> C:
        """Load from a TOML file, optionally from one table of it (``[file]``...)."""
        try:
            with open(path, "rb") as f:
                data: dict[str, Any] = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if table is not None:
            data = data.get(table, {})
        return cls.from_dict(data, source=str(path))

    @classmethod
    def env_values(cls, connector: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
        """The ``HICACHE_L3_<CONNECTOR>_<FIELD>`` variables that are set, by field name."""
        env = os.environ if environ is None else environ
        prefix = f"HICACHE_L3_{connector.upper()}_"
        out = {}
        for f in dataclasses.fields(cls):
            if prefix + f.name.upper() in env:
                out[f.name] = env[prefix + f.name.upper()]
        return out

    @classmethod
    def load(
        cls: type[C],
        connector: str,
        settings: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> C:
        """Environment first, then ``settings`` on top (explicit settings win)."""
        merged: dict[str, Any] = dict(cls.env_values(connector, environ))
        merged.update(settings or {})
        return cls.from_dict(merged, source=f"{connector} config")

    def validate(self) -> None:
        """Check cross-field constraints; raise :class:`ConfigError`. Override to extend."""
        if self.page_bytes is not None and self.page_bytes <= 0:
            raise ConfigError(f"page_bytes must be > 0, got {self.page_bytes}")

    def public_dict(self) -> dict[str, Any]:
        """The settings as a dict with secrets masked (safe to log)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = "***" if f.metadata.get("secret") and value else value
        return out


def _coerce(value: Any, hint: Any, field: dataclasses.Field[Any], name: str) -> Any:
    if field.metadata.get("size") and value is not None:
        return parse_size(value, name)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        if isinstance(value, str) and value.lower() in ("", "none") and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        errors = []
        for arg in non_none:
            try:
                return _coerce(value, arg, field, name)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{name}: bad value {value!r}")
    if typing.get_origin(hint) is typing.Literal:
        if isinstance(value, bool) and "true" in args and "false" in args:
            value = "true" if value else "false"
        if value not in args:
            raise ConfigError(f"{name}: {value!r} is not one of {list(args)}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value, 0)
            except ValueError:
                pass
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, Path):
            return str(value)
    elif origin is list:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, (list, tuple)):
            return [_coerce(v, args[0], field, name) for v in value] if args else list(value)
    elif origin is dict:
        if isinstance(value, Mapping):
            return dict(value)
    else:
        return value
    shown = "***" if field.metadata.get("secret") else repr(value)
    raise ConfigError(f"{name}: expected {getattr(hint, '__name__', hint)}, got {shown}")
