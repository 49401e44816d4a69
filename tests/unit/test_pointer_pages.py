"""PointerPages (SGLang's flat ``get_page_buffer_meta`` lists as a batch of pages) and the
one-pass check that reads them without building pages (hicache_l3._keys.pointer_batch),
against the references: the pages the adapter built before (``_pages_reference`` below,
its former code), common_batch of the materialised pages and its pure-Python model
(test_get_plan._reference_common), and the connector's key-by-key checks (the same Reason
per key, the same ValueError for overlapping get destinations, the same bytes)."""

from __future__ import annotations

import array
import operator
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3 import Namespace, open_connector
from hicache_l3.common import connector as connector_mod
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import FlatPages, PointerPages, common_batch, pointer_batch
from tests.unit.test_keys import _reference_common

NS = Namespace(model="m", kv_dtype="bf16", layout="layer_first", page_size=16)
SEG = 64


@pytest.fixture(autouse=True)
def _native_built() -> None:
    """The fast pass is C: a build that failed fails these tests, naming it."""
    assert pointer_batch is not None and common_batch is not None, "hicache_l3._keys not built"


def _pages_reference(ptrs: list[Any], sizes: list[Any], per: int) -> list[Any]:
    """The adapter's page building before PointerPages (hicache_l3/sglang/backend.py _pages):
    the pool's order when every page is in address order, else each page sorted."""
    n = len(ptrs) // per
    if per == 1:
        return list(zip(zip(ptrs, sizes)))
    if all(all(map(operator.lt, ptrs[r::per], ptrs[r + 1 :: per])) for r in range(per - 1)):
        return list(zip(*(zip(ptrs[r::per], sizes[r::per]) for r in range(per))))
    segs = list(zip(ptrs, sizes))
    return [sorted(segs[i * per : (i + 1) * per]) for i in range(n)]


def _layer_first(base: int, layers: int, indices: list[int], seg: int = SEG) -> tuple[list[int], list[int]]:
    """MHA layer_first pointer lists as SGLang gives them: per page K0, V0, K1, V1, ...
    (the V buffer after every layer's K buffer)."""
    stride = 1 << 14
    v = layers * stride
    ptrs = [base + layer * stride + i * seg + half * v
            for i in indices for layer in range(layers) for half in (0, 1)]
    return ptrs, [seg] * len(ptrs)


# ---- the pages ----------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.lists(st.integers(0, 1 << 30), min_size=1, max_size=24),
       st.sampled_from([64, 4096]), st.randoms(use_true_random=False))
def test_pages_are_the_adapters_former_pages(per: int, raw: list[int], size: int, rnd: random.Random) -> None:
    n = len(raw) // per or 1
    ptrs = (raw * per)[: n * per]
    if rnd.random() < 0.5:  # pages in address order (page_first, MLA layer_first)
        ptrs = [a for i in range(n) for a in sorted(ptrs[i * per : (i + 1) * per])]
    sizes = [size] * len(ptrs)
    pages = PointerPages(ptrs, sizes, per)
    expected = [tuple(p) for p in _pages_reference(ptrs, sizes, per)]
    assert len(pages) == n and list(pages) == expected
    assert [pages[i] for i in range(n)] == expected and pages[-1] == expected[-1]
    assert pages[1:] == expected[1:] and pages[::2] == expected[::2]
    with pytest.raises(IndexError):
        pages[n]


def test_layer_first_pages_are_k_layers_then_v_layers() -> None:
    ptrs, sizes = _layer_first(1 << 20, 3, [5, 2])
    pages = PointerPages(ptrs, sizes, 6)
    assert pages[0] == tuple(sorted(zip(ptrs[:6], sizes[:6])))
    assert [a for a, _ in pages[0]][:3] == ptrs[0:6:2]  # the K halves first
    assert list(pages) == [tuple(p) for p in _pages_reference(ptrs, sizes, 6)]


def test_wrong_counts_are_refused() -> None:
    with pytest.raises(ValueError):
        PointerPages([1, 2, 3], [64, 64, 64], 2)
    with pytest.raises(ValueError):
        PointerPages([1, 2], [64], 1)
    with pytest.raises(ValueError):
        PointerPages([1, 2], [64, 64], 0)
    assert pointer_batch is not None
    assert pointer_batch(["a", "b"], [0, 64, 128], [64, 64, 64], 1) is None  # 3 segments, 2 keys
    assert pointer_batch(["a"], [0, 64], [64], 2) is None  # sizes shorter than ptrs
    assert pointer_batch([], [], [], 1) is None


