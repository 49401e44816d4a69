"""The key scheme: page keys and the :class:`Namespace` of everything that changes a page's
bytes (its digest prefixes every storage key, so namespaces that differ never collide).

Data-parallel rank is not part of the namespace (DP replicas hold byte-identical KV);
``mla_shared=True`` drops the TP rank (every TP rank holds the same latent KV).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from hicache_l3.common.errors import ConfigError, InvalidKeyError

KEY_FORMAT_VERSION = 1
MAX_KEY_LENGTH = 256
_KEY_RE = re.compile(r"[A-Za-z0-9_:=+@][A-Za-z0-9_.:=+@-]{0,%d}" % (MAX_KEY_LENGTH - 1))


def is_valid_key(key: object) -> bool:
    """True when ``key`` is a str of 1..:data:`MAX_KEY_LENGTH` characters of
    ``[A-Za-z0-9_.:=+@-]`` not starting with ``.`` or ``-`` (never a path outside a root)."""
    if type(key) is str and key.isalnum() and key.isascii() and len(key) <= MAX_KEY_LENGTH:
        return True  # the common case (hex page hashes), without the regex
    return isinstance(key, str) and _KEY_RE.fullmatch(key) is not None


BUILD_HINT = ("reinstall hicache-l3 with a C compiler (cc) and the Python headers present, for this "
              "Python (scripts/setup.sh, or pip install --force-reinstall --no-deps hicache-l3)")
"""How to get working C extensions (required on Linux / CPython)."""

try:  # one C pass per batch (hicache_l3/native/keys.c)
    from hicache_l3 import _keys as native_checks
except ImportError as exc:
    raise ImportError(f"hicache_l3._keys is not usable ({exc}): {BUILD_HINT}",
                      name="hicache_l3._keys") from exc

all_valid_keys: Callable[[Sequence[object]], bool] = native_checks.valid_keys
"""``all_valid_keys(keys)``: True exactly when every key is valid (one C pass)."""

prefixed_valid_keys: Callable[[str, Sequence[object]], list[str] | None] = native_checks.prefixed_keys
"""``prefixed_valid_keys(prefix, keys)``: ``[prefix + key for key in keys]`` when every key
is valid, else None (one C pass). ``prefix`` must be ASCII (TypeError otherwise)."""


def validate_key(key: object) -> str:
    """Return ``key`` unchanged, or raise :class:`InvalidKeyError` saying what is wrong."""
    if not isinstance(key, str):
        raise InvalidKeyError(f"page key must be str, got {type(key).__name__}")
    if not is_valid_key(key):
        raise InvalidKeyError(
            f"page key {key[:80]!r} is not allowed: use 1..{MAX_KEY_LENGTH} characters of "
            "[A-Za-z0-9_.:=+@-], not starting with '.' or '-'"
        )
    return key


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Everything that changes the bytes of a stored page. ``model``, ``kv_dtype``, ``layout``
    and ``page_size`` (tokens per page) are required; shards default to one unsharded
    instance. ConfigError for a bad field."""

    model: str
    kv_dtype: str
    layout: str
    page_size: int
    tp_rank: int = 0
    tp_size: int = 1
    mla_shared: bool = False
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    tag: str = ""
    version: int = KEY_FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("model", "kv_dtype", "layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"namespace.{name} must be a non-empty string, got {value!r}")
        if not isinstance(self.page_size, int) or self.page_size <= 0:
            raise ConfigError(f"namespace.page_size must be a positive int, got {self.page_size!r}")
        for rank, size in (
            ("tp_rank", "tp_size"),
            ("pp_rank", "pp_size"),
            ("cp_rank", "cp_size"),
            ("dcp_rank", "dcp_size"),
        ):
            r, s = getattr(self, rank), getattr(self, size)
            if not (isinstance(s, int) and s >= 1 and isinstance(r, int) and 0 <= r < s):
                raise ConfigError(f"namespace.{rank}={r!r} must lie in [0, {size}={s!r})")

    def fields(self) -> dict[str, Any]:
        """The fields that identify the namespace, TP rank dropped when MLA-shared."""
        out = dataclasses.asdict(self)
        if self.mla_shared:
            out["tp_rank"] = "shared"
        return out

    def digest(self) -> str:
        """A 24-hex-digit identifier of :meth:`fields`; prefixes every storage key."""
        canon = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canon.encode()).hexdigest()[:24]

    def describe(self) -> str:
        """A one-line human-readable summary, for logs and error messages."""
        tp = "mla-shared" if self.mla_shared else f"{self.tp_rank}/{self.tp_size}"
        return (
            f"model={self.model} dtype={self.kv_dtype} layout={self.layout} "
            f"page={self.page_size} tp={tp} pp={self.pp_rank}/{self.pp_size} "
            f"cp={self.cp_rank}/{self.cp_size} dcp={self.dcp_rank}/{self.dcp_size} "
            f"tag={self.tag!r} v{self.version}"
        )

    def storage_key(self, key: str) -> str:
        """The engine-wide key of page ``key`` in this namespace."""
        return f"{self.digest()}:{key}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Namespace:
        """Build from a mapping; unknown fields raise :class:`ConfigError` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown namespace field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)
