"""The USRBIO test double enforces the real API's preconditions, and the hf3fs
connector's USRBIO path behaves under them: zero-copy only for pages in registered
shared memory, bounded ring timeouts, fds registered once and released at close, clear
errors for settings that cannot work."""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import time
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.errors import ConfigError, EngineUnavailableError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.suite import page_pattern
from hicache_l3.connectors.hf3fs import SharedHostBuffer
from hicache_l3.slab.format import Geometry
from tests.doubles import hf3fs_usrbio_double as double

DOUBLE = "tests.doubles.hf3fs_usrbio_double"
PAGE = 16 << 10
NS = Namespace(model="usrbio/model", kv_dtype="bfloat16", layout="page_first", page_size=16)


@pytest.fixture
def mount(tmp_path: Path) -> str:
    return double.make_test_mount(str(tmp_path / "mnt"))


@pytest.fixture
def shm() -> Any:
    segment = shared_memory.SharedMemory(create=True, size=1 << 16)
    yield segment
    with contextlib.suppress(BufferError):  # a test's traceback may still hold a slice
        segment.close()
    with contextlib.suppress(FileNotFoundError):
        segment.unlink()


@pytest.fixture
def fd(tmp_path: Path) -> Any:
    f = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT, 0o644)
    os.ftruncate(f, 1 << 20)
    yield f
    double.deregister_fd(f)
    os.close(f)


# ---- the double's preconditions -------------------------------------------------------------
def test_iovec_needs_shared_memory_that_exists(mount: str, shm: Any) -> None:
    with pytest.raises(TypeError):
        double.make_iovec(bytearray(4096), mount)
    iov = double.make_iovec(shm, mount)
    assert len(os.listdir(os.path.join(mount, "3fs-virt", "iovs"))) == 1
    del iov  # the symlink goes with the iovec
    assert os.listdir(os.path.join(mount, "3fs-virt", "iovs")) == []
    shm.unlink()
    with pytest.raises(FileNotFoundError):
        double.make_iovec(shm, mount)


def test_slices_stay_inside_their_iovec(mount: str, shm: Any) -> None:
    iov = double.make_iovec(shm, mount)
    assert len(iov[100:200]) == 100
    with pytest.raises(ValueError):
        iov[0:100:2]
    with pytest.raises(IndexError):
        iov.slice_by(bytearray(10))
    assert len(iov.slice_by(shm.buf[10:20])) == 10


def test_ring_checks_iov_fd_direction_and_entries(mount: str, shm: Any, fd: int) -> None:
    iov = double.make_iovec(shm, mount)
    ring = double.make_ioring(mount, 2, for_read=False)
    with pytest.raises(TypeError):
        ring.prepare(memoryview(bytearray(10)), False, fd, 0)
    with pytest.raises(OSError) as bad_fd:
        ring.prepare(iov[0:10], False, fd, 0)
    assert bad_fd.value.errno == errno.EBADF
    double.register_fd(fd)
    with pytest.raises(OSError):
        double.register_fd(fd)  # once only
    with pytest.raises(OSError):
        ring.prepare(iov[0:10], True, fd, 0)  # a write ring
    ring.prepare(iov[0:10], False, fd, 0, "a").prepare(iov[10:20], False, fd, 10, "b")
    with pytest.raises(OSError) as full:
        ring.prepare(iov[20:30], False, fd, 20)
    assert full.value.errno == errno.EAGAIN
    done = ring.submit().wait(min_results=2, timeout=datetime.timedelta(seconds=5))
    assert sorted((c.userdata, c.result) for c in done) == [("a", 10), ("b", 10)]
    with pytest.raises(OSError):
        double.make_ioring(os.path.dirname(mount), 4)  # not a mount point


