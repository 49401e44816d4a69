"""The plain-segments check in Python: part of the reference ``hicache_l3._keys.common_batch``
(native/keys.c) is compared with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_SEQUENCES = (tuple, list)


def plain_segments(pages: Sequence[Any]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Addresses and lengths of every segment of ``pages`` when every page is a tuple or
    list of ``(int, int)`` pairs (plain ints, exactly two each); None otherwise. Runs in
    C-speed list operations: the fast check of a well-formed batch."""
    if not pages or not set(map(type, pages)) <= set(_SEQUENCES):
        return None
    segs = [seg for page in pages for seg in page]
    if not segs or not set(map(type, segs)) <= set(_SEQUENCES) or set(map(len, segs)) != {2}:
        return None
    addresses, lengths = zip(*segs)
    if set(map(type, addresses)) != {int} or set(map(type, lengths)) != {int}:
        return None
    return addresses, lengths

