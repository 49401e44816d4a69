"""Pages that are not in the page cache (a store bigger than memory, the usual L3 case): a
get reads what the cache holds in its own calls (``hl3_read_plan_nowait``) and the rest on
the cold pool, many at once (``cold_read_threads``), so that the disk sees a queue of them
instead of one or two. The bytes and verdicts are exactly a warm read's: a damaged page
read cold is a miss, never its bytes."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.bench.runner import drop_page_cache
from hicache_l3.conformance.pages import Pages
from hicache_l3.conformance.slab_backdoor import SlabBackdoor, slab_location

NS = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
PAGE = 16 << 10
N = 64


def cold_pages(conn: object) -> int:
    return int(conn.stats()["ops"]["counters"].get("cold_pages", 0))  # type: ignore[attr-defined]


@pytest.mark.parametrize("threads", [0, 16])
def test_pages_read_cold_are_the_pages_stored(tmp_path: Path, threads: int) -> None:
    with open_connector("file", NS, root=str(tmp_path), cold_read_threads=threads) as conn:
        keys = [f"cold{i}" for i in range(N)]
        pages = Pages(conn, PAGE, N)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * N
        drop_page_cache(tmp_path)
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * N
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        if threads:  # none was in the page cache: the cold pass read them
            assert 0 < cold_pages(conn) <= N
        else:
            assert cold_pages(conn) == 0
        drop_page_cache(tmp_path)
        warm = keys[::5]  # a batch that mixes cached and uncached pages (as readahead leaves them)
        assert conn.batch_get(warm, pages.pages[: len(warm)]) == [True] * len(warm)
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * N
        assert all(pages.matches(i, k) for i, k in enumerate(keys))


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_page_read_cold_is_a_miss(tmp_path: Path, how: str) -> None:
    settings = {"root": str(tmp_path), "cold_read_threads": 16}
    with open_connector("file", NS, **settings) as conn:
        keys = [f"bad{i}" for i in range(N)]
        pages = Pages(conn, PAGE, N)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * N
        backdoor = SlabBackdoor()
        backdoor.page_bytes = PAGE
        damaged = {3, 40, 41}
        for i in damaged:
            backdoor.backdoor_corrupt(settings, NS, keys[i], how)
        drop_page_cache(tmp_path)
        pages.wipe()
        result = conn.batch_get(keys, pages.pages)
        assert result == [i not in damaged for i in range(N)]
        assert all(pages.matches(i, k) for i, k in enumerate(keys) if i not in damaged)
        assert cold_pages(conn) > 0


def _cached_bytes(path: Path, offset: int, length: int) -> int:
    """Bytes of ``path[offset:offset+length]`` in the page cache (``mincore`` on a mapping
    of the file: it reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    lo, hi = offset // page * page, -(-(offset + length) // page) * page
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, hi - lo, mmap.PROT_READ, mmap.MAP_SHARED, fd, lo)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        vec = ctypes.create_string_buffer((hi - lo) // page)
        try:
            assert libc.mincore(addr, hi - lo, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, hi - lo)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec.raw) * page


def _read_in_order(path: Path, offsets: list[int], length: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        for at in offsets:
            os.pread(fd, length, at)
    finally:
        os.close(fd)


def test_a_get_reads_no_page_it_was_not_asked_for(tmp_path: Path) -> None:
    # Pages read one after another in slot order look sequential to the kernel, which reads
    # ahead past them unless the slab's descriptor says its reads are random.
    with open_connector("file", NS, root=str(tmp_path), cold_read_threads=0) as conn:
        keys = [f"ra{i}" for i in range(N)]
        pages = Pages(conn, PAGE, N)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * N
        where = [slab_location(tmp_path, NS, k) for k in keys]
        assert all(w is not None for w in where)
        path = where[0][0]  # type: ignore[index]
        assert all(w[0] == path for w in where)  # type: ignore[index]
        order = sorted(range(N), key=lambda i: where[i][1])  # type: ignore[index]
        drop_page_cache(tmp_path)
        # the filesystem reads ahead at all (a plain descriptor, the same pattern)
        _read_in_order(path, [where[i][1] for i in order[N // 2 : N // 2 + 8]], PAGE)  # type: ignore[index]
        control = where[order[N // 2 + 8]][1]  # type: ignore[index]
        if not _cached_bytes(path, control, 4 * PAGE):  # tmpfs: nothing to check; CI has a disk
            why = f"{tmp_path}'s filesystem reads nothing ahead: nothing to check here"
            if os.environ.get("CI"):
                pytest.fail(f"{why}; CI must run the tests on a disk filesystem")
            pytest.skip(why)
        drop_page_cache(tmp_path)
        for i in order[:8]:
            assert conn.batch_get([keys[i]], pages.pages[i : i + 1]) == [True]
            assert pages.matches(i, keys[i])
        after = where[order[8]][1]  # type: ignore[index]
        assert _cached_bytes(path, after, 4 * PAGE) == 0
        assert _cached_bytes(path, where[order[0]][1], PAGE) > 0  # type: ignore[index]
