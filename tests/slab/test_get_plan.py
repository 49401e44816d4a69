"""The planned get path (one C call plans a batch: hicache_l3/slab/plan.py, then one
native read) against the reference (SlabIndex.lookup, a ReadBatch): the same Reason per
key, the same bytes, the same index afterwards, on batches with misses, corrupt and torn
slots, size mismatches, unverified pages and an unreadable slab; and the connector's fast
common-batch check on a slab connector's get (overlap, which pages reach the hook)."""

from __future__ import annotations

import os
import random
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.errors import Reason
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import FlatPages, common_batch
from hicache_l3.conformance.slab_backdoor import SlabBackdoor, slab_location
from hicache_l3.slab import plan as plan_mod
from hicache_l3.slab.format import Entry
from hicache_l3.slab.native import library
from hicache_l3.slab.table import NativePageTable, digest

P = 8192
N = 14
NS = Namespace(model="m", kv_dtype="bf16", layout="page_first", page_size=16)


@pytest.fixture(autouse=True)
def _libraries_built() -> None:
    """These tests are of the C path: a library that did not build (or was refused) fails
    them, naming why, instead of skipping them (the test set-up builds both)."""
    library()  # ImportError, naming the fix, where it is not built
    assert common_batch is not None, "hicache_l3._keys not built (common_batch missing)"

OK, MISS, CORRUPT = Reason.OK, Reason.MISS, Reason.CORRUPT
# what the damaged batch of _damaged_store must read as, key by key
EXPECTED = [OK, OK, MISS, CORRUPT, CORRUPT, Reason.UNVERIFIED, Reason.SIZE_MISMATCH,
            OK, MISS, OK, OK, OK, OK, OK]


class _Backdoor(SlabBackdoor):
    page_bytes = P


def _fill(buf: HostBuffer, seed: int) -> None:
    buf.view()[:] = random.Random(seed).randbytes(len(buf.view()))


def _open(root: Path, **extra: Any) -> Any:
    return open_connector("file", NS, {"root": str(root), "io_threads": 1, **extra})


def _damaged_store(root: Path) -> tuple[list[str], bytes]:
    """Keys k0..k13 stored with checksums except k5 (stored by a writer without), k2 and
    k8 never stored; then k3's data flipped and k4's slot torn. The bytes set."""
    keys = [f"page-{i:02d}" for i in range(N)]
    src = HostBuffer(N * P)
    _fill(src, 1)
    pages = [((src.address + i * P, P),) for i in range(N)]
    plain = [i for i in range(N) if i not in (2, 5, 8)]
    with _open(root) as w:
        w.register(src)
        assert all(w.batch_set([keys[i] for i in plain], [pages[i] for i in plain]))
    with _open(root, checksum="none") as w:
        w.register(src)
        assert w.batch_set([keys[5]], [pages[5]]) == [True]
    door = _Backdoor()
    door.backdoor_corrupt({"root": str(root)}, NS, keys[3], "flip")
    door.backdoor_corrupt({"root": str(root)}, NS, keys[4], "truncate")
    return keys, bytes(src.view())


def _get(root: Path, keys: list[str], planned: bool,
         wreck: Any = None) -> tuple[list[Reason], bytes, list[bool], int]:
    """A fresh reader's get of ``keys`` through the planned path or the reference one:
    (reasons, destination bytes, exists afterwards, plans made)."""
    dst = HostBuffer(N * P)
    pages = [((dst.address + i * P, P),) for i in range(len(keys))]
    with _open(root) as r:
        r.register(dst)
        assert r.batch_exists(keys[:1]) is not None  # opens the store
        store = r._store
        assert store is not None
        if wreck is not None:
            wreck(store, keys)
        if not planned:
            r.transport.reads_plans = False  # the instance takes _get_located, the reference
        plans = []
        real = store.plan_get
        store.plan_get = lambda *a: plans.append(real(*a)) or plans[-1]
        reasons = r.batch_reasons("get", keys, pages)
        return reasons, bytes(dst.view()), r.batch_exists(keys), len([p for p in plans if p is not None])


def _wrong_size(store: Any, keys: list[str]) -> None:
    """k6's index entry claims a page longer than a slot (a shorter one would be a frame)."""
    d = digest("page-06")
    e = store.index.table.get(d)
    store.index.table.put(d, Entry(e.writer, e.slab, e.slot, e.gen, 2 * P, e.checksum))