# ---- the one-pass check -------------------------------------------------------------------

_address = st.one_of(st.integers(0, 1 << 14).map(lambda a: a * SEG), st.integers(-3, 3),
                     st.just(1.0), st.just(True), st.just(None), st.just(1 << 64), st.just((1 << 64) - SEG))
_length = st.one_of(st.just(SEG), st.just(SEG), st.just(2 * SEG), st.just(0), st.just(-SEG),
                    st.just(False), st.just(float(SEG)))
_keys = st.lists(st.sampled_from(["k1", "k2", "a:b", ".bad", "", "x" * 300, "k3"]), max_size=6)


@st.composite
def _flat(draw: st.DrawFn, malformed: bool = True) -> tuple[list[Any], list[Any], int]:
    per = draw(st.integers(1, 3))
    n = draw(st.integers(0, 5))
    addr, length = (_address, _length) if malformed and draw(st.booleans()) else \
        (st.integers(0, 1 << 14).map(lambda a: a * SEG), st.just(SEG))
    ptrs = draw(st.lists(addr, min_size=n * per, max_size=n * per))
    sizes = draw(st.lists(length, min_size=n * per, max_size=n * per))
    return ptrs, sizes, per


@settings(max_examples=500, deadline=None)
@given(_flat(), _keys)
def test_pointer_batch_is_common_batch_of_the_pages(flat: tuple[list[Any], list[Any], int],
                                                    keys: list[str]) -> None:
    ptrs, sizes, per = flat
    n = len(ptrs) // per
    keys = (keys + ["k"] * n)[:n]
    pages = PointerPages(ptrs, sizes, per)
    assert pointer_batch is not None and common_batch is not None
    got = pointer_batch(keys, ptrs, sizes, per)
    assert got == common_batch(keys, list(pages))
    assert got == _reference_common(keys, list(pages))
    assert pointer_batch(keys, tuple(ptrs), tuple(sizes), per) == got
    if all(type(v) is int and -(1 << 63) <= v < 1 << 63 for v in ptrs + sizes):
        # as int64 buffers (the adapter's computed pointers): the same answer, negatives refused
        qs, qz = array.array("q", ptrs), array.array("q", sizes)
        assert pointer_batch(keys, qs, qz, per) == got
        assert pointer_batch(keys, qs, sizes, per) == got
        assert list(PointerPages(qs, qz, per)) == list(pages)
    if all(type(v) is int and 0 <= v < 1 << 64 for v in ptrs + sizes):
        assert pointer_batch(keys, array.array("Q", ptrs), array.array("Q", sizes), per) == got


def test_pointer_batch_refuses_buffers_of_another_kind() -> None:
    assert pointer_batch is not None
    ok = pointer_batch(["a"], array.array("q", [0, 4096]), [64, 64], 2)
    assert ok is not None and ok[1:] == (2, 64, 0, 4160, False)
    for ptrs in (array.array("i", [0, 4096]), array.array("d", [0.0, 4096.0]), b"\0" * 16,
                 memoryview(array.array("q", [0, 0, 4096, 0]))[::2]):
        assert pointer_batch(["a"], ptrs, [64, 64], 2) is None, ptrs
    assert pointer_batch(["a"], array.array("q", [0, -4096]), [64, 64], 2) is None


# ---- through the connector ----------------------------------------------------------------

@pytest.fixture(scope="module")
def memory_pair() -> Iterator[tuple[Any, HostBuffer]]:
    buf = HostBuffer((1 << 14) * SEG + 4 * SEG, pin=False)
    conn = open_connector("memory", NS, {"store": "pointer-pages"})
    conn.register(buf)
    yield conn, buf
    conn.close()


def _reasons(conn: Any, op: str, keys: list[str], pages: Any, fast: bool) -> Any:
    """The connector's Reasons per key (or the ValueError's type), with or without the C
    passes (without: the key-by-key checks, the reference)."""
    saved = connector_mod.pointer_batch, connector_mod.common_batch
    if not fast:
        connector_mod.pointer_batch = connector_mod.common_batch = None
    try:
        return [r.value for r in conn.batch_reasons(op, keys, pages)]
    except ValueError as exc:
        return type(exc).__name__ + (": overlap" if "overlap" in str(exc) else "")
    finally:
        connector_mod.pointer_batch, connector_mod.common_batch = saved


_example = iter(range(1 << 30))


