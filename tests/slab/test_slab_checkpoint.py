"""The index checkpoint (hicache_l3/slab/checkpoint.py): a fresh index that loads it and
reads only the log tails since must equal a fresh index that replays every log from its
start (the oracle), for any history of sets, aborted sets (evictions without a rewrite),
deletes across writers, pages found unreadable, compactions, checkpoints, restarts and
crashed writers; a torn, damaged or planted checkpoint is ignored (full replay)."""

from __future__ import annotations

import array
import contextlib
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_l3.common.keys import Namespace
from hicache_l3.slab import checkpoint
from hicache_l3.slab.compaction import LogCompaction
from hicache_l3.slab.files import SlabFiles
from hicache_l3.slab.format import RECORD, Entry, Geometry
from hicache_l3.slab.index import SlabIndex
from hicache_l3.slab.index_checkpoint import IndexCheckpoints
from hicache_l3.slab.store import SlabStore
from hicache_l3.slab.table import digest

NS = Namespace(model="ckpt-test", kv_dtype="uint8", layout="page_first", page_size=64, tag="t")
SLOT = 64
WRITERS = 3
KEYS = 12  # per writer: keys of different writers never overlap (see fresh_indexes)


def open_store(root: Path, slots: int = 6) -> SlabStore:
    """A store whose writer holds ``slots`` pages (evicting beyond)."""
    stride = Geometry(SLOT).stride
    return SlabStore(root, NS, SLOT, capacity_bytes=slots * stride, slab_bytes=3 * stride)


def fresh_indexes(store: SlabStore) -> tuple[SlabIndex, SlabIndex]:
    """(oracle, candidate): the first replays every log from its start (no checkpoint),
    the second loads the checkpoint and reads the tails."""
    wdir = store.writers_dir
    oracle = SlabIndex(wdir, SlabFiles(wdir))
    oracle.checkpoints.loaded = True  # never look for the checkpoint
    candidate = SlabIndex(wdir, SlabFiles(wdir))
    with oracle.lock:
        oracle.refresh()
    with candidate.lock:
        candidate.refresh()
    return oracle, candidate


def view(index: SlabIndex) -> dict[str, Any]:
    """What must agree: entries (by key digest), the slot inverse, each log's generation
    and foreign DELs."""
    return {
        "entries": dict(index.table.select()),
        "slot_key": dict(index.table.slot_items()),
        "max_gen": {w: t.max_gen for w, t in index.tails.items()},
        "foreign": {w: list(t.foreign_dels) for w, t in index.tails.items() if t.foreign_dels},
    }


def close_index(index: SlabIndex) -> None:
    for tail in index.tails.values():
        os.close(tail.fd)
    index.files.close()


@contextlib.contextmanager
def indexes(store: SlabStore) -> Iterator[tuple[SlabIndex, SlabIndex]]:
    oracle, candidate = fresh_indexes(store)
    try:
        yield oracle, candidate
    finally:
        close_index(oracle)
        close_index(candidate)


def crash(store: SlabStore, torn: bytes) -> None:
    """Die like kill -9 mid-append: ``torn`` bytes of a record at the log's end, every
    descriptor closed (the flock goes with them), no checkpoint written."""
    if store.me is not None and torn:
        os.write(store._log_fd, torn)
    store._closed = True
    fds = [t.fd for t in store.index.tails.values()] + [store._log_fd, store._lock_fd]
    store.files.close()
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


