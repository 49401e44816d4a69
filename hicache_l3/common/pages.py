"""Page references: a page is one or more ``(address, length)`` segments of host memory.

``page_first`` host pools give one contiguous segment per page; ``layer_first`` pools
give one segment per layer (and per K/V half), scattered through the pool. Every
connector accepts both: a page is a ``Sequence[Segment]``.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any

Segment = tuple[int, int]
Page = Sequence[Segment]

_SEQUENCES = (tuple, list)


class FlatPages(Sequence[Any]):
    """A checked batch's pages (``pages``, unchanged, indexed through) carrying every
    segment already flattened: ``segments``, native uint64 ``(address, length)`` pairs in
    page order, each page ``per`` segments. Built by the connector's common-batch check
    (:meth:`~hicache_l3.common.connector.Connector._transfer`) so that a transport that
    walks flat segments (the native one) takes them as they are instead of flattening the
    pages again; any other code sees a sequence of pages (of :class:`PointerPages` too,
    whose pages are then built only when indexed). A slice is a plain list: only the
    whole batch carries ``segments``."""

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
    """``len(ptrs) // per`` pages given as flat lists, the way SGLang's host pools describe
    them (``get_page_buffer_meta``): page ``i`` is the segments
    ``(ptrs[j], sizes[j])`` for ``j`` in ``[i * per, (i + 1) * per)``, in address order.

    Address order is the order of SGLang's flat page in every layout that has one (MHA
    ``layer_first``: all K layers, then all V layers), so a page is byte for byte what the
    legacy copying path stores. Pages (tuples of pairs) are built only when first indexed,
    all at once, and kept: the connector's common-batch check reads the flat lists directly
    (:data:`~hicache_l3.common.keys.pointer_batch`), while every reference path and every
    other connector sees ordinary pages. Values are taken as given; a page whose addresses
    do not compare keeps the given order (the connector then refuses it as malformed).
    ValueError when ``per < 1`` or the lists do not hold ``per`` segments per page.
    ``ptrs``/``sizes`` may also be buffers of 8-byte integers (a numpy ``int64`` array, as
    the SGLang adapter computes them): the check reads them as they are, without a Python
    int per segment; pages built from them hold ints.
    """

    __slots__ = ("_built", "n", "per", "ptrs", "sizes")

    def __init__(self, ptrs: Sequence[Any], sizes: Sequence[Any], per: int) -> None:
        if per < 1 or len(ptrs) != len(sizes) or len(ptrs) % per:
            raise ValueError(f"PointerPages: {len(ptrs)} addresses and {len(sizes)} lengths "
                             f"are not {per} segments per page")
        self.ptrs, self.sizes, self.per, self.n = ptrs, sizes, per, len(ptrs) // per
        self._built: list[tuple[Segment, ...]] | None = None

    def _pages(self) -> list[tuple[Segment, ...]]:
        """Every page, built on first use, all at once (C-level passes when every page is
        already in address order), then kept: a connector that indexes pages pays what
        building them in the adapter cost before, the native path nothing."""
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
