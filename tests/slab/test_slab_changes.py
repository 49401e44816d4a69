"""The namespace's change file (hicache_l3/slab/changes.py): a store looks at the other
writers' logs only when the file says something was published, sees every change another
store publishes on its next call, and never trusts the file beyond FULL_LOOK_S or where it
cannot be used (a planted link, a directory, a store shared by several machines)."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.slab import changes
from hicache_l3.slab.changes import CHANGES_FILE, ChangeFile
from hicache_l3.slab.format import namespace_dir
from hicache_l3.slab.log_follow import LogFollower
from hicache_l3.slab.shared import SharedSlabStore
from hicache_l3.slab.store import SlabStore

NS = Namespace(model="changes-test", kv_dtype="uint8", layout="page_first", page_size=64, tag="c")
SLOT = 64


def _set(s: SlabStore, keys: list[str]) -> None:
    plan = s.reserve_new(keys)
    s.commit([keys[i] for i in plan.todo], plan.slots, [0] * len(plan.slots))


class Looks:
    """Counts the looks each index takes at the logs (LogFollower._look_at_logs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count: dict[int, int] = {}
        look = LogFollower._look_at_logs

        def counted(logs: LogFollower) -> bool:
            self.count[id(logs)] = self.count.get(id(logs), 0) + 1
            return look(logs)

        monkeypatch.setattr(LogFollower, "_look_at_logs", counted)

    def of(self, s: SlabStore) -> int:
        return self.count.get(id(s.index.logs), 0)


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[SlabStore, SlabStore]]:
    a, b = SlabStore(tmp_path, NS, SLOT), SlabStore(tmp_path, NS, SLOT)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def test_a_store_looks_at_the_logs_only_after_another_published(
        two: tuple[SlabStore, SlabStore], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = two
    looks = Looks(monkeypatch)
    _set(a, ["a0", "a1"])
    _set(b, ["b0"])  # both writer directories exist now
    assert b.contains(["a0", "a1", "b0"]) == [True, True, True]
    seen = looks.of(b)
    for _ in range(5):  # nothing published since: no look
        assert b.contains(["a0"]) == [True]
    _set(b, ["b1"])  # its own commit does not make it look again
    assert b.contains(["b1"]) == [True]
    assert looks.of(b) == seen
    _set(a, ["a2"])  # a commit is published: seen on the next call
    assert b.contains(["a2"]) == [True]
    assert looks.of(b) == seen + 1
    a.delete(["a1"])  # a delete too
    assert b.contains(["a1"]) == [False]
    assert looks.of(b) == seen + 2
    assert a.contains(["b1"]) == [True]
    a.compact()  # and a log replaced by a compaction
    assert b.contains(["a0", "a1", "a2"]) == [True, False, True]
    assert looks.of(b) == seen + 3


def test_a_new_writer_is_published(two: tuple[SlabStore, SlabStore], tmp_path: Path) -> None:
    a, b = two
    _set(a, ["a0"])
    assert b.contains(["a0"]) == [True]
    c = SlabStore(tmp_path, NS, SLOT)  # a third writer directory, created now
    try:
        _set(c, ["c0"])
        assert b.contains(["c0"]) == [True]
    finally:
        c.close()


def test_a_writer_that_does_not_publish_is_seen_within_the_full_look_period(
        two: tuple[SlabStore, SlabStore], monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = two
    clock = [time.monotonic() + 100]  # past any period a look before started
    monkeypatch.setattr(changes, "monotonic", lambda: clock[0])
    _set(a, ["a0"])
    assert b.contains(["a0"]) == [True]  # a look: the period starts
    monkeypatch.setattr(a.index.logs, "changes", None)  # as an older hicache-l3 writes: no change file
    _set(a, ["a1"])
    assert b.contains(["a1"]) == [False]  # the file is still: no look yet
    clock[0] += changes.FULL_LOOK_S
    assert b.contains(["a1"]) == [True]


def test_the_change_file_is_private_and_one_slot_a_writer(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        s = SlabStore(tmp_path, NS, SLOT)
    finally:
        os.umask(old)
    try:
        _set(s, ["k"])
        path = namespace_dir(tmp_path, NS) / CHANGES_FILE
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 8 * (s.me + 1)  # type: ignore[operator]
        before = path.read_bytes()
        _set(s, ["k2"])
        assert path.read_bytes() != before
    finally:
        s.close()


@pytest.mark.parametrize("planted", ["symlink", "directory", "fifo"])
def test_a_planted_change_file_is_not_used_and_nothing_is_missed(tmp_path: Path, planted: str) -> None:
    nsdir = namespace_dir(tmp_path, NS)
    SlabStore(tmp_path, NS, SLOT).close()  # the namespace directory exists
    path = nsdir / CHANGES_FILE
    path.unlink()
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    if planted == "symlink":
        path.symlink_to(target)
    elif planted == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    a, b = SlabStore(tmp_path, NS, SLOT), SlabStore(tmp_path, NS, SLOT)
    try:
        assert a.index.logs.changes is None and b.index.logs.changes is None
        _set(a, ["a0"])
        assert b.contains(["a0"]) == [True]  # a look at the logs on every call, as before
        assert target.read_bytes() == b""  # the link was not followed
    finally:
        a.close()
        b.close()


def test_a_change_file_cut_short_or_rewritten_makes_a_store_look(
        two: tuple[SlabStore, SlabStore], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a, b = two
    looks = Looks(monkeypatch)
    _set(a, ["a0"])
    b.contains(["a0"])
    path = namespace_dir(tmp_path, NS) / CHANGES_FILE
    seen = looks.of(b)
    os.truncate(path, 0)
    assert b.contains(["a0"]) == [True] and looks.of(b) == seen + 1
    path.write_bytes(b"junk")
    assert b.contains(["a0"]) == [True] and looks.of(b) == seen + 2


def test_a_store_shared_by_machines_does_not_use_the_change_file(tmp_path: Path) -> None:
    s = SharedSlabStore(tmp_path, NS, SLOT, max_writers=2, lease_s=5.0)
    try:
        _set(s, ["k"])
        assert s.index.logs.changes is None
        assert not (namespace_dir(tmp_path, NS) / CHANGES_FILE).exists()
    finally:
        s.close()


def test_change_file_open_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / CHANGES_FILE).mkdir()
    assert ChangeFile.open(tmp_path) is None