@settings(max_examples=300, deadline=None)
@given(_flat(), _keys)
def test_connector_reasons_are_the_reference_ones(memory_pair: tuple[Any, HostBuffer],
                                                  flat: tuple[list[Any], list[Any], int],
                                                  keys: list[str]) -> None:
    conn, buf = memory_pair
    ptrs, sizes, per = flat
    n = len(ptrs) // per
    keys = (keys + ["k"] * n)[:n]
    base = buf.address
    ptrs = [p + base if type(p) is int and 0 <= p < (1 << 20) else p for p in ptrs]
    pages = PointerPages(ptrs, sizes, per)
    e = next(_example)
    fresh = {side: [f"e{e}{side}-{k}" if k in ("k", "k1", "k2", "a:b", "k3") else k for k in keys]
             for side in ("f", "r")}
    for op in ("set", "get"):
        assert _reasons(conn, op, fresh["f"], pages, True) == _reasons(conn, op, fresh["r"], pages, False)


def test_flat_pages_reach_the_hook_without_building_pages() -> None:
    seen: list[Any] = []
    buf = HostBuffer(1 << 16, pin=False)
    with open_connector("memory", NS, {"store": "pointer-pages-hook"}) as conn:
        conn.register(buf)
        conn._set = lambda ks, ps: seen.append(ps) or [connector_mod.Reason.OK] * len(ks)
        ptrs, sizes = _layer_first(buf.address, 2, [0, 1, 2], seg=SEG // 4)
        assert conn.batch_set(["p0", "p1", "p2"], PointerPages(ptrs, sizes, 4)) == [True] * 3
    (given,) = seen
    assert isinstance(given, FlatPages) and type(given.pages) is PointerPages
    assert given.pages._built is None  # the check read the flat lists: no page was built
    assert given.segments == b"".join(a.to_bytes(8, "little") + n.to_bytes(8, "little")
                                      for page in given for a, n in page)


def test_file_connector_round_trips_pointer_pages(tmp_path: Path) -> None:
    """The native file path stores PointerPages byte for byte as it stores the same pages
    given as tuples, and reads them back into scattered, unsorted layer_first pages."""
    layers, n = 4, 6
    buf = HostBuffer(1 << 18, pin=False)
    buf.view()[:] = random.Random(7).randbytes(len(buf.view()))
    ptrs, sizes = _layer_first(buf.address, layers, list(range(n)), seg=1024)
    per = 2 * layers
    pages = PointerPages(ptrs, sizes, per)
    as_tuples = list(pages)
    keys = [f"pp{i}" for i in range(n)]
    view, base = buf.view(), buf.address

    def page_bytes() -> list[bytes]:
        return [b"".join(bytes(view[a - base : a - base + k]) for a, k in page) for page in as_tuples]

    def read_back(conn: Any, given: Any) -> list[bytes]:
        view[:] = bytes(len(view))
        assert conn.batch_get(keys, given) == [True] * n
        return page_bytes()

    with open_connector("file", NS, {"root": str(tmp_path / "a"), "io_threads": 1}) as a, \
            open_connector("file", NS, {"root": str(tmp_path / "b"), "io_threads": 1}) as b:
        a.register(buf)
        b.register(buf)
        stored = page_bytes()
        assert a.batch_set(keys, pages) == [True] * n
        assert b.batch_set(keys, as_tuples) == [True] * n
        assert read_back(a, pages) == stored
        assert read_back(a, as_tuples) == stored
        assert read_back(b, pages) == stored
        with pytest.raises(ValueError, match="overlap"):
            a.batch_get(keys[:2], PointerPages(ptrs[:per] * 2, sizes[: 2 * per], per))


@settings(max_examples=500, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.lists(st.integers(0, 40), min_size=4, max_size=4),
       st.lists(st.integers(0, 3), min_size=4, max_size=4), st.sampled_from([1, 2, 4]))
def test_overlap_of_column_batches_is_the_reference(n: int, per: int, bases: list[int], steps: list[int],
                                                    units: int) -> None:
    """Batches shaped like a pool's (segment j of page i at base_j + i * step_j): the
    column-by-column disjointness pass and the sorting fallback agree with the reference
    (pages.overlapping) on every near miss and every overlap."""
    from hicache_l3.common.pages import overlapping

    size = SEG * units
    ptrs = [bases[r] * SEG + i * steps[r] * SEG for i in range(n) for r in range(per)]
    pages = PointerPages(ptrs, [size] * len(ptrs), per)
    keys = [f"c{i}" for i in range(n)]
    assert pointer_batch is not None and common_batch is not None
    got = pointer_batch(keys, ptrs, [size] * len(ptrs), per)
    assert got is not None and got[5] is overlapping(list(pages))
    assert common_batch(keys, list(pages)) == got
