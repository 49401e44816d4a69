"""The batch key checks in Python: the reference ``hicache_l3._keys`` (native/keys.c) is
compared with."""

from __future__ import annotations

import operator
from collections.abc import Sequence

from hicache_l3.common.keys import MAX_KEY_LENGTH

_FIRST = operator.itemgetter(0)
_ALLOWED = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:=+@-"


def all_valid_keys(keys: Sequence[object]) -> bool:
    """``all_valid_keys`` in Python: True exactly when every key is valid. The
    concatenated keys encode to ASCII and hold only allowed bytes, no key is empty or
    longer than :data:`MAX_KEY_LENGTH`, and only when a ``.`` or ``-`` occurs at all
    (never in hex page hashes) are the first characters, taken one per key, checked for
    them. (A search for ``"/."`` in ``/``-joined keys costs more than all of this.)"""
    if not keys:
        return True
    try:
        data = "".join(keys).encode("ascii")  # type: ignore[arg-type]
    except (TypeError, UnicodeEncodeError):
        return False
    if data.translate(None, _ALLOWED):
        return False
    lengths = set(map(len, keys))  # type: ignore[arg-type]
    if min(lengths) == 0 or max(lengths) > MAX_KEY_LENGTH:
        return False
    if b"." in data or b"-" in data:
        firsts = "".join(map(_FIRST, keys))  # type: ignore[arg-type]
        return "." not in firsts and "-" not in firsts
    return True


def prefixed_valid_keys(prefix: str, keys: Sequence[object]) -> list[str] | None:
    """``prefixed_valid_keys`` in Python: the prefixed
    keys when every key is valid, else None."""
    if not all_valid_keys(keys):
        return None
    return [prefix + k for k in keys]  # type: ignore[operator]