# the timed-out read is still pending in the double's simulated daemon thread (1 s) when the
# shared-memory fixture is collected: SharedMemory.__del__ then cannot unmap it
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_wait_honours_its_timeout(mount: str, shm: Any, fd: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(double, "DELAY_S", 1.0)
    double.register_fd(fd)
    iov = double.make_iovec(shm, mount)
    ring = double.make_ioring(mount, 4, for_read=True)
    ring.prepare(iov[0:4096], True, fd, 0).submit()
    t0 = time.monotonic()
    with pytest.raises(OSError) as timed_out:
        ring.wait(min_results=1, timeout=datetime.timedelta(seconds=0.2))
    assert timed_out.value.errno == errno.ETIMEDOUT
    assert 0.2 <= time.monotonic() - t0 <= 0.4


# ---- the connector on the double ------------------------------------------------------------
def _settings(mount: str, **kw: Any) -> dict[str, Any]:
    return {"root": f"{mount}/store", "capacity_bytes": "64MiB", "usrbio": "on",
            "usrbio_module": DOUBLE, **kw}


def _slot_order(events: list[tuple[str, bool, int, int, int]],
                read: bool) -> dict[tuple[int, int], list[str]]:
    """Per (file, slot), what happened to it in ``events`` of direction ``read``, in order:
    ``"<start|done> <marker|data>"``."""
    geometry = Geometry(PAGE)
    slot_of = {geometry.marker_offset(s): (s, "marker") for s in range(2048)}
    slot_of.update({geometry.data_offset(s): (s, "data") for s in range(2048)})
    out: dict[tuple[int, int], list[str]] = {}
    for what, r, fd, off, _ in events:
        if r == read:
            slot, part = slot_of[off]
            out.setdefault((fd, slot), []).append(f"{what} {part}")
    return out


# a freed staging segment may still be exported to the double's daemon threads
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("shared", [False, True], ids=["staged", "zero-copy"])
def test_rounds_overlap_and_each_slot_keeps_its_order(mount: str, shared: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of several ring rounds waits once per round and once more (a round's data
    travels with the next round's marker records when writing, with the previous round's
    when reading), and every slot's marker record is still written before its data, and
    read after it."""
    n, entries = 13, 8  # rounds of 4 pages: 4 rounds
    with open_connector("hf3fs", NS, _settings(mount, usrbio_entries=entries)) as conn:
        buf = SharedHostBuffer(n * PAGE) if shared else HostBuffer(n * PAGE)
        conn.register(buf)
        view = buf.view()
        keys = [f"round-{i}" for i in range(n)]
        pages = contiguous_pages(buf.address, PAGE, range(n))
        for i, key in enumerate(keys):
            view[i * PAGE : (i + 1) * PAGE] = page_pattern(key, PAGE)
        assert conn.batch_set(["warm"], pages[:1]) == [True]  # slab files opened before counting
        events: list[tuple[str, bool, int, int, int]] = []
        monkeypatch.setattr(double, "EVENTS", events)
        waits = double.STATS["waits"]
        assert conn.batch_set(keys, pages) == [True] * n
        assert double.STATS["waits"] - waits == 4 + 1
        written = _slot_order(events, read=False)
        assert len(written) == n
        assert all(o == ["start marker", "done marker", "start data", "done data"] for o in written.values())

        view[:] = bytes(len(view))
        events.clear()
        waits = double.STATS["waits"]
        assert conn.batch_get(keys, pages) == [True] * n
        assert double.STATS["waits"] - waits == 4 + 1
        read = _slot_order(events, read=True)
        assert read.keys() == written.keys()
        assert all(o == ["start data", "done data", "start marker", "done marker"] for o in read.values())
        for i, key in enumerate(keys):
            assert view[i * PAGE : (i + 1) * PAGE] == page_pattern(key, PAGE)
    del view
    if isinstance(buf, SharedHostBuffer):
        buf.close()


# the double's simulated daemon threads may still hold slices of a freed staging
# segment when it is collected (SharedMemory.__del__ then cannot unmap it)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_zero_copy_only_for_pages_in_shared_memory(mount: str) -> None:
    with open_connector("hf3fs", NS, _settings(mount)) as conn:
        shared, plain = SharedHostBuffer(4 * PAGE), HostBuffer(4 * PAGE)
        conn.register(shared)
        conn.register(plain)
        keys = [f"mix-{i}" for i in range(8)]
        pages = [*contiguous_pages(shared.address, PAGE, range(4)),
                 *contiguous_pages(plain.address, PAGE, range(4))]
        views = [shared.view(), plain.view()]
        for i, key in enumerate(keys):
            views[i // 4][(i % 4) * PAGE : (i % 4 + 1) * PAGE] = page_pattern(key, PAGE)
        assert conn.batch_set(keys, pages) == [True] * 8
        for v in views:
            v[:] = bytes(len(v))
        assert conn.batch_get(keys, pages) == [True] * 8
        for i, key in enumerate(keys):
            assert views[i // 4][(i % 4) * PAGE : (i % 4 + 1) * PAGE] == page_pattern(key, PAGE)
        counters = conn.stats()["ops"]["counters"]
        assert counters["usrbio_zero_copy"] == 8 and counters["usrbio_staged"] == 8
        fds = set(conn.usrbio.rings._fds)
        assert fds and fds <= double._registered
    assert not fds & double._registered  # deregistered before the store closed them
    shared.close()


# the double's simulated daemon threads may still hold slices of a freed staging
# segment when it is collected (SharedMemory.__del__ then cannot unmap it)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_slow_daemon_fails_pages_within_the_timeout(mount: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with open_connector("hf3fs", NS, _settings(mount, usrbio_timeout_s=0.3)) as conn:
        buf = HostBuffer(2 * PAGE)
        conn.register(buf)
        pages = contiguous_pages(buf.address, PAGE, range(2))
        # the store opened, its slab created and a ring set up before the clock: the bound
        # is on the wait for a slow daemon, not on first-use set-up (slow on a loaded host)
        assert conn.batch_set(["warm-0", "warm-1"], pages) == [True, True]
        monkeypatch.setattr(double, "DELAY_S", 1.0)
        t0 = time.monotonic()
        assert conn.batch_set(["slow-0", "slow-1"], pages) == [False, False]
        assert time.monotonic() - t0 <= 2 * 0.3
        assert conn.stats()["ops"]["set"]["failed"] == {"engine_error": 2}
        assert conn.batch_exists(["slow-0", "slow-1"]) == [False, False]
        monkeypatch.setattr(double, "DELAY_S", 0.0)
        assert conn.batch_set(["slow-0", "slow-1"], pages) == [True, True]  # a fresh ring
        assert conn.batch_exists(["slow-0", "slow-1"]) == [True, True]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # (as above)
def test_a_write_that_timed_out_never_lands_in_a_reused_slot(mount: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Data writes that outlive the ring's timeout hold their slots (quarantined, never
    reused), so their late bytes never become another key's page, even unchecksummed."""
    settings = _settings(mount, usrbio_timeout_s=0.3, checksum="none", max_writers=1,
                         capacity_bytes=2 * Geometry(PAGE).stride)
    with open_connector("hf3fs", NS, settings) as conn:
        buf = HostBuffer(2 * PAGE)
        conn.register(buf)
        view = buf.view()
        pages = contiguous_pages(buf.address, PAGE, range(2))
        view[:] = page_pattern("late-0", PAGE) + page_pattern("late-1", PAGE)
        monkeypatch.setattr(double, "DELAY_MIN_BYTES", PAGE)  # the data, not the marker records
        monkeypatch.setattr(double, "DELAY_S", 0.6)
        assert conn.batch_set(["late-0", "late-1"], pages) == [False, False]
        assert conn.stats()["engine"]["quarantined_slots"] == 2
        monkeypatch.setattr(double, "DELAY_S", 0.0)
        view[:] = page_pattern("next-0", PAGE) + page_pattern("next-1", PAGE)
        stored = conn.batch_set(["next-0", "next-1"], pages)
        time.sleep(1.0)  # the late writes have landed
        view[:] = bytes(2 * PAGE)
        got = conn.batch_get(["next-0", "next-1"], pages)
        for i, key in enumerate(["next-0", "next-1"]):
            if got[i]:
                assert view[i * PAGE : (i + 1) * PAGE] == page_pattern(key, PAGE), f"{key}: wrong bytes"
        assert stored == [False, False] and got == [False, False]  # the store's two slots are held
        del view


def test_usrbio_settings_that_cannot_work_are_named(mount: str, tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailableError, match="no_such_usrbio_module"):
        open_connector("hf3fs", NS, _settings(mount, usrbio_module="no_such_usrbio_module"))
    with pytest.raises(ConfigError, match="not on a 3FS mount"):
        open_connector("hf3fs", NS, _settings(mount, root=str(tmp_path / "elsewhere")))
    with open_connector("3fs", NS, _settings(mount, usrbio="auto",
                                             usrbio_module="no_such_usrbio_module")) as conn:
        assert conn.mode == "posix"
    with pytest.raises(ConfigError, match="max_writers"):
        open_connector("hf3fs", NS, _settings(mount, capacity_bytes=Geometry(PAGE).stride,
                                              max_writers=2, page_bytes=PAGE))
    with pytest.raises(ConfigError, match="root"):
        open_connector("hf3fs", NS, {"root": "s3://bucket/x"})