OPS = st.one_of(
    st.tuples(st.just("set"), st.integers(0, WRITERS - 1), st.lists(st.integers(0, KEYS - 1), max_size=5)),
    st.tuples(st.just("abort"), st.integers(0, WRITERS - 1), st.lists(st.integers(0, KEYS - 1), max_size=3)),
    st.tuples(st.just("delete"), st.integers(0, WRITERS - 1),
              st.lists(st.tuples(st.integers(0, WRITERS - 1), st.integers(0, KEYS - 1)), max_size=3)),
    st.tuples(st.just("drop"), st.integers(0, WRITERS - 1),
              st.tuples(st.integers(0, WRITERS - 1), st.integers(0, KEYS - 1))),
    st.tuples(st.just("compact"), st.integers(0, WRITERS - 1), st.none()),
    # a compaction off the lock (slab/compaction.py): steps 1 and 2 now, step 3 at its
    # "bg_end", with whatever ops come between (the history's end finishes it)
    st.tuples(st.just("bg"), st.integers(0, WRITERS - 1), st.none()),
    st.tuples(st.just("bg_end"), st.integers(0, WRITERS - 1), st.none()),
    st.tuples(st.just("checkpoint"), st.integers(0, WRITERS - 1), st.none()),
    st.tuples(st.just("later"), st.integers(0, WRITERS - 1), st.none()),
    st.tuples(st.just("rebase"), st.integers(0, WRITERS - 1), st.none()),
    st.tuples(st.just("restart"), st.integers(0, WRITERS - 1), st.none()),
    st.tuples(st.just("crash"), st.integers(0, WRITERS - 1), st.integers(0, RECORD.size + 4)),
)


def key(owner: int, i: int) -> str:
    return f"w{owner}-k{i}"


def run_history(root: Path, ops: list[tuple[str, int, Any]]) -> list[SlabStore]:
    """Apply ``ops`` to ``WRITERS`` stores (each its own writer directory once it writes;
    store i sets only keys ``w{i}-*``); the live stores."""
    stores = [open_store(root) for _ in range(WRITERS)]
    for store in stores:
        store._become_writer()
    jobs: dict[int, tuple[SlabStore, LogCompaction, bool]] = {}  # background compactions begun

    def finish(who: int) -> None:
        owner, job, built = jobs.pop(who)
        with owner._lock:
            owner._compaction_finish(job, built)

    for op, who, arg in ops:
        store = stores[who]
        if op == "set":
            keys = [key(who, i) for i in arg]
            plan = store.reserve_new(keys)
            store.commit([keys[i] for i in plan.todo], plan.slots, [7] * len(plan.slots))
        elif op == "abort":
            plan = store.reserve_new([key(who, i) for i in arg])
            store.abort(plan.slots)
        elif op == "delete":
            store.delete([key(owner, i) for owner, i in arg])
        elif op == "drop":
            k = key(*arg)
            store.refresh()
            entry = store.index.entry(k)
            if entry is not None:
                store.invalidate(k, entry)
        elif op == "compact":
            store.compact()
        elif op == "bg" and who not in jobs and store.me is not None:
            with store._lock:
                job = store._compaction_start(store.me, store.index.tails[store.me])
            if job is not None:  # (None: the dict table, which compacts under the lock)
                jobs[who] = (store, job, job.build())
        elif op == "bg_end" and who in jobs:
            finish(who)
        elif op == "checkpoint":
            store.refresh()
            with store._lock:
                assert store.index.checkpoints.save()
        elif op == "later":  # a background write, racing with the ops that follow
            store.refresh()
            with store._lock:
                store.index.checkpoints.save_later()
        elif op == "rebase":  # onto whichever checkpoint is there now (its pages unchanged)
            with store._lock:
                store.index.checkpoints.rebase_on_newer()
        elif op == "restart":
            store.close()
            stores[who] = open_store(root)
            stores[who]._become_writer()
        elif op == "crash":
            crash(store, os.urandom(arg))
            stores[who] = open_store(root)
            stores[who]._become_writer()  # adopts the crashed directory: sets its tail aside
    for who in list(jobs):
        finish(who)
    return stores


@contextlib.contextmanager
def table_kind(kind: str) -> Iterator[None]:
    """Indexes built meanwhile use the C page table ("native"; "deferred": every journal
    catch-up is applied off the lock first) or the dict fallback."""
    from hicache_l3.slab import index as index_module
    from hicache_l3.slab import index_checkpoint
    from tests.reference.dict_table import DictPageTable

    if kind == "native":
        yield
        return
    if kind == "deferred":
        with mock.patch.object(index_checkpoint, "JOURNAL_ON_LOCK", 0):
            yield
        return
    with mock.patch.object(index_module, "new_table", lambda capacity=None: DictPageTable()), \
            mock.patch.object(index_checkpoint, "new_table", lambda capacity=None: DictPageTable()):
        yield


