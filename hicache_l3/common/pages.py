"""Page references: a page is one or more ``(address, length)`` segments of host memory.

``page_first`` host pools give one contiguous segment per page; ``layer_first`` pools
give one segment per layer (and per K/V half), scattered through the pool. Every
connector accepts both: a page is a ``Sequence[Segment]``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

Segment = tuple[int, int]
Page = Sequence[Segment]

_SEQUENCES = (tuple, list)


class FlatPages(list[Any]):
    """A checked batch's pages (the list itself, unchanged) carrying every segment already
    flattened: ``segments``, native uint64 ``(address, length)`` pairs in page order, each
    page ``per`` segments. Built by the connector's common-batch check
    (:meth:`~hicache_l3.common.connector.Connector._transfer`) so that a transport that
    walks flat segments (the native one) takes them as they are instead of flattening the
    pages again; any other code sees a plain list of pages. A sub-list (a slice, a
    comprehension) is a plain list: only the whole batch carries ``segments``."""

    __slots__ = ("per", "segments")

    def __init__(self, pages: Sequence[Any], segments: bytes, per: int) -> None:
        super().__init__(pages)
        self.segments, self.per = segments, per


def normalize_page(page: Any) -> tuple[Segment, ...] | None:
    """``page`` as a tuple of ``(address, length)`` int pairs, or None when it is malformed.

    Well-formed: a tuple or list of at least one segment, each a tuple or list of exactly
    two integers (any ``__index__`` type but bool), address >= 0 and length > 0. Anything
    else (a segment of three elements, a float or None address, a dict, a string) is
    malformed: the connector refuses that key before any I/O.
    """
    if type(page) not in _SEQUENCES or not page:
        return None
    out = []
    for seg in page:
        if type(seg) not in _SEQUENCES or len(seg) != 2:
            return None
        address, length = seg
        if isinstance(address, bool) or isinstance(length, bool):
            return None
        try:
            address, length = operator.index(address), operator.index(length)
        except TypeError:
            return None
        if address < 0 or length <= 0:
            return None
        out.append((address, length))
    return tuple(out)


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


def overlapping(pages: Sequence[Page]) -> bool:
    """True when two segments of ``pages`` share a byte (destinations of one get must not)."""
    spans = sorted(seg for page in pages for seg in page)
    ends = [a + n for a, n in spans]
    return any(map(operator.lt, [a for a, _ in spans[1:]], ends[:-1]))


def page_nbytes(page: Page) -> int:
    """Total bytes of a page (the sum of its segment lengths)."""
    if len(page) == 1:
        return page[0][1]
    return sum(length for _, length in page)


def contiguous_pages(base: int, page_bytes: int, indices: Sequence[int]) -> list[Page]:
    """One single-segment page per index: page ``i`` starts at ``base + i * page_bytes``."""
    return [((base + i * page_bytes, page_bytes),) for i in indices]


def strided_pages(
    base: int, segment_bytes: int, segments: int, stride: int, indices: Sequence[int]
) -> list[Page]:
    """Scattered pages: page ``i`` has ``segments`` pieces, piece ``j`` at
    ``base + j * stride + i * segment_bytes`` (the shape of a ``layer_first`` pool)."""
    return [
        tuple((base + j * stride + i * segment_bytes, segment_bytes) for j in range(segments))
        for i in indices
    ]