def test_planned_get_agrees_with_the_reference(tmp_path: Path) -> None:
    keys, src = _damaged_store(tmp_path)
    planned = _get(tmp_path, keys, True, _wrong_size)
    reference = _get(tmp_path, keys, False, _wrong_size)
    assert planned[3] == 1 and reference[3] == 0  # each took the path it names
    assert planned[0] == reference[0] == EXPECTED
    for i, r in enumerate(EXPECTED):
        if r is OK:
            assert planned[1][i * P:(i + 1) * P] == src[i * P:(i + 1) * P], i
    assert planned[1] == reference[1]
    # corrupt, torn and unverified pages left this reader's index; misses and the
    # size mismatch are still what the logs say (the reader dropped nothing else)
    assert planned[2] == reference[2]
    assert [i for i, e in enumerate(planned[2]) if not e] == [2, 3, 4, 5, 8]


def test_planned_get_of_an_all_hit_batch_is_every_byte(tmp_path: Path) -> None:
    keys, src = _damaged_store(tmp_path)
    good = [k for k, r in zip(keys, EXPECTED) if r is OK]
    reasons, got, _, plans = _get(tmp_path, good, True)
    assert plans == 1 and reasons == [OK] * len(good)
    for j, k in enumerate(good):
        i = keys.index(k)
        assert got[j * P:(j + 1) * P] == src[i * P:(i + 1) * P]


def test_an_unreadable_slab_drops_only_its_keys_in_both_paths(tmp_path: Path) -> None:
    keys, _ = _damaged_store(tmp_path)
    where = slab_location(tmp_path, NS, keys[0])
    assert where is not None
    os.rename(where[0], str(where[0]) + ".gone")  # (root opens a file of mode 0 anyway)
    # k5 (unverified) and k6 (size mismatch) too: in an unopenable slab they miss, as
    # SlabIndex.lookup has it (it opens the slab of every indexed key)
    some = [keys[i] for i in (0, 1, 5, 6, 7)]
    lost = [slab_location(tmp_path, NS, k)[0] == where[0] for k in some]  # type: ignore[index]
    assert lost[:2] == [True, True] and lost[4]
    planned = _get(tmp_path, some, True, _wrong_size)
    reference = _get(tmp_path, some, False, _wrong_size)
    assert planned[0] == reference[0]
    assert [r for r, gone in zip(planned[0], lost) if gone] == [MISS] * sum(lost)
    assert planned[2] == reference[2]
    assert [e for e, gone in zip(planned[2], lost) if gone] == [False] * sum(lost)


def test_a_planned_read_that_finds_another_record_is_a_miss(tmp_path: Path) -> None:
    """The plan's expected marker records are checked: tampering with one (its generation)
    makes that key read as corrupt, as a torn slot does, and drops it."""
    keys, _ = _damaged_store(tmp_path)
    good = [keys[i] for i in (0, 1, 7)]

    def stale_generation(store: Any, ks: list[str]) -> None:
        d = digest(ks[1])
        e = store.index.table.get(d)
        store.index.table.put(d, Entry(e.writer, e.slab, e.slot, e.gen + 1, e.length, e.checksum))

    planned = _get(tmp_path, good, True, stale_generation)
    reference = _get(tmp_path, good, False, stale_generation)
    assert planned[0] == reference[0] == [OK, CORRUPT, OK]


def test_plan_fields_match_the_python_spelling(tmp_path: Path) -> None:
    """Offsets, records and checksums of a plan are those of Geometry.offsets and
    expected_markers (the reference's spelling)."""
    from hicache_l3.slab.format import expected_markers

    keys, _ = _damaged_store(tmp_path)
    with _open(tmp_path) as r:
        r.batch_exists(keys[:1])
        store = r._store
        assert store is not None and isinstance(store.index.table, NativePageTable)
        located = store.lookup(keys)
        plan = store.plan_get(keys, True)
        assert plan is not None
        read = [i for i, loc in enumerate(located) if loc is not None and i != 5]
        assert list(plan.where) == read
        entries = [located[i].entry for i in read]  # type: ignore[union-attr]
        data, marker = store.geometry.offsets(e.slot for e in entries)
        assert list(plan.data_offs) == data and list(plan.marker_offs) == marker
        assert bytes(plan.expect) == b"".join(expected_markers(entries, [keys[i] for i in read]))
        assert list(plan.csums) == [e.checksum for e in entries]
        assert [plan.entry(i) for i in read] == entries
        assert list(plan.fds) == [located[i].fd for i in read]  # type: ignore[union-attr]
        assert [plan.code[i] for i in (2, 5, 8)] == [plan_mod.MISS, plan_mod.UNVERIFIED, plan_mod.MISS]


