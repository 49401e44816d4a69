"""The compaction a commit starts (hicache_l3/slab/compaction.py) runs off the caller's
thread: the commit that starts it, and those that follow, do not wait for it, and what they
logged meanwhile is in the log it leaves. (What that log replays to, for any history, is
tests/slab/test_slab_checkpoint.py's.)"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.slab import compaction, store
from hicache_l3.slab.files import SlabFiles
from hicache_l3.slab.format import Geometry
from hicache_l3.slab.index import SlabIndex
from hicache_l3.slab.store import SlabStore

NS = Namespace(model="compaction-test", kv_dtype="uint8", layout="page_first", page_size=64, tag="t")
SLOT = 64


def _set(s: SlabStore, keys: list[str]) -> None:
    plan = s.reserve_new(keys)
    s.commit([keys[i] for i in plan.todo], plan.slots, [9] * len(plan.slots))


def test_commits_go_on_while_the_log_is_compacted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "COMPACT_MIN_BYTES", 8 << 10)
    entered, release = threading.Event(), threading.Event()
    build = compaction.LogCompaction.build

    def held_build(job: compaction.LogCompaction) -> bool:
        entered.set()
        assert release.wait(30), "the test never released the compaction"
        return build(job)

    monkeypatch.setattr(compaction.LogCompaction, "build", held_build)
    s = SlabStore(tmp_path, NS, SLOT, capacity_bytes=32 * Geometry(SLOT).stride)
    try:
        n = 0
        while not entered.is_set():  # sets under eviction until a commit starts a compaction
            assert n < 10_000, "no compaction started"
            _set(s, [f"k{n}-{i}" for i in range(8)])
            n += 1
        assert s.compacting() and s.compactions == 0
        ino = os.fstat(s._log_fd).st_ino
        for r in range(n, n + 20):  # not blocked by the compaction held in its step 2
            _set(s, [f"k{r}-{i}" for i in range(8)])
        assert s.compactions == 0 and os.fstat(s._log_fd).st_ino == ino
        release.set()
        s.wait_compaction(30)
        assert not s.compacting()
        assert s.compactions >= 1 and os.fstat(s._log_fd).st_ino != ino
        size = os.fstat(s._log_fd).st_size
        assert size == s.index.tails[s.me].offset  # type: ignore[index]
        # the log left replays to what the writer holds, the sets made meanwhile included
        fresh = SlabIndex(s.writers_dir, SlabFiles(s.writers_dir))
        fresh.checkpoints.loaded = True  # the logs only, no checkpoint
        with fresh.lock:
            fresh.refresh()
        live = dict(s.index.table.select())
        live.update(s.index.unlogged)
        assert live == dict(fresh.table.select())
        assert {f"k{n + 19}-{i}" for i in range(8)} <= set(fresh.live_keys())
        for tail in fresh.tails.values():
            os.close(tail.fd)
        fresh.files.close()
        assert not list(s.writers_dir.glob("*/index.log.compact-*"))
    finally:
        release.set()
        s.close()
