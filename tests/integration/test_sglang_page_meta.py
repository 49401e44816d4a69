"""The learned page pointer model (hicache_l3/sglang/page_meta.py) against SGLang's own
``get_page_buffer_meta``.

Without SGLang (any venv): fake pools, affine and not; the numpy path against the
pure-Python model (Hypothesis); batches with a page start that is not a page boundary or
lies outside the pool are refused (None), never answered with a pointer.

With real SGLang 0.5.23 (this file run as a script by .venv-sglang/bin/python, once): for
every host-pool type and layout the adapter serves (MHA page_first, page_first_direct,
layer_first, page_head; MLA page_first, page_first_direct, layer_first; the hybrid extra
pools Mamba, SWA and the DSA indexer, and the DSA MLA KV pool) the model is learned and its
lists equal SGLang's on random batches that include the last page; the backend's and the
extra pools' page lists equal the ones built from SGLang's answer, also for batches the
model refuses; a pool whose pointers are not affine (a real pool behind a page
permutation) keeps SGLang's function and still moves the right bytes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hicache_l3.sglang import page_meta
from hicache_l3.sglang.page_meta import PointerModel, learn_pointer_model, pool_pages

HERE = Path(__file__).resolve().parent


class FakePool:
    """A pool answering ``get_page_buffer_meta`` the way SGLang's loops do: page ``p``'s
    segment ``j`` at ``bases[j] + perm(p) * strides[j]``; ``reads_all`` also moves a
    page by its second index (a pool reading more than each page's first index)."""

    def __init__(self, pages: int, page_tokens: int, bases: Sequence[int], strides: Sequence[int],
                 sizes: Sequence[int], perm: Sequence[int] | None = None, reads_all: bool = False) -> None:
        self.size = self.logical_size = pages * page_tokens
        self.page_tokens, self.bases, self.strides, self.sizes = page_tokens, bases, strides, sizes
        self.perm, self.reads_all = perm, reads_all

    def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
        idx = list(indices)
        assert len(idx) % self.page_tokens == 0
        ptrs, sizes = [], []
        for i in range(0, len(idx), self.page_tokens):
            p = idx[i] // self.page_tokens
            if self.perm is not None:
                p = self.perm[p]
            if self.reads_all and self.page_tokens > 1:
                p += idx[i + 1] - idx[i] - 1
            for b, s, n in zip(self.bases, self.strides, self.sizes):
                ptrs.append(b + p * s)
                sizes.append(n)
        return ptrs, sizes


def page_indices(pages: Sequence[int], pt: int) -> list[int]:
    return [p * pt + t for p in pages for t in range(pt)]


def sglang_answer(pool: FakePool, pages: Sequence[int]) -> tuple[list[int], list[int]]:
    return pool.get_page_buffer_meta(page_indices(pages, pool.page_tokens))


# ---- real SGLang: this file run as a script in .venv-sglang (which has no pytest) ---------------
def _real_pools_main(root: str) -> int:  # pragma: no cover - runs in .venv-sglang
    """The SGLang part; prints ``REPORT {json}``."""
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(HERE))
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang_hybrid import attach, make_dsa, make_mamba
    from sglang_roundtrip import PAGE, backend, make_pools, storage_config

    from hicache_l3.common.pages import PointerPages
    from hicache_l3.sglang.backend import index_tensor
    from hicache_l3.sglang.config import extra_config_for

    failures: list[str] = []
    learned: list[str] = []
    rng = random.Random(17)

    def check(cond: bool, what: str) -> None:
        if not cond:
            failures.append(what)

    def batch(pages: Sequence[int], pt: int) -> torch.Tensor:
        return torch.tensor(page_indices(pages, pt), dtype=torch.int64)

    def random_batches(total: int) -> list[list[int]]:
        out = [[total - 1], [0], list(range(total))[::-1]]
        for _ in range(30):
            b = [rng.randrange(total) for _ in range(rng.randint(1, 128))]
            b[rng.randrange(len(b))] = total - 1
            out.append(b)
        return out

    def compare(name: str, host: Any, pt: int) -> None:
        model, why = learn_pointer_model(host, pt, index_tensor)
        if model is None:
            failures.append(f"{name}: no model learned: {why}")
            return
        learned.append(name)
        for pages in random_batches(model.pages):
            idx = batch(pages, pt)
            want = tuple(list(v) for v in host.get_page_buffer_meta(idx))
            check(model.pointers(idx, len(pages)) == want, f"{name}: pointers differ on pages {pages[:6]}")
            arr = model.pointer_array(idx, len(pages))
            check(arr is not None and (arr[0].tolist(), arr[1]) == want,
                  f"{name}: pointer_array differs on pages {pages[:6]}")
        # refused, never answered: not a page boundary, past the last page
        if pt > 1:
            check(model.pointers(batch([1, 2], pt) + 1, 2) is None, f"{name}: a non-boundary start answered")
        check(model.pointers(batch([1, model.pages], pt), 2) is None,
              f"{name}: a page past the pool answered")

    pools: list[tuple[str, Any, int]] = []
    for kind, layouts in (("mha", ["page_first", "page_first_direct", "layer_first", "page_head"]),
                          ("mla", ["page_first", "page_first_direct", "layer_first"])):
        for layout in layouts:
            pools.append((f"{kind}/{layout}", make_pools(kind, layout, 1)[0], PAGE))
    pools.append(("mamba", make_mamba(), 1))
    pools.append(("swa", make_pools("mha", "page_first", 1)[0], PAGE))
    (dsa_kv, dsa_ix), = make_dsa(1)
    pools += [("dsa-kv", dsa_kv, dsa_kv.page_size), ("dsa-indexer", dsa_ix, dsa_ix.page_size)]
    for name, host, pt in pools:
        compare(name, host, pt)

    # the backend's page lists (model) against the ones built from SGLang's answer
    extra = extra_config_for("file", {"root": root}, tag="page-meta")
    for kind, layout in (("mha", "page_first"), ("mha", "layer_first"), ("mla", "page_first")):
        host = make_pools(kind, layout, 1)[0]
        b = backend(extra, host, mla=kind == "mla", layout=layout)
        try:
            check(b.pointer_model is not None, f"backend {kind}/{layout}: no pointer model")
            total = host.size // PAGE
            for pages in random_batches(total)[:10]:
                idx = batch(pages, PAGE)
                ptrs, sizes = host.get_page_buffer_meta(idx)
                want = PointerPages(ptrs, sizes, len(ptrs) // len(pages))
                got = b._pages(len(pages), idx)
                got_ptrs = got.ptrs.tolist() if hasattr(got.ptrs, "tolist") else got.ptrs  # (an int64 array)
                same = (got_ptrs, got.sizes, got.per, list(got)) == (
                    want.ptrs, want.sizes, want.per, list(want))
                check(same, f"backend {kind}/{layout}: page lists differ on {pages[:6]}")
            for bad in (batch([2, 3], PAGE) + 3, batch([2, total], PAGE)):  # served by SGLang's function
                ptrs, sizes = host.get_page_buffer_meta(bad)
                got = b._pages(2, bad)
                check((got.ptrs, got.sizes) == (ptrs, sizes),
                      f"backend {kind}/{layout}: fallback lists differ")
            b.clear()
        finally:
            b.close()

    # the hybrid extra pools' page lists, and the reference path forced
    kv, swa = make_pools("mha", "page_first", 2)
    mamba = make_mamba()
    h = attach(extra, kv, {PoolName.MAMBA: mamba, PoolName.SWA: swa}, storage_config, mla=False)
    try:
        for name, host in (("mamba", mamba), ("swa", swa)):
            pool = h.extra_pools[name]
            check(pool.pointer_model is not None, f"extra pool {name}: no pointer model")
            pt = pool.page_tokens
            for pages in random_batches(host.size // pt)[:10]:
                idx = batch(pages, pt)
                got = pool.pages(len(pages), idx)
                model, pool.pointer_model = pool.pointer_model, None
                ref = pool.pages(len(pages), idx)
                pool.pointer_model = model
                ptrs, sizes = host.get_page_buffer_meta(idx)
                per = len(ptrs) // len(pages)
                direct = [tuple(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per]))
                          for i in range(len(pages))]
                check(got == ref == direct, f"extra pool {name}: pages differ on {pages[:6]}")
    finally:
        h.close()

    # a pool whose pointers are not affine: a real pool behind a page permutation
    class Permuted:
        def __init__(self, host: Any, perm: list[int]) -> None:
            self._host, self._perm = host, perm

        def __getattr__(self, name: str) -> Any:
            return getattr(self._host, name)

        def get_page_buffer_meta(self, indices: torch.Tensor) -> Any:
            idx = indices.tolist()
            mapped = [self._perm[i // PAGE] * PAGE + i % PAGE for i in idx]
            return self._host.get_page_buffer_meta(torch.tensor(mapped, dtype=torch.int64))

    src, dst = make_pools("mha", "page_first", 2)
    src.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
    total = src.size // PAGE
    perm = list(range(total))
    random.Random(5).shuffle(perm)
    fa, fb = Permuted(src, perm), Permuted(dst, perm)
    model, why = learn_pointer_model(fa, PAGE, index_tensor)
    check(model is None and bool(why), f"permuted pool: a model was learned ({model})")
    a = backend(extra_config_for("file", {"root": root}, tag="page-meta-perm"), fa, mla=False)
    bb = backend(extra_config_for("file", {"root": root}, tag="page-meta-perm"), fb, mla=False)
    served = False
    try:
        check(a.pointer_model is None and bb.pointer_model is None, "permuted pool: backend uses a model")
        keys = [f"perm-{i}" for i in range(6)]
        sp, dp = [total - 1, 3, 7, 1, 20, 9], [2, 4, 6, 8, 10, total - 1]
        ok_set = a.batch_set_v1(keys, batch(sp, PAGE))
        ok_get = bb.batch_get_v1(keys, batch(dp, PAGE))
        same = [torch.equal(dst.get_data_page(perm[d] * PAGE).contiguous().view(torch.uint8),
                            src.get_data_page(perm[s] * PAGE).contiguous().view(torch.uint8))
                for s, d in zip(sp, dp)]
        served = ok_set == ok_get == [True] * 6 and all(same)
        check(served, f"permuted pool: set {ok_set} get {ok_get} bytes {same}")
        a.clear()
    finally:
        a.close()
        bb.close()
    print("REPORT " + json.dumps({"failures": failures, "learned": learned, "fallback_served": served}))
    return 1 if failures else 0


if __name__ == "__main__":  # pragma: no cover - the SGLang part, run by the test below
    sys.exit(_real_pools_main(sys.argv[1]))

# ---- the tests (pytest, any venv): imported here so that the script above needs no pytest ------
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(pt=st.sampled_from([1, 2, 3, 16, 24, 64]), pages=st.integers(2, 300), per=st.integers(1, 9),
       data=st.data())
def test_learned_model_equals_the_pool_on_random_batches(pt: int, pages: int, per: int,
                                                         data: st.DataObject) -> None:
    base0 = data.draw(st.integers(1 << 20, 1 << 46))
    strides = data.draw(st.lists(st.integers(0, 1 << 22), min_size=per, max_size=per))
    if data.draw(st.booleans()):  # multiples of page_tokens, as in SGLang's layouts (another code path)
        strides = [s * pt for s in strides]
    offsets = data.draw(st.lists(st.integers(0, 1 << 40), min_size=per, max_size=per))
    sizes = data.draw(st.lists(st.integers(1, 1 << 22), min_size=per, max_size=per))
    pool = FakePool(pages, pt, [base0 + o for o in offsets], strides, sizes)
    model, why = learn_pointer_model(pool, pt, list)
    assert model is not None, why
    assert (model.pages, model.per) == (pages, per)
    batch = data.draw(st.lists(st.integers(0, pages - 1), min_size=1, max_size=140))
    want = sglang_answer(pool, batch)
    got = model.pointers(np.asarray(page_indices(batch, pt), dtype=np.int64), len(batch))
    assert got == want
    starts = [p * pt for p in batch]  # both batch paths, whichever pointers() takes
    assert model.pointers_builtin(starts) == model.pointers_numpy(np.asarray(starts)) == want
    arr = model.pointer_array(np.asarray(page_indices(batch, pt), dtype=np.int64), len(batch))
    assert arr is not None and arr[0].dtype == np.int64 and (arr[0].tolist(), arr[1]) == want
    assert [seg for p in batch for seg in model.page(p)] == list(zip(*want))  # the pure-Python reference
    assert _at(model, np.asarray(page_indices(batch, pt), dtype=np.int64), len(batch)) == want


def _at(model: PointerModel, indices: np.ndarray, n: int) -> tuple[list[int], list[int]] | None:
    """``model.pointers_at`` of ``indices`` (int64, contiguous) as lists; the C module
    must be built (it is, wherever the package installs)."""
    assert page_meta.model_pointers is not None, "hicache_l3._host_pages is not built"
    indices = np.ascontiguousarray(indices, dtype=np.int64)
    got = model.pointers_at(indices.ctypes.data, n)
    return None if got is None else (list(got[0]), got[1])


@pytest.mark.parametrize("builtin_max_per", [0, 4])  # the numpy path, the builtin path
@pytest.mark.parametrize(("pt", "stride"), [(16, 4096), (24, 4096), (24, 4104)])
def test_model_reads_only_page_starts_and_refuses_what_is_not_a_page(
        pt: int, stride: int, builtin_max_per: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(page_meta, "BUILTIN_MAX_PER", builtin_max_per)
    pages = 40
    pool = FakePool(pages, pt, [1 << 30, (1 << 30) + (1 << 24)], [stride, stride], [4096, 4096])
    model, why = learn_pointer_model(pool, pt, list)
    assert model is not None, why
    idx = np.asarray(page_indices([3, 39, 0], pt), dtype=np.int64)
    assert model.pointers(idx, 3) == sglang_answer(pool, [3, 39, 0])
    # only each page's first index is read, as SGLang's loops do
    scrambled = idx.copy()
    scrambled[1:pt] = 7
    assert model.pointers(scrambled, 3) == sglang_answer(pool, [3, 39, 0])
    # int32 indices, a torch-like object with .numpy(), a plain list
    assert model.pointers(idx.astype(np.int32), 3) == sglang_answer(pool, [3, 39, 0])
    assert model.pointers(list(idx), 3) == sglang_answer(pool, [3, 39, 0])
    # refused: not a page boundary, past the last page, negative, too few indices, not integers
    for bad, n in ((idx + 1, 3), (np.asarray(page_indices([3, pages], pt)), 2),
                   (np.asarray(page_indices([-1, 2], pt)), 2), (idx[: pt * 2], 3),
                   (idx.astype(np.float64), 3)):
        assert model.pointers(bad, n) is None, bad[::pt]
    assert model.pointers(np.asarray(page_indices([3, pages - 1], pt)), 2) is not None
    assert model.pointers(np.asarray(page_indices([2], pt)) + (1 << 40), 1) is None
    assert model.pointers(np.asarray([2 * pt], dtype=np.uint64) | np.uint64(1 << 63), 1) is None
    assert model.pointers(idx, 0) is None
    assert model.pointer_array(idx, 0) is None
    assert model.pointer_array(np.asarray(page_indices([2], pt)) + (1 << 40), 1) is None
    # the C path (model_pointers) answers and refuses the same
    assert _at(model, idx, 3) == _at(model, scrambled, 3) == sglang_answer(pool, [3, 39, 0])
    for bad in (idx + 1, np.asarray(page_indices([3, pages], pt)), np.asarray(page_indices([-1, 2], pt)),
                np.asarray(page_indices([2], pt)) + (1 << 40)):
        assert _at(model, bad, len(bad) // pt) is None, bad[::pt]
    assert _at(model, np.asarray(page_indices([3, pages - 1], pt)), 2) is not None
    assert _at(model, idx, 0) is None


@pytest.mark.parametrize("case", ["permuted", "reads-all", "sizes-vary", "raises", "one-page", "too-few",
                                  "beyond-int64"])
def test_a_pool_the_model_does_not_fit_keeps_sglangs_function(case: str) -> None:
    pt, pages = 4, 50
    perm = list(range(pages))
    random.Random(3).shuffle(perm)

    class VaryingSizes(FakePool):
        def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
            ptrs, sizes = super().get_page_buffer_meta(indices)
            return ptrs, [s + (p // 4096) % 2 for s, p in zip(sizes, ptrs)]

    class Raises(FakePool):
        def get_page_buffer_meta(self, indices: Any) -> tuple[list[int], list[int]]:
            raise ValueError("layout not supported")

    args: tuple[Any, ...] = (pages, pt, [1 << 30], [4096], [4096])
    pool = {"permuted": FakePool(*args, perm=perm), "reads-all": FakePool(*args, reads_all=True),
            "sizes-vary": VaryingSizes(*args), "raises": Raises(*args),
            "one-page": FakePool(1, pt, [1 << 30], [4096], [4096]),
            "too-few": FakePool(*args),
            "beyond-int64": FakePool(pages, pt, [(1 << 63) - 4096 * 10], [4096], [4096])}[case]
    if case == "too-few":  # a pool answering with a segment list that does not split in pages
        pool.get_page_buffer_meta = lambda indices: ([1, 2, 3], [1, 1, 1])  # type: ignore[method-assign]
    model, why = learn_pointer_model(pool, pt, list)
    assert model is None and why


def test_pool_pages_and_model_checks() -> None:
    pool = FakePool(10, 16, [0], [1], [1])
    assert pool_pages(pool, 16) == 10
    del pool.logical_size
    assert pool_pages(pool, 4) == 40
    assert pool_pages(object(), 4) == 0
    with pytest.raises(ValueError):
        PointerModel(16, 10, [1, 2], [1], [1, 1])
    m = PointerModel(16, 10, [100, 5000], [10, 20], [7, 9])
    assert m.page(3) == [(130, 7), (5060, 9)]
    assert m.size_list(2) == [7, 9, 7, 9] and m.size_list(2) is m.size_list(2)


@pytest.mark.sglang
def test_learned_pointers_equal_sglangs_on_real_pools(tmp_path: Path) -> None:
    """See the module docstring (the SGLang part); every check's failure is reported."""
    from test_sglang import require_sglang_venv  # beside this file: pytest puts its dir on sys.path

    python = require_sglang_venv()
    proc = subprocess.run([str(python), str(Path(__file__)), str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=600, cwd=HERE.parents[1])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"no report (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    report = json.loads(lines[-1][len("REPORT "):])
    assert report["failures"] == [], "\n".join(report["failures"])
    assert sorted(report["learned"]) == sorted(
        ["mha/page_first", "mha/page_first_direct", "mha/layer_first", "mha/page_head", "mla/page_first",
         "mla/page_first_direct", "mla/layer_first", "mamba", "swa", "dsa-kv", "dsa-indexer"])
    assert report["fallback_served"] is True
