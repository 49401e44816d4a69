"""The slab index on its digest-keyed page table (hicache_l3/slab/index.py, store.py):
what moved from key strings to digests -- a digest collision reads as a miss, deletes free
own slots, compaction and clear get the keys from the logs."""

from __future__ import annotations

from pathlib import Path

from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.pages import Pages
from hicache_l3.slab.format import Geometry
from hicache_l3.slab.store import SlabStore
from hicache_l3.slab.table import digest

NS = Namespace(model="table-test", kv_dtype="uint8", layout="page_first", page_size=64, tag="t")
PAGE = 4096


def _store(root: Path, slots: int, per_slab: int = 4) -> SlabStore:
    stride = Geometry(64).stride
    return SlabStore(root, NS, 64, capacity_bytes=slots * stride, slab_bytes=per_slab * stride)


def _set(store: SlabStore, keys: list[str]) -> None:
    plan = store.reserve_new(keys)
    assert len(plan.slots) == len(keys)
    store.commit([keys[i] for i in plan.todo], plan.slots, [1] * len(plan.slots))


def test_digest_collision_reads_as_a_miss_never_the_other_keys_bytes(tmp_path: Path) -> None:
    """The index maps B's digest to A's slot (what a digest collision does): the slot
    header's key fingerprint (another hash) is A's, so B reads as a miss."""
    with open_connector("file", NS, root=str(tmp_path)) as conn:
        pages = Pages(conn, PAGE, 2)
        pages.fill(["A", "B"])
        assert conn.batch_set(["A"], pages.pages[:1]) == [True]
        store = conn._store
        with store._lock:
            entry = store.index.entry("A")
            assert entry is not None
            store.index.table.put(digest("B"), entry)  # B now "collides" into A's slot
        pages.wipe()
        assert conn.batch_get(["B"], pages.pages[1:]) == [False]
        assert conn.stats()["ops"]["get"]["failed"] == {"corrupt": 1}


def test_delete_frees_own_slots_without_evicting(tmp_path: Path) -> None:
    store = _store(tmp_path, 4)
    try:
        _set(store, ["a", "b", "c", "d"])
        assert store.delete(["b", "x"]) == [True, False]
        _set(store, ["e"])  # the freed slot: nothing evicted
        assert store.evictions == 0
        assert store.contains(["a", "b", "c", "d", "e"]) == [True, False, True, True, True]
    finally:
        store.close()


def test_compaction_copies_the_live_puts_and_clear_finds_every_key(tmp_path: Path) -> None:
    store, other = _store(tmp_path, 64), _store(tmp_path, 64)
    try:
        _set(store, [f"k{i}" for i in range(10)])
        _set(other, ["o0", "o1"])
        assert store.delete(["k1", "k2", "o0"]) == [True] * 3
        _set(store, ["k1"])  # a newer page of k1: the old PUT is not live
        store.compact()
        records = store.index.tails[store.me].offset  # type: ignore[index]
        assert records > 0
        fresh = _store(tmp_path, 64)  # replays the compacted log (its checkpoint names it)
        try:
            expect = [i != 2 for i in range(10)]
            assert fresh.contains([f"k{i}" for i in range(10)]) == expect
            assert fresh.contains(["o0", "o1"]) == [False, True]  # the foreign DEL was kept
        finally:
            fresh.close()
        assert other.clear() == 10  # 9 of store's keys and o1, read from the logs
        assert store.contains(["k0", "k1", "o1"]) == [False] * 3
        assert len(store.index) == 0
    finally:
        other.close()
        store.close()


def test_lookups_without_the_lock_while_a_writer_grows_and_evicts(tmp_path: Path) -> None:
    """``contains`` reads the C table without the index lock (each table call holds the
    GIL, as the dict operations did): readers racing a writer whose table grows
    (rehashes) and evicts see whole answers, and every committed key is found after."""
    import threading

    store = _store(tmp_path, 3000, per_slab=1024)
    stop = threading.Event()
    errors: list[BaseException] = []
    early = [f"e{i}" for i in range(200)]
    _set(store, early)

    def read() -> None:
        try:
            while not stop.is_set():
                got = store.index.contains(early)
                assert len(got) == len(early)
                for entry in store.index.table.get_many([digest(k) for k in early[:20]]):
                    assert entry is None or entry.length == 64
        except BaseException as exc:  # reported below
            errors.append(exc)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        keys = [f"k{i}" for i in range(6000)]  # past the capacity: evictions too
        for lo in range(0, len(keys), 128):
            _set(store, keys[lo : lo + 128])
    finally:
        stop.set()
        for t in readers:
            t.join(30)
    try:
        assert not errors, errors
        assert store.contains(keys[-2800:]) == [True] * 2800
        assert store.evictions > 0
    finally:
        store.close()


def test_the_index_table_expects_the_store_capacity(tmp_path: Path) -> None:
    """A store's index table expects its slots (a shared store's, every writer's): filled
    to them, it is sized for them (load 0.8); without a capacity it grows as it goes."""
    from hicache_l3.slab.shared import SharedSlabStore
    from hicache_l3.slab.table import new_table

    for name in "abc":
        (tmp_path / name).mkdir()
    store = _store(tmp_path / "a", 5000)
    shared = SharedSlabStore(tmp_path / "b", NS, 64, max_writers=3,
                             capacity_bytes=5000 * Geometry(64).stride, node="n1")
    plain = SlabStore(tmp_path / "c", NS, 64)
    try:
        assert store.index.capacity == 5000 and shared.index.capacity == 15000
        assert plain.index.capacity is None
        keys = [f"k{i}" for i in range(5000)]
        _set(store, keys)
        full = new_table()
        full.reserve(5000)
        assert store.index.table.nbytes == full.nbytes and len(store.index.table) == 5000
    finally:
        for s in (store, shared, plain):
            s.close()
