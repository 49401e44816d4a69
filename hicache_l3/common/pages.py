"""Page references: a page is one or more ``(address, length)`` segments of host memory.

``page_first`` host pools give one contiguous segment per page; ``layer_first`` pools
give one segment per layer (and per K/V half), scattered through the pool. Every
connector accepts both: a page is a ``Sequence[Segment]``.
"""

from __future__ import annotations

from collections.abc import Sequence

Segment = tuple[int, int]
Page = Sequence[Segment]


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
