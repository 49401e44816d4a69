"""The io_uring path (hicache_l3/slab/uring.py, native/uring_io.c) beyond the conformance
suite: cold pages read through the ring, and the fallback when the kernel refuses one."""

from __future__ import annotations

import fcntl
import logging
import os
import resource
from pathlib import Path
from typing import Any

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.memory import HostBuffer
from hicache_l3.conformance.pages import Pages, page_pattern
from hicache_l3.conformance.slab_backdoor import SlabBackdoor
from hicache_l3.slab import io, uring

NS = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
PAGE = uring.COLD_RING_MIN_BYTES  # cold pages this big go through the ring


def _drop_cache(root: Path) -> int:
    """Write back and drop the page cache of every slab file under root; the files seen."""
    seen = 0
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            seen += 1
    return seen


@pytest.mark.parametrize("page_bytes", [PAGE, 64 << 10])
def test_cold_pages_are_read_through_the_ring(tmp_path: Path, page_bytes: int) -> None:
    """Big cold pages go through the ring; smaller ones through the cold threads."""
    with open_connector("file", NS, root=str(tmp_path), io_uring_depth=4) as conn:
        assert type(conn.transport) is uring.ColdRingTransport  # type: ignore[attr-defined]
        assert conn.stats()["engine"]["io_uring_depth"] == 4
        keys = [f"cold-{i}" for i in range(48)]
        pages = Pages(conn, page_bytes, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        assert _drop_cache(tmp_path) > 0
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        counters = conn.stats()["ops"]["counters"]
        assert counters.get("cold_pages", 0) > 0
        assert (counters.get("io_uring_pages", 0) > 0) == (page_bytes >= uring.COLD_RING_MIN_BYTES)


def test_a_cold_page_rewritten_on_disk_is_a_miss(tmp_path: Path) -> None:
    """The ring checks records and checksums as the blocking path does: a flipped byte and a
    torn rewrite (the next generation's record, half the data) are misses."""
    with open_connector("file", NS, root=str(tmp_path), io_uring_depth=4) as conn:
        keys = [f"bad-{i}" for i in range(8)]
        pages = Pages(conn, PAGE, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        backdoor = SlabBackdoor()
        backdoor.backdoor_corrupt({"root": str(tmp_path)}, NS, keys[3], "flip")
        backdoor.backdoor_corrupt({"root": str(tmp_path)}, NS, keys[5], "truncate")
        _drop_cache(tmp_path)
        pages.wipe()
        got = conn.batch_get(keys, pages.pages)
        assert got == [j not in (3, 5) for j in range(len(keys))]
        assert conn.stats()["ops"]["counters"].get("io_uring_pages", 0) > 0
        assert conn.stats()["ops"]["get"]["failed"]["corrupt"] >= 1


def test_o_direct_gets_read_their_plan_through_o_direct_descriptors(tmp_path: Path) -> None:
    """An O_DIRECT get reads its plan: every aligned page's data through the ring from the
    slab's O_DIRECT descriptor, a page with an unaligned segment in the same batch through
    the page cache (counted), every page right."""
    with open_connector("file", NS, root=str(tmp_path), o_direct=True, io_uring_depth=4) as conn:
        keys = [f"direct-{i}" for i in range(12)]
        pages = Pages(conn, 64 << 10, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        store = conn._store  # type: ignore[attr-defined]
        plans: list[Any] = []
        real = store.plan_get
        store.plan_get = lambda *a: plans.append(real(*a)) or plans[-1]
        _drop_cache(tmp_path)
        pages.wipe()
        before = conn.stats()["ops"]["counters"].get("io_uring_pages", 0)
        assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        (plan,) = plans
        assert plan.count == len(keys) and plan.direct_fds is not None
        assert all(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in plan.direct_fds)
        assert not any(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in plan.fds)
        counters = conn.stats()["ops"]["counters"]
        assert counters["io_uring_pages"] - before == len(keys)
        assert counters.get("direct_fallback", 0) == 0

        buf = HostBuffer(len(keys) * (64 << 10) + 4096)
        conn.register(buf)
        mixed = [p if i % 3 else ((buf.address + 512 + i * (64 << 10), 64 << 10),)
                 for i, p in enumerate(pages.pages)]  # every third page off a 4 KiB boundary
        pages.wipe()
        assert conn.batch_get(keys, mixed) == [True] * len(keys)
        view = buf.view()
        for i, k in enumerate(keys):
            got = view[512 + i * (64 << 10): 512 + (i + 1) * (64 << 10)] if i % 3 == 0 else pages.page(i)
            assert bytes(got) == page_pattern(k, 64 << 10), i
        assert conn.stats()["ops"]["counters"]["direct_fallback"] == 4


class _NoDescriptors:
    """No file descriptor left to this process while inside (RLIMIT_NOFILE at the lowest
    free one, every one below it taken)."""

    def __enter__(self) -> None:
        self.limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.held = [os.open(os.devnull, os.O_RDONLY)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (self.held[0] + 8, self.limits[1]))
        try:
            while True:
                self.held.append(os.dup(self.held[0]))
        except OSError:
            pass

    def __exit__(self, *exc: object) -> None:
        for fd in self.held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, self.limits)


def test_a_refused_ring_keeps_the_blocking_path(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """io_uring_setup failing at the first use of the rings (here EMFILE: no descriptor left
    for a ring) is one log line, and the pages move by blocking calls, every one right."""
    before = _ring_fds()
    with open_connector("file", NS, root=str(tmp_path), io_uring_depth=4) as conn:
        keys = [f"refused-{i}" for i in range(16)]
        pages = Pages(conn, PAGE, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        _drop_cache(tmp_path)
        pages.wipe()
        with caplog.at_level(logging.WARNING, logger="hicache_l3.slab.uring"), _NoDescriptors():
            assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        assert _ring_fds() == before
        counters = conn.stats()["ops"]["counters"]
        assert counters.get("cold_pages", 0) > 0 and counters.get("io_uring_pages", 0) == 0
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "file connector: no io_uring" in lines[0], lines


def test_a_refused_ring_leaves_o_direct_the_blocking_path(caplog: pytest.LogCaptureFixture) -> None:
    transport = uring.select_transport(None, direct=True, io_threads=2, write_threads=2, cold_threads=16,
                                       ring_depth=8, what="test")
    try:
        assert isinstance(transport, uring.UringTransport)
        with caplog.at_level(logging.WARNING, logger="hicache_l3.slab.uring"), _NoDescriptors():
            assert transport._ready() is None  # every batch then takes the blocking calls
        assert transport._ready() is None and isinstance(transport, io.DirectTransport)
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "test: no io_uring" in lines[0], lines
    finally:
        transport.close()


def _ring_fds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[io_uring]":
                found.add(int(name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("o_direct", [True, False])
def test_a_ring_that_fails_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                      o_direct: bool) -> None:
    """A ring whose io_uring_enter fails mid-way (its descriptor made /dev/null): the batch
    and the later ones move by blocking calls, every page right, one log line."""
    before = _ring_fds()
    with open_connector("file", NS, root=str(tmp_path), o_direct=o_direct, io_uring_depth=4) as conn:
        assert _ring_fds() == before  # none until pages move through them
        keys = [f"fail-{i}" for i in range(16)]
        pages = Pages(conn, PAGE, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        _drop_cache(tmp_path)
        assert conn.batch_get(keys, pages.pages) == [True] * len(keys)  # (cold: opens the rings)
        rings = _ring_fds() - before
        assert len(rings) == 2
        null = os.open(os.devnull, os.O_RDONLY)
        for fd in rings:
            os.dup2(null, fd)
        os.close(null)
        _drop_cache(tmp_path)
        pages.wipe()
        with caplog.at_level(logging.WARNING, logger="hicache_l3.slab.uring"):
            assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
            assert all(pages.matches(i, k) for i, k in enumerate(keys))
            more = [f"more-{i}" for i in range(16)]
            pages.fill(more)
            assert conn.batch_set(more, pages.pages) == [True] * len(more)
            pages.wipe()
            assert conn.batch_get(more, pages.pages) == [True] * len(more)
            assert all(pages.matches(i, k) for i, k in enumerate(more))
        failed = [r.getMessage() for r in caplog.records if "io_uring failed" in r.getMessage()]
        assert len(failed) == 1, failed


def test_depth_is_checked() -> None:
    from hicache_l3.common.errors import ConfigError

    with pytest.raises(ConfigError, match="io_uring_depth"):
        open_connector("file", NS, root="/nonexistent-root", io_uring_depth=-1)