@pytest.mark.parametrize("kind", ["native", "deferred", "dict"])
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, max_size=40), background=st.booleans())
def test_checkpoint_plus_tail_equals_full_replay(kind: str, ops: list[tuple[str, int, Any]],
                                                 background: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp, table_kind(kind):
        root = Path(tmp)
        stores = run_history(root, ops)
        try:
            # a checkpoint written now, then more records after it: the tail since
            stores[0].refresh()
            with stores[0]._lock:
                if background:  # its copy is taken now; the write may end at any time
                    stores[0].index.checkpoints.save_later()
                else:
                    assert stores[0].index.checkpoints.save()
            for who, store in enumerate(stores):
                keys = [key(who, i) for i in range(3)]
                plan = store.reserve_new(keys)
                store.commit([keys[i] for i in plan.todo], plan.slots, [1] * len(plan.slots))
            stores[1].delete([key(0, 0), key(2, 1)])
            with indexes(stores[0]) as (oracle, candidate):
                assert candidate.applied <= oracle.applied
                assert view(candidate) == view(oracle)
            for store in stores:  # the live writers agree with a replay too
                store.refresh()
            with indexes(stores[0]) as (oracle, _):
                for store in stores:
                    live = dict(store.index.table.select())
                    live.update(store.index.unlogged)
                    assert live == dict(oracle.table.select())
        finally:
            for store in stores:
                store.close()
        # closing wrote a checkpoint: a fresh process needs no record from the logs
        reopened = open_store(root)
        try:
            with indexes(reopened) as (oracle, candidate):
                assert view(candidate) == view(oracle)
                assert candidate.applied == 0
        finally:
            reopened.close()


def filled(root: Path) -> SlabStore:
    store = open_store(root, slots=64)
    keys = [key(0, i) for i in range(20)]
    plan = store.reserve_new(keys)
    store.commit(keys, plan.slots, [3] * len(keys))
    store.refresh()
    with store._lock:
        assert store.index.checkpoints.save()
    return store


@pytest.mark.parametrize("damage", ["truncate", "flip", "image flip", "no image", "symlink",
                                    "directory", "version"])
def test_unusable_checkpoint_is_ignored(tmp_path: Path, damage: str,
                                        caplog: pytest.LogCaptureFixture) -> None:
    store = filled(tmp_path)
    path = store.directory / checkpoint.CHECKPOINT_FILE
    data = path.read_bytes()
    path.unlink()
    if damage == "truncate":
        path.write_bytes(data[: len(data) - 7])
    elif damage == "flip":
        path.write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    elif damage == "image flip":  # the mapped table image (version 3): its hash catches it
        assert data[8] == checkpoint.VERSION
        path.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    elif damage == "no image":
        path.write_bytes(data[: checkpoint.IMAGE_ALIGN])
    elif damage == "symlink":
        (tmp_path / "elsewhere").write_bytes(data)
        path.symlink_to(tmp_path / "elsewhere")
    elif damage == "directory":
        path.mkdir()
    else:
        path.write_bytes(data[:8] + (1).to_bytes(4, "little") + data[12:])  # keys, not digests
    try:
        with indexes(store) as (oracle, candidate):
            assert view(candidate) == view(oracle)
            assert candidate.applied == oracle.applied == 20  # replayed from the start
        assert "ignored, the logs are replayed" in caplog.text
    finally:
        store.close()


@pytest.mark.parametrize("damage", ["two pages in one slot", "writer out of range"])
def test_checkpoint_whose_pages_do_not_load_is_ignored(tmp_path: Path, damage: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Whole (CRC right) but not a replay's state: the logs are replayed instead."""
    store = filled(tmp_path)
    path = store.directory / checkpoint.CHECKPOINT_FILE
    state = checkpoint.decode(path.read_bytes())
    if damage == "two pages in one slot":
        state.values[6:9] = state.values[0:3]
    else:
        state.values[0] = 2**32 - 1
    data = checkpoint.encode(state)
    assert data is not None
    path.write_bytes(data)
    try:
        with indexes(store) as (oracle, candidate):
            assert view(candidate) == view(oracle)
            assert candidate.applied == oracle.applied == 20  # replayed from the start
        assert "index checkpoint ignored, the logs are replayed" in caplog.text
    finally:
        store.close()


def test_checkpoint_is_private_and_atomic(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = filled(tmp_path)
    finally:
        os.umask(old)
    try:
        path = store.directory / checkpoint.CHECKPOINT_FILE
        assert path.stat().st_mode & 0o777 == 0o600
        assert [p.name for p in store.directory.iterdir() if p.name.endswith(".tmp")] == []
    finally:
        store.close()


def test_compacted_log_is_read_again_from_its_start(tmp_path: Path) -> None:
    """A checkpoint names a log that was compacted since: its entries are dropped and
    the new log is read from the start (the other logs resume at their marks)."""
    store = filled(tmp_path)
    other = open_store(tmp_path, slots=64)
    try:
        keys = [key(1, i) for i in range(5)]
        plan = other.reserve_new(keys)
        other.commit(keys, plan.slots, [2] * 5)
        store.refresh()
        with store._lock:
            assert store.index.checkpoints.save()
        other.delete(keys[:2])
        ckpt = (store.directory / checkpoint.CHECKPOINT_FILE).read_bytes()
        other.compact()  # writes its own checkpoint: put the older one back
        (store.directory / checkpoint.CHECKPOINT_FILE).write_bytes(ckpt)
        with indexes(store) as (oracle, candidate):
            assert view(candidate) == view(oracle)
            assert [candidate.entry(k) is not None for k in keys] == [False] * 2 + [True] * 3
    finally:
        other.close()
        store.close()


def test_key_with_nul_writes_no_checkpoint_while_a_foreign_del_holds_it(tmp_path: Path) -> None:
    """The checkpoint holds digests, not keys, except the keys of DELs for other writers'
    slots (NUL-separated): a stored key with a NUL is fine, a foreign DEL of one is not."""
    store, other = open_store(tmp_path), open_store(tmp_path)
    try:
        keys = ["plain", "nul\0inside"]
        plan = store.reserve_new(keys)
        store.commit(keys, plan.slots, [0, 0])
        with store._lock:
            assert store.index.checkpoints.save()
        (store.directory / checkpoint.CHECKPOINT_FILE).unlink()
        assert other.delete(["nul\0inside"]) == [True]
        with other._lock:
            assert not other.index.checkpoints.save()
        assert not (store.directory / checkpoint.CHECKPOINT_FILE).exists()
    finally:
        other.close()
        store.close()


def test_encode_decode_round_trip() -> None:
    entries = {"a": Entry(0, 1, 2, 3, 4, 5), "": Entry(1, 0, 0, 9, 64, 0),
               "é": Entry(2, 3, 4, 5, 6, 2**64 - 1)}
    values = array.array("Q", [f for e in entries.values() for f in e])
    dels = [("x", Entry(1, 0, 1, 2, 3, 4)), ("é", Entry(1, 0, 2, 2, 3, 4))]
    marks = [checkpoint.LogMark(0, 11, 100, 3, 5, 6, dels),
             checkpoint.LogMark(1, 12, 0, 0, 0, 0, [])]
    state = checkpoint.IndexState(b"".join(map(digest, entries)), values, {(1, 0, 1): 2}, marks)
    data = checkpoint.encode(state)
    assert data is not None
    assert checkpoint.decode(data) == state
    empty = checkpoint.IndexState(b"", array.array("Q"), {}, [])
    data = checkpoint.encode(empty)
    assert data is not None and checkpoint.decode(data) == empty


def test_crashed_writers_temporary_files_are_removed(tmp_path: Path) -> None:
    store = filled(tmp_path)
    try:
        stale = store.directory / ".index.ckpt.999999.1.tmp"
        young = store.directory / ".index.ckpt.999998.1.tmp"
        stale.write_bytes(b"x")
        young.write_bytes(b"y")
        os.utime(stale, (1, 1))
        with store._lock:
            assert store.index.checkpoints.save()
        assert not stale.exists() and young.exists()
    finally:
        store.close()


def test_writer_checkpoints_when_due_and_on_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After enough records a writer starts a background checkpoint by itself; a fresh
    process then replays only what came after it; close writes the rest."""
    from hicache_l3.slab import index_checkpoint

    monkeypatch.setattr(index_checkpoint, "CHECKPOINT_MIN_RECORDS", 8)
    store = open_store(tmp_path, slots=64)
    try:
        for lo in range(0, 12, 4):  # 4, 8 (due: a checkpoint of 8 pages), 12
            keys = [key(0, i) for i in range(lo, lo + 4)]
            plan = store.reserve_new(keys)
            store.commit(keys, plan.slots, [5] * 4)
            store.index.checkpoints.wait()
        with indexes(store) as (oracle, candidate):
            assert view(candidate) == view(oracle)
            assert candidate.checkpoints.pages == 8 and candidate.replayed == 4
    finally:
        store.close()
    reopened = open_store(tmp_path)
    try:
        assert reopened.contains([key(0, i) for i in range(12)]) == [True] * 12
        assert reopened.stats()["index_checkpoint_pages"] == 12
        assert reopened.stats()["index_replayed_records"] == 0
    finally:
        reopened.close()


def test_a_long_journal_is_caught_up_off_the_lock_then_adopted(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A background checkpoint's table catches up with a journal longer than
    JOURNAL_ON_LOCK on a thread (the live table answers meanwhile), the rest under the
    lock at the next refresh, and replaces the live table: its pages are exactly a full
    replay's, mostly in the shared base."""
    from hicache_l3.slab import index_checkpoint

    monkeypatch.setattr(index_checkpoint, "JOURNAL_ON_LOCK", 8)
    go = threading.Event()
    write_state = IndexCheckpoints._write_state

    def held_write_state(self: IndexCheckpoints, *args: Any) -> None:
        go.wait(30)  # (until the records below are journaled)
        write_state(self, *args)

    monkeypatch.setattr(IndexCheckpoints, "_write_state", held_write_state)
    store = open_store(tmp_path, slots=256)
    try:
        keys = [key(0, i) for i in range(40)]
        plan = store.reserve_new(keys)
        store.commit(keys, plan.slots, [5] * len(keys))
        index = store.index
        with store._lock:
            index.checkpoints.save_later()
        thread = index.checkpoints._saver
        assert thread is not None and index.checkpoints.busy()  # (held: writing)
        rebases = index.checkpoints.rebases
        def write(lo: int, hi: int) -> None:  # journaled: the table made from the image lacks them
            more = [key(0, i) for i in range(lo, hi)]
            plan = store.reserve_new(more)
            store.commit(more, plan.slots, [6] * len(more))

        write(40, 100)
        store.delete([key(0, 3)])
        go.set()
        index.checkpoints.wait()
        store.refresh()  # 61 records: handed to a catch-up thread
        assert index.checkpoints._saver is not thread and index.checkpoints._saver is not None
        assert index.checkpoints._saver.name == "hicache-index-catch-up"
        assert index.checkpoints.rebases == rebases
        assert index.checkpoints.busy()  # (catching up, or caught up and waiting for a refresh to adopt it)
        write(100, 104)  # (the journal goes on meanwhile)
        assert store.contains([key(0, 3), key(0, 99), key(0, 103)]) == [False, True, True]
        index.checkpoints.wait()
        store.refresh()  # the rest of the journal, under the lock: adopted
        assert index.checkpoints.rebases == rebases + 1 and not index.checkpoints.busy()
        table = index.table
        assert table.shared_nbytes > 0 and table.delta_len < len(table) and table.check() == 0
        with indexes(store) as (oracle, _):
            live = dict(table.select())
            live.update(index.unlogged)
            assert live == dict(oracle.table.select())
    finally:
        store.close()


def test_multi_node_takeover_keeps_checkpoint_exact(tmp_path: Path) -> None:
    """hf3fs mode (claims and leases, two simulated nodes): node A writes, checkpoints,
    writes more and dies mid-append; node B takes the directory over once A's lease
    expires (new epoch, A's torn tail set aside) and rewrites slots. A fresh process that
    loads A's checkpoint and reads the tail equals a full replay."""
    from hicache_l3.slab.shared import SharedSlabStore

    def node(name: str) -> SharedSlabStore:
        return SharedSlabStore(tmp_path, NS, SLOT, node=name, lease_s=0.4, max_writers=1,
                               capacity_bytes=6 * 8192, slab_bytes=3 * 8192)

    a = node("A")
    keys = [key(0, i) for i in range(8)]
    plan = a.reserve_new(keys[:4])
    a.commit(keys[:4], plan.slots, [1] * 4)
    with a._lock:
        assert a.index.checkpoints.save()
    plan = a.reserve_new(keys[4:6])
    a.commit(keys[4:6], plan.slots, [1] * 2)
    a._stop.set()  # A dies: no more heartbeats, a torn record, descriptors gone
    if a._heart is not None:
        a._heart.join(5)
    crash(a, b"\x01" * (RECORD.size - 3))
    b = node("B")
    try:
        plan = b.reserve_new(keys[6:])  # waits for A's lease, takes epoch 2, evicts
        b.commit(keys[6:], plan.slots, [2] * 2)
        assert b.stats()["takeovers"] == 1
        with indexes(b) as (oracle, candidate):
            assert candidate.checkpoints.pages == 4 and candidate.replayed > 0
            assert view(candidate) == view(oracle)
            assert candidate.tails[0].max_gen >> 40 == 2  # the new epoch's generations
    finally:
        b.close()
    reopened = node("C")
    try:
        with indexes(reopened) as (oracle, candidate):
            assert view(candidate) == view(oracle) and candidate.replayed == 0
    finally:
        reopened.close()


CHILD = r"""
import os, sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_slab_checkpoint import key, open_store
from hicache_l3.slab import checkpoint

store = open_store(Path({root!r}), slots=64)
keys = [key(0, i) for i in range(20, 40)]
plan = store.reserve_new(keys)
store.commit(keys, plan.slots, [9] * len(keys))
def stall(*args):  # the temporary file is (partly) written, not renamed: be killed here
    print("writing", flush=True)
    time.sleep(60)
{hook} = stall
with store._lock:
    store.index.checkpoints.save()
"""


@pytest.mark.parametrize("hook", ["checkpoint.os.fsync", "checkpoint.image_hash"])
def test_writer_killed_mid_checkpoint_leaves_the_old_one(tmp_path: Path, hook: str) -> None:
    """kill -9 while a checkpoint is being written (its table image written but not the
    header naming it, or all of it but not synced and renamed): the previous checkpoint
    stays whole and in use; the records after it are replayed; the result equals a full
    replay: no page of the half-written file is ever visible."""
    import signal
    import subprocess
    import sys

    first = filled(tmp_path)  # 20 pages, checkpointed
    path = first.directory / checkpoint.CHECKPOINT_FILE
    before = path.read_bytes()
    first.close()  # nothing new since its checkpoint: close writes none
    assert path.read_bytes() == before
    code = CHILD.format(tests=str(Path(__file__).parent), root=str(tmp_path), hook=hook)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout is not None and child.stdout.readline() == "writing\n"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    assert path.read_bytes() == before  # the old one, whole
    assert [p.name for p in first.directory.iterdir() if p.name.endswith(".tmp")]  # left over
    reader = open_store(tmp_path)
    try:
        with indexes(reader) as (oracle, candidate):
            assert view(candidate) == view(oracle)
            assert candidate.checkpoints.pages == 20 and candidate.replayed == 20
            assert len(candidate) == 40
    finally:
        reader.close()


def _decode_reference(data: bytes) -> tuple[list[Any], int, int]:
    """decode_records as it was before its fast path: _record_at at every position."""
    from hicache_l3.slab.format import _record_at

    out, pos, n, skipped = [], 0, len(data), 0
    while pos < n:
        record = _record_at(data, pos)
        if record is None:
            nxt = pos + 1
            while nxt < n and _record_at(data, nxt) is None:
                nxt += 1
            if nxt >= n:
                break
            skipped += nxt - pos
            pos = nxt
            continue
        out.append(record)
        pos += RECORD.size + len(record.key.encode())
    return out, pos, skipped


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.one_of(
    st.tuples(st.sampled_from([1, 2, 3]), st.text(max_size=6),
              st.tuples(*[st.integers(0, 2**32 - 1)] * 3, *[st.integers(0, 2**64 - 1)] * 3)),
    st.binary(max_size=40)), max_size=12))
def test_decode_fast_path_matches_the_reference(parts: list[Any]) -> None:
    """The inlined fast path of decode_records decodes exactly what _record_at-by-
    position decodes (records, bytes consumed, bytes skipped), damage and torn tails
    included."""
    from hicache_l3.slab.format import decode_records, encode_record

    chunks = []
    for part in parts:
        if isinstance(part, bytes):
            chunks.append(part)
        else:
            kind, k, fields = part
            chunks.append(encode_record(kind, k, Entry(*fields)))
    data = b"".join(chunks)
    assert decode_records(data) == _decode_reference(data)
    for cut in (len(data) // 2, len(data) - 1):  # torn
        assert decode_records(data[:cut]) == _decode_reference(data[:cut])


@pytest.mark.parametrize("chunk", [50, 200, 1 << 20])
def test_a_log_read_in_chunks_equals_one_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              chunk: int) -> None:
    """Logs are decoded TAIL_CHUNK bytes at a time: records cut by a chunk's end, a
    damaged record, a chunk holding no whole record and a torn tail give what one read
    of the whole log gives."""
    from hicache_l3.slab import log_follow

    store = open_store(tmp_path, slots=64)
    try:
        keys = [key(0, i) for i in range(30)]
        plan = store.reserve_new(keys)
        store.commit(keys, plan.slots, [3] * len(keys))
        store.delete(keys[5:8])
        log_path = store.writers_dir / "w0000" / "index.log"
        size = log_path.stat().st_size
        fd = os.open(log_path, os.O_WRONLY)
        try:
            os.pwrite(fd, b"\xff\xfe", size // 2)  # a damaged record mid-log
            os.pwrite(fd, b"\x01" * 20, size)  # and a torn tail
        finally:
            os.close(fd)
        wdir = store.writers_dir
        whole = SlabIndex(wdir, SlabFiles(wdir))
        whole.checkpoints.loaded = True
        with whole.lock:
            whole.refresh()
        monkeypatch.setattr(log_follow, "TAIL_CHUNK", chunk)
        chunked = SlabIndex(wdir, SlabFiles(wdir))
        chunked.checkpoints.loaded = True
        try:
            with chunked.lock:
                chunked.refresh()
            assert view(chunked) == view(whole) and len(whole) >= 25
            assert chunked.tails[0].offset == whole.tails[0].offset == size
        finally:
            close_index(whole)
            close_index(chunked)
    finally:
        store.close()


def _set(store: SlabStore, keys: list[str]) -> None:
    plan = store.reserve_new(keys)
    store.commit([keys[i] for i in plan.todo], plan.slots, [5] * len(plan.slots))


def test_background_compaction_keeps_what_changed_meanwhile(tmp_path: Path) -> None:
    """A compaction off the lock (slab/compaction.py) judges the log against the table as
    it was at its start and copies what was logged since: the log it leaves replays to
    this writer's view, with the pages evicted meanwhile (still in the log: unlogged), and
    the DELs for another writer's pages from before and after its start."""
    a, b = open_store(tmp_path), open_store(tmp_path, slots=64)
    try:
        _set(b, [key(1, 0), key(1, 1)])
        a.refresh()
        assert a.delete([key(1, 0)]) == [True]  # a foreign DEL before the start
        _set(a, [key(0, i) for i in range(6)])  # a is full: 6 slots
        with a._lock:
            me = a.me
            assert me is not None
            tail = a.index.tails[me]
            before = tail.ino, tail.offset
            job = a._compaction_start(me, tail)
        assert job is not None
        built = job.build()
        assert built
        # meanwhile: evictions left unlogged (an aborted set), evictions rewritten, a delete
        # of an own page and of another writer's
        a.abort(a.reserve_new([key(0, 6), key(0, 7)]).slots)
        _set(a, [key(0, 8)])
        assert a.delete([key(0, 5), key(1, 1)]) == [True, True]
        assert a.index.unlogged_of(me), "the aborted set left evicted pages unlogged"
        with a._lock:
            a._compaction_finish(job, built)
            tail = a.index.tails[me]
            assert tail.ino != before[0] and a.compactions == 1
            assert os.fstat(a._log_fd).st_size == tail.offset
        assert not job.tmp.exists()
        _set(a, [key(0, 9)])  # appends after the compacted log's end
        with indexes(a) as (oracle, _):
            for store in (a, b):
                store.refresh()
                live = dict(store.index.table.select())
                live.update(store.index.unlogged)
                assert live == dict(oracle.table.select())
            assert oracle.tails[me].foreign_dels == a.index.tails[me].foreign_dels
            assert {k for k, _ in oracle.tails[me].foreign_dels} == {key(1, 0), key(1, 1)}
    finally:
        a.close()
        b.close()


def test_background_compaction_gives_up_after_a_compaction_or_close(tmp_path: Path) -> None:
    """A compaction off the lock whose log was compacted since, or whose store closed,
    changes nothing and leaves no temporary file."""
    for interrupt in ("compact", "close"):
        root = tmp_path / interrupt
        root.mkdir()
        store = open_store(root)
        try:
            _set(store, [key(0, i) for i in range(6)])
            _set(store, [key(0, i) for i in range(6, 12)])
            with store._lock:
                assert store.me is not None
                job = store._compaction_start(store.me, store.index.tails[store.me])
            assert job is not None and job.build() and job.tmp.exists()
            if interrupt == "compact":
                store.compact()
            else:
                store.close()
            compactions = store.compactions
            with store._lock:
                store._compaction_finish(job, True)
            assert store.compactions == compactions
            assert not job.tmp.exists()
        finally:
            store.close()


def test_background_compaction_renames_only_under_a_valid_lease(tmp_path: Path) -> None:
    """hf3fs mode: a compaction that began while the lease held does not rename its log
    over the writer's once the lease lapsed (another node may own the directory and
    append to that log by then): the log, and the index, stay as they were."""
    from hicache_l3.slab.shared import SharedSlabStore

    a = SharedSlabStore(tmp_path, NS, SLOT, node="A", lease_s=0.4, max_writers=1,
                        capacity_bytes=6 * Geometry(SLOT).stride, slab_bytes=3 * Geometry(SLOT).stride)
    try:
        for i in range(0, 12, 3):
            _set(a, [key(0, j) for j in range(i, i + 3)])
        with a._lock:
            assert a.me is not None
            tail = a.index.tails[a.me]
            before = tail.ino, tail.offset, os.fstat(a._log_fd).st_ino
            job = a._compaction_start(a.me, tail)
        assert job is not None and job.build()
        assert a.lease is not None
        a.lease.lost = True  # the heartbeat failed meanwhile
        with a._lock:
            a._compaction_finish(job, True)
            assert (tail.ino, tail.offset, os.fstat(a._log_fd).st_ino) == before
            assert a.compactions == 0
        assert not job.tmp.exists()
        a.lease.lost = False
    finally:
        a.close()
