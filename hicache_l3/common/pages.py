"""Pages: a page is one or more ``(address, length)`` segments of host memory (one for
``page_first`` pools, one per layer and K/V half for ``layer_first``), and the one-pass
page-batch checks of the C extension ``hicache_l3._keys``.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from hicache_l3.common.keys import native_checks

Segment = tuple[int, int]
Page = Sequence[Segment]

_SEQUENCES = (tuple, list)

CommonBatch = tuple[bytes, int, int, int, int, bool]
common_batch: Callable[[Sequence[object], Sequence[object]], CommonBatch | None] | None = \
    native_checks.common_batch
"""``common_batch(keys, pages)`` (C, one pass): for as many pages as keys, all keys valid,
every page ``per`` plain ``(address, length)`` int pairs of one ``size``:
``(segments, per, size, low, end, overlap)`` -- the native uint64 pairs of every segment,
the lowest address, the end of the highest segment, whether two segments share a byte;
else None. The connector's key-by-key checks are the reference (a test sets this None)."""

pointer_batch: Callable[[Sequence[object], Sequence[object], Sequence[object], int],
                        CommonBatch | None] | None = native_checks.pointer_batch
"""``pointer_batch(keys, ptrs, sizes, per)`` (C, one pass): :data:`common_batch` of the pages
of ``PointerPages(ptrs, sizes, per)``, read from the flat lists without building a page."""


class FlatPages(Sequence[Any]):
    """A checked batch's pages (indexed through) with every segment already flattened:
    ``segments``, native uint64 ``(address, length)`` pairs, ``per`` per page. A slice is a
    plain list: only the whole batch carries ``segments``."""

    __slots__ = ("pages", "per", "segments")

    def __init__(self, pages: Sequence[Any], segments: bytes, per: int) -> None:
        self.pages, self.segments, self.per = pages, segments, per

    def __len__(self) -> int:
        return len(self.pages)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return list(self.pages[i])
        return self.pages[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self.pages)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FlatPages):
            other = other.pages
        return isinstance(other, (list, tuple, PointerPages)) and list(self.pages) == list(other)

    __hash__ = None  # type: ignore[assignment]  # compares by its pages, like a list

    def __repr__(self) -> str:
        return f"FlatPages({list(self.pages)!r}, per={self.per})"


class PointerPages(Sequence[Page]):
    """``len(ptrs) // per`` pages given as flat lists (SGLang's ``get_page_buffer_meta``):
    page ``i`` is the segments ``(ptrs[j], sizes[j])``, ``j`` in ``[i * per, (i + 1) * per)``,
    in address order (a page whose addresses do not compare keeps the given order, and is
    refused as malformed). Pages are built when first indexed, all at once, and kept.
    ``ptrs``/``sizes`` may be buffers of 8-byte integers (numpy ``int64``). ValueError when
    ``per < 1`` or the lists do not hold ``per`` segments per page.
    """

    __slots__ = ("_built", "n", "per", "ptrs", "sizes")

    def __init__(self, ptrs: Sequence[Any], sizes: Sequence[Any], per: int) -> None:
        if per < 1 or len(ptrs) != len(sizes) or len(ptrs) % per:
            raise ValueError(f"PointerPages: {len(ptrs)} addresses and {len(sizes)} lengths "
                             f"are not {per} segments per page")
        self.ptrs, self.sizes, self.per, self.n = ptrs, sizes, per, len(ptrs) // per
        self._built: list[tuple[Segment, ...]] | None = None

    def _pages(self) -> list[tuple[Segment, ...]]:
        built = self._built
        if built is None:
            built = self._built = self._build()
        return built

    def _build(self) -> list[tuple[Segment, ...]]:
        ptrs, sizes, per = _ints(self.ptrs), _ints(self.sizes), self.per
        if per == 1:
            return list(zip(zip(ptrs, sizes)))
        try:
            ordered = all(all(map(operator.lt, ptrs[r::per], ptrs[r + 1 :: per])) for r in range(per - 1))
        except TypeError:  # addresses that do not compare: malformed, page by page below
            ordered = False
        if ordered:
            return list(zip(*(zip(ptrs[r::per], sizes[r::per]) for r in range(per))))
        out = []
        for lo in range(0, len(ptrs), per):
            segs = list(zip(ptrs[lo : lo + per], sizes[lo : lo + per]))
            with contextlib.suppress(TypeError):  # addresses that do not compare: refused later
                segs.sort()
            out.append(tuple(segs))
        return out

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        return self._pages()[i]

    def __iter__(self) -> Iterator[tuple[Segment, ...]]:
        return iter(self._pages())

    def __repr__(self) -> str:
        return f"PointerPages({self.n} pages of {self.per} segments)"


def _ints(values: Sequence[Any]) -> Sequence[Any]:
    """A list or tuple as it is; a buffer's items as a list of ints (``memoryview.tolist``)."""
    if type(values) in _SEQUENCES:
        return values
    try:
        return memoryview(values).tolist()  # type: ignore[arg-type]
    except TypeError:  # another kind of sequence
        return list(values)


def normalize_page(page: Any) -> tuple[Segment, ...] | None:
    """``page`` as a tuple of ``(address, length)`` int pairs, or None when it is malformed:
    not a non-empty tuple or list of two-item tuples or lists of integers (``__index__``,
    not bool) with address >= 0 and length > 0."""
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
