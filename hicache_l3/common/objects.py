"""What the object-per-page connectors share: one engine call per distinct key of a batch,
and the commit record (:data:`~hicache_l3.slab.format.START`) stored beside a page."""

from __future__ import annotations

from collections.abc import Callable

from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint, page_checksum
from hicache_l3.common.pages import Page, page_nbytes
from hicache_l3.slab.format import encode_start


def once_per_key(keys: list[str], pages: list[Page],
                 call: Callable[[list[str], list[Page]], list[Reason]]) -> list[Reason]:
    """``call`` of each distinct key once, with the page of its first copy; every copy of a
    key gets that key's result."""
    if len(set(keys)) == len(keys):
        return call(keys, pages)
    first: dict[str, int] = {}
    for i, key in enumerate(keys):
        first.setdefault(key, i)
    result = dict(zip(first, call(list(first), [pages[i] for i in first.values()])))
    return [result[key] for key in keys]


def commit_record(key: str, page: Page, frame: bytes | None, checksum: bool = True) -> bytes:
    """The 64-byte record of a stored page, or of its ``frame`` when it has one: the stored
    length, its XXH3 (0 without ``checksum``) and the key's fingerprint."""
    if frame is None:
        length, csum = page_nbytes(page), page_checksum(page) if checksum else 0
    else:
        length, csum = len(frame), buffer_checksum([frame]) if checksum else 0
    return encode_start(0, length, csum, key_fingerprint(key))
