"""SGLang's page pointer lists without SGLang's per-page Python loop: segment ``j`` of page
``p`` lies at ``base_j + p * stride_j``, a model learnt from ``get_page_buffer_meta`` and
kept only when it reproduces SGLang's answers exactly. Imports neither torch nor SGLang.
"""

from __future__ import annotations

import logging
import operator
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hicache_l3.common.keys import BUILD_HINT

try:  # hicache_l3/native/host_pages.c
    from hicache_l3._host_pages import model_pointers
except ImportError as exc:
    raise ImportError(f"hicache_l3._host_pages is not usable ({exc}): {BUILD_HINT}",
                      name="hicache_l3._host_pages") from exc

log = logging.getLogger("hicache_l3.sglang")

PROBE_PAGES = 8  # random pages probed besides 0, 1 and the last one
BUILTIN_MAX_PER = 4  # up to this many segments per page, lists built with builtins, else numpy
_MAX_CACHED_SIZES = 64  # batch lengths whose size lists are kept


class PointerModel:
    """The learned pointer model of one host pool: page ``p`` (``0 <= p < pages``) is the
    segments ``(bases[j] + p * strides[j], sizes[j])``, ``j < per``, in SGLang's order.
    Immutable once built; safe to share between threads."""

    __slots__ = ("_bases", "_by_token", "_limit", "_mask", "_mult", "_off", "_size_lists", "_terms",
                 "_terms_bytes", "bases", "page_tokens", "pages", "per", "sizes", "strides")

    def __init__(self, page_tokens: int, pages: int, bases: Sequence[int], strides: Sequence[int],
                 sizes: Sequence[int]) -> None:
        if page_tokens < 1 or pages < 1 or not bases or not (len(bases) == len(strides) == len(sizes)):
            raise ValueError(f"PointerModel: {page_tokens} tokens per page, {pages} pages, "
                             f"{len(bases)}/{len(strides)}/{len(sizes)} bases/strides/sizes")
        self.page_tokens, self.pages, self.per = page_tokens, pages, len(bases)
        self.bases, self.strides, self.sizes = tuple(bases), tuple(strides), tuple(sizes)
        self._bases = np.asarray(self.bases, dtype=np.int64)
        self._limit = pages * page_tokens  # first host index past the pool
        # page_tokens a power of two: OR-ing the page starts shows any start off a boundary
        self._mask = page_tokens - 1 if page_tokens & (page_tokens - 1) == 0 else None
        # every stride a multiple of page_tokens (SGLang's layouts): ptr = base + start * stride/pt
        self._by_token = all(s % page_tokens == 0 for s in self.strides)
        mult = [s // page_tokens for s in self.strides] if self._by_token else list(self.strides)
        self._mult = np.asarray(mult, dtype=np.int64)
        self._terms = tuple(zip(self.bases, mult))  # (base, multiplier) per segment, for builtins
        self._terms_bytes = np.asarray(self._terms, dtype=np.int64).tobytes()  # for model_pointers
        self._off: Callable[[int], int] = (  # start -> its offset from a page boundary
            self._mask.__and__ if self._mask is not None else page_tokens.__rmod__)
        self._size_lists: dict[int, list[int]] = {}

    def page(self, p: int) -> list[tuple[int, int]]:
        """The segments of page ``p`` (the reference the batch paths are checked against)."""
        return [(b + p * s, n) for b, s, n in zip(self.bases, self.strides, self.sizes)]

    def size_list(self, n: int) -> list[int]:
        """The lengths list of ``n`` pages (cached per ``n``; callers must not change it)."""
        got = self._size_lists.get(n)
        if got is None:
            got = list(self.sizes) * n
            if len(self._size_lists) < _MAX_CACHED_SIZES:
                self._size_lists[n] = got
        return got

    def pointers(self, host_indices: Any, n: int) -> tuple[list[int], list[int]] | None:
        """``get_page_buffer_meta``'s ``(ptrs, sizes)`` for the ``n`` pages starting at
        ``host_indices[i * page_tokens]`` (CPU tensor, numpy array or ints); None when fewer
        than ``n`` pages are given, the indices are not integers, or a page start is off a
        page boundary or outside the pool."""
        first = self._starts(host_indices, n)
        if first is None:
            return None
        if self.per <= BUILTIN_MAX_PER:
            return self.pointers_builtin(first.tolist())
        return self.pointers_numpy(first)

    def pointer_array(self, host_indices: Any, n: int) -> tuple[Any, list[int]] | None:
        """:meth:`pointers` with the addresses as a numpy ``int64`` array; the same None cases."""
        first = self._starts(host_indices, n)
        return None if first is None else self.pointers_numpy(first, as_array=True)

    def pointers_at(self, address: int, n: int) -> tuple[Any, list[int]] | None:
        """:meth:`pointer_array` of ``n * page_tokens`` contiguous ``int64`` host indices at
        ``address`` (the caller holds them), in one C call, addresses as ``array('q')``."""
        if n < 1:
            return None
        got = model_pointers(address, n, self.page_tokens, not self._by_token, self._limit, self._terms_bytes)
        return None if got is None else (got, self.size_list(n))

    def _starts(self, host_indices: Any, n: int) -> Any:
        """The ``n`` pages' first host indices as a 1-D numpy integer array, or None."""
        if n < 1:
            return None
        try:
            arr = host_indices.numpy() if hasattr(host_indices, "numpy") else np.asarray(host_indices)
        except (TypeError, RuntimeError, ValueError):  # a GPU tensor, one requiring grad, ...
            return None
        pt = self.page_tokens
        first = (arr if arr.ndim == 1 else arr.reshape(-1))[: n * pt : pt]
        if first.shape[0] != n or first.dtype.kind not in "iu":
            return None
        return first

    def pointers_builtin(self, starts: list[int]) -> tuple[list[int], list[int]] | None:
        """:meth:`pointers` from the pages' first host indices as Python ints, with builtins."""
        n = len(starts)
        if not n or min(starts) < 0 or max(starts) >= self._limit:
            return None
        if self.page_tokens > 1 and any(map(self._off, starts)):
            return None
        col = starts if self._by_token else list(map(self.page_tokens.__rfloordiv__, starts))
        per = self.per
        if per == 1:
            base, mult = self._terms[0]
            return list(map(base.__add__, map(mult.__mul__, col))), self.size_list(n)
        ptrs = [0] * (n * per)
        for j, (base, mult) in enumerate(self._terms):
            ptrs[j::per] = map(base.__add__, map(mult.__mul__, col))
        return ptrs, self.size_list(n)

    def pointers_numpy(self, first: Any, as_array: bool = False) -> tuple[Any, list[int]] | None:
        """:meth:`pointers` from the pages' first host indices as a 1-D numpy integer array
        (with ``as_array``, the addresses as an ``int64`` array)."""
        n = first.shape[0]
        if not n or first.dtype.kind not in "iu":
            return None
        pt = self.page_tokens
        if first.dtype != np.int64:
            first = first.astype(np.int64)  # uint64 beyond int64 turns negative: refused below
        # as uint64 a negative start is huge: one max() bounds both ends
        if first.view(np.uint64).max() >= self._limit:
            return None
        if pt > 1 and (np.bitwise_or.reduce(first) & self._mask if self._mask is not None
                       else (first % pt).any()):
            return None
        col = first if self._by_token else first // pt
        ptrs = (col[:, None] * self._mult + self._bases).ravel()
        return (ptrs if as_array else ptrs.tolist()), self.size_list(n)

    def __repr__(self) -> str:
        return (f"PointerModel({self.pages} pages of {self.page_tokens} tokens, {self.per} segments "
                f"of {list(self.sizes)} bytes, strides {list(self.strides)})")


def pool_pages(host: Any, page_tokens: int) -> int:
    """How many pages of ``page_tokens`` host indices the pool holds (its ``logical_size``,
    else its ``size``, in tokens); 0 when the pool tells neither."""
    for name in ("logical_size", "size"):
        tokens = getattr(host, name, None)
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0:
            return tokens // page_tokens
    return 0


def _as_ints(values: Sequence[Any]) -> list[int] | None:
    try:
        return [operator.index(v) for v in values]
    except TypeError:
        return None


def _page_indices(pages: Sequence[int], page_tokens: int) -> list[int]:
    return [p * page_tokens + t for p in pages for t in range(page_tokens)]


def learn_pointer_model(
    host: Any,
    page_tokens: int,
    make_indices: Callable[[list[int]], Any],
    *,
    pages: int | None = None,
    probes: int = PROBE_PAGES,
    seed: int = 0,
) -> tuple[PointerModel | None, str]:
    """Learn ``host``'s pointer model from its own ``get_page_buffer_meta``
    (``make_indices(ints)`` builds the int64 CPU index tensor it takes). ``(model, "")``
    when the model reproduces SGLang's answer exactly on every probed batch (pages 0, 1, the
    last and ``probes`` random ones; the last alone; pages with scrambled non-first indices),
    else ``(None, why)``; never raises."""
    if page_tokens < 1:
        return None, f"{page_tokens} host indices per page"
    total = pool_pages(host, page_tokens) if pages is None else pages
    if total < 2:
        return None, f"the pool holds {total} pages of {page_tokens} host indices (2 needed to fit)"
    rng = random.Random(seed)
    picks = [0, 1, total - 1]
    picks += rng.sample(range(2, total - 1), min(probes, max(0, total - 3)))
    order = list(picks)
    rng.shuffle(order)  # not in page order: SGLang's batch order must be kept

    def ask(page_list: Sequence[int], indices: list[int]) -> tuple[list[int], list[int]] | str:
        try:
            ptrs, sizes = host.get_page_buffer_meta(make_indices(indices))
        except Exception as exc:
            return f"get_page_buffer_meta raised {exc!r} on pages {list(page_list)[:4]}"
        p_ints, s_ints = _as_ints(ptrs), _as_ints(sizes)
        if p_ints is None or s_ints is None:
            return "get_page_buffer_meta gave addresses or lengths that are not integers"
        if len(p_ints) != len(s_ints) or not p_ints or len(p_ints) % len(page_list):
            return (f"get_page_buffer_meta described {len(page_list)} pages with {len(p_ints)} "
                    f"addresses and {len(s_ints)} lengths")
        return p_ints, s_ints

    got = ask(order, _page_indices(order, page_tokens))
    if isinstance(got, str):
        return None, got
    ptrs, sizes = got
    per = len(ptrs) // len(order)
    row = {p: i * per for i, p in enumerate(order)}
    bases, seg_sizes = ptrs[row[0] : row[0] + per], sizes[row[0] : row[0] + per]
    strides = [b1 - b0 for b0, b1 in zip(bases, ptrs[row[1] : row[1] + per])]
    lasts = [b + (total - 1) * s for b, s in zip(bases, strides)]
    if any(not 0 <= v < 1 << 63 for v in [*bases, *lasts, *seg_sizes]) or any(
            a + n >= 1 << 63 for a, n in zip(lasts, seg_sizes)):
        return None, "addresses or lengths outside 0..2**63 (numpy's int64)"
    try:
        model = PointerModel(page_tokens, total, bases, strides, seg_sizes)
    except (ValueError, OverflowError) as exc:
        return None, str(exc)

    def matches(page_list: Sequence[int], answer: tuple[list[int], list[int]]) -> bool:
        want = [seg for p in page_list for seg in model.page(p)]
        return list(zip(*answer)) == want

    if not matches(order, got):
        return None, (f"page addresses are not base + page * stride with constant lengths "
                      f"(probed pages {sorted(picks)})")
    alone = ask([total - 1], _page_indices([total - 1], page_tokens))
    if isinstance(alone, str) or not matches([total - 1], alone):
        why = alone if isinstance(alone, str) else "its segments differ"
        return None, f"the last page alone is described otherwise ({why})"
    if page_tokens > 1:
        scrambled_pages = [total - 1, *order[:3]]
        scrambled = [v for p in scrambled_pages for v in
                     [p * page_tokens] + [rng.randrange(total * page_tokens) for _ in range(page_tokens - 1)]]
        answer = ask(scrambled_pages, scrambled)
        if isinstance(answer, str) or not matches(scrambled_pages, answer):
            return None, ("the pool reads more of a page's host indices than the first "
                          f"({answer if isinstance(answer, str) else 'its answer moves'})")
    # both batch paths against SGLang's answer on the probed pages
    starts = [p * page_tokens for p in order]
    for path, check in (("builtin", model.pointers_builtin(starts)),
                        ("numpy", model.pointers_numpy(np.asarray(starts, dtype=np.int64)))):
        if check is None or check[0] != ptrs or check[1] != sizes:
            return None, f"the {path} path disagrees with SGLang's answer"
    return model, ""


def learned_pointers(host: Any, page_tokens: int, make_indices: Callable[[list[int]], Any],
                     what: str) -> PointerModel | None:
    """:func:`learn_pointer_model` for an attach: the model, or None (the reason logged at
    info, ``what`` naming the pool); never raises."""
    try:
        model, why = learn_pointer_model(host, page_tokens, make_indices)
    except Exception as exc:  # SGLang's function serves every batch then
        model, why = None, f"learning failed: {exc!r}"
    if model is None:
        log.info("hicache-l3: %s (%s): page pointers come from SGLang's get_page_buffer_meta, "
                 "page by page: %s", what, type(host).__name__, why)
    else:
        log.debug("hicache-l3: %s: page pointers computed from %r", what, model)
    return model