def test_a_key_with_a_newline_is_not_planned(tmp_path: Path) -> None:
    keys, _ = _damaged_store(tmp_path)
    with _open(tmp_path) as r:
        r.batch_exists(keys[:1])
        store = r._store
        assert store is not None
        assert store.plan_get([keys[0], "a\nb"], True) is None
        assert store.plan_get([keys[0]], True) is not None


_DAMAGE = {"ok": OK, "miss": MISS, "flip": CORRUPT, "torn": CORRUPT, "recycled": CORRUPT,
           "size": Reason.SIZE_MISMATCH, "short": CORRUPT}  # short: read as a frame, none there


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(damage=st.lists(st.sampled_from(sorted(_DAMAGE)), min_size=1, max_size=N)
       .filter(lambda d: d != ["miss"] * len(d)), order=st.randoms())  # a store to open
def test_planned_get_agrees_with_the_reference_on_any_damage(tmp_path: Path, damage: list[str],
                                                             order: random.Random) -> None:
    """Any mix of hits, misses, flipped data, torn slots (a rewrite cut short), recycled
    slots (the index names an older generation than the slot's record), size
    mismatches and entries shorter than a slot (read as frames), asked for in any
    order: the planned get (hl3_pt_plan_get, hl3_read_plan) and the reference (lookup,
    a ReadBatch) give the same Reason per key, the one the damage implies, the same
    bytes and the same index afterwards."""
    root = tmp_path / uuid.uuid4().hex  # tmp_path is shared by the examples
    keys = [f"dmg-{i:02d}" for i in range(len(damage))]
    src = HostBuffer(N * P)
    _fill(src, order.getrandbits(16))
    stored = [i for i, d in enumerate(damage) if d != "miss"]
    with _open(root) as w:
        w.register(src)
        assert all(w.batch_set([keys[i] for i in stored], [((src.address + i * P, P),) for i in stored]))
    door = _Backdoor()
    for i, d in enumerate(damage):
        if d in ("flip", "torn"):
            door.backdoor_corrupt({"root": str(root)}, NS, keys[i], "flip" if d == "flip" else "truncate")

    def wreck(store: Any, ks: list[str]) -> None:
        for i, d in enumerate(damage):
            if d in ("size", "recycled", "short"):
                e = store.index.table.get(digest(keys[i]))
                length = {"size": 2 * P, "short": P // 2}.get(d, P)
                store.index.table.put(digest(keys[i]), Entry(e.writer, e.slab, e.slot,
                                                             e.gen - 1 if d == "recycled" else e.gen,
                                                             length, e.checksum))

    asked = order.sample(range(len(keys)), len(keys))
    planned = _get(root, [keys[i] for i in asked], True, wreck)
    reference = _get(root, [keys[i] for i in asked], False, wreck)
    assert planned[3] == 1 and reference[3] == 0
    assert planned[0] == reference[0] == [_DAMAGE[damage[i]] for i in asked]
    assert planned[1] == reference[1]
    assert planned[2] == reference[2]
    for j, i in enumerate(asked):
        if damage[i] == "ok":
            assert planned[1][j * P:(j + 1) * P] == bytes(src.view()[i * P:(i + 1) * P])


# ---- the fast check on a slab connector's get ------------------------------------------------

def test_get_with_overlapping_destinations_raises_on_the_fast_check(tmp_path: Path) -> None:
    keys, _ = _damaged_store(tmp_path)
    dst = HostBuffer(4 * P)
    with _open(tmp_path) as r:
        r.register(dst)
        with pytest.raises(ValueError, match="overlap"):
            r.batch_get(keys[:2], [((dst.address, P),), ((dst.address + P // 2, P),)])
        with pytest.raises(ValueError, match="overlap"):  # not common: the key-by-key path
            r.batch_get(keys[:2], [((dst.address, P),),
                                   ((dst.address + P // 2, P // 2), (dst.address + 2 * P, P // 2))])


def test_flat_pages_reach_the_hook_only_for_the_common_batch(tmp_path: Path) -> None:
    keys, _ = _damaged_store(tmp_path)
    dst = HostBuffer(4 * P)
    seen: list[object] = []
    with _open(tmp_path) as r:
        r.register(dst)
        real = r._get
        r._get = lambda ks, ps: seen.append(ps) or real(ks, ps)  # type: ignore[method-assign]
        pages = [((dst.address + i * P, P),) for i in range(2)]
        assert r.batch_get(keys[:2], pages) == [True, True]
        assert r.batch_get(keys[:2], [pages[0], ((dst.address + P, P - 1),)]) == [True, False]
    assert isinstance(seen[0], FlatPages) and not isinstance(seen[1], FlatPages)
