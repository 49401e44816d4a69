"""Mapped reads (``hicache_l3/native/mapped_read.c``, setting ``mapped_reads``): pages of
256 KiB or more that the page cache holds are copied from a shared mapping of the slab file
and hashed in the same pass by our own XXH3. These tests hold it to the reference: the hash
is bit for bit the ``xxhash`` wheel's for every length and segmentation, for each vector
width; a get through it returns exactly the bytes stored and refuses corrupt ones; a slab
file shrunk under a copy (SIGBUS) costs a miss, never the process; and no mapping outlives
the connector."""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache_l3 import Namespace, open_connector
from hicache_l3.conformance.pages import Pages
from hicache_l3.conformance.slab_backdoor import slab_location
from hicache_l3.slab.native import BatchIO, library

NS = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
PAGE = 256 << 10  # a page mapped reads take (64 KiB or more)
N = 8


def native() -> BatchIO:
    lib = library()
    assert lib is not None, "the C batch library must be built for these tests"
    assert lib.maps(), "mapped reads need AVX2 or AVX-512F, which every CI machine has"
    return lib


@pytest.fixture(params=[3, 2], ids=["avx512", "avx2"])
def width(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each vector width the CPU has (AVX-512F only where it has it), restored after."""
    lib = native()
    before = lib.mapped_variant()
    if request.param > before:
        pytest.skip("this CPU has no AVX-512F")  # the AVX2 case still runs
    assert lib.mapped_variant(request.param) == request.param
    yield request.param
    lib.mapped_variant(before)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_copy_and_hash_equal_the_xxhash_wheel(width: int, data: st.DataObject) -> None:
    length = data.draw(st.one_of(st.integers(241, 4200), st.sampled_from([1024, 1025, 65536, 1 << 20])))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, length), max_size=6))))
    shift = data.draw(st.sampled_from([0, 1, 8, 32, 63, 64]))  # destination (mis)alignment
    hashing = data.draw(st.booleans())
    src = data.draw(st.binary(min_size=length, max_size=length)) if length <= 4200 else os.urandom(length)
    source = ctypes.create_string_buffer(src, length)
    dest = ctypes.create_string_buffer(length + 128)
    base = ctypes.addressof(dest) + shift
    bounds = [0, *cuts, length]
    segments = [(base + a, b - a) for a, b in itertools.pairwise(bounds)]  # empty ones included
    got = native().copy_and_hash(ctypes.addressof(source), length, segments, hashing)
    assert dest.raw[shift:shift + length] == src
    assert got == ((xxhash.xxh3_64_intdigest(src) or 1) if hashing else 0)


def run_child(code: str, timeout: float = 120.0) -> str:
    """Run ``code`` in a fresh interpreter (a SIGBUS there must not take the suite down)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert done.returncode == 0, f"child died ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def test_a_file_shrunk_under_a_copy_is_reported_not_fatal(tmp_path: Path) -> None:
    out = run_child(f"""
        import ctypes, mmap, os
        from hicache_l3.slab.native import library
        path = {str(tmp_path / "shrinks")!r}
        with open(path, "wb") as f:
            f.write(os.urandom(1 << 20))
        with open(path, "r+b") as f:
            mapped = mmap.mmap(f.fileno(), 1 << 20)
        src = ctypes.addressof(ctypes.c_char.from_buffer(mapped))
        dest = ctypes.create_string_buffer(1 << 20)
        lib = library()
        assert lib.copy_and_hash(src, 1 << 20, [(ctypes.addressof(dest), 1 << 20)], True) not in (None, 0)
        os.truncate(path, 4096)  # every page past the first now raises SIGBUS when read
        for hashing in (True, False):
            print(lib.copy_and_hash(src, 1 << 20, [(ctypes.addressof(dest), 1 << 20)], hashing))
        print(lib.mapped_stats()["mapped_sigbus"])
    """)
    assert out.split() == ["None", "None", "2"]


@pytest.mark.parametrize("page", [64 << 10, PAGE])
def test_slab_files_shrunk_and_regrown_under_gets_cost_misses_only(tmp_path: Path, page: int) -> None:
    out = run_child(f"""
        import os, threading, time
        from hicache_l3 import Namespace, open_connector
        from hicache_l3.conformance.pages import Pages
        ns = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
        root = {str(tmp_path)!r}
        stop = threading.Event()

        def shrink_and_regrow(paths):
            while not stop.is_set():
                for path in paths:
                    size = os.path.getsize(path)
                    os.truncate(path, 4096)
                    os.truncate(path, size)

        hits = misses = 0
        with open_connector("file", ns, root=root) as conn:
            keys = [f"r{{i}}" for i in range(8)]
            pages = Pages(conn, {page}, 8)
            pages.fill(keys)
            assert all(conn.batch_set(keys, pages.pages))
            slabs = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".dat")]
            racer = threading.Thread(target=shrink_and_regrow, args=(slabs,))
            racer.start()
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                pages.fill(keys)
                conn.batch_set(keys, pages.pages)
                pages.wipe()
                for i, ok in enumerate(conn.batch_get(keys, pages.pages)):
                    assert not ok or pages.matches(i, keys[i]), "a hit with wrong bytes"
                    hits += ok
                    misses += not ok
            stop.set()
            racer.join()
        print(hits + misses > 0)
    """)
    assert out.split() == ["True"]


@pytest.fixture
def conn(tmp_path: Path) -> Iterator[Any]:
    with open_connector("file", NS, root=str(tmp_path)) as c:
        yield c


def mapped_pages(conn: Any) -> int:
    return int(conn.stats()["engine"]["mapped_pages"])


def stored(conn: Any, prefix: str, page: int = PAGE) -> tuple[list[str], Pages]:
    """N pages of ``page`` bytes set under fresh keys (their buffers hold the bytes)."""
    keys = [f"{prefix}{i}" for i in range(N)]
    pages = Pages(conn, page, N)
    pages.fill(keys)
    assert conn.batch_set(keys, pages.pages) == [True] * N
    return keys, pages


@pytest.mark.parametrize("page", [64 << 10, PAGE])
def test_gets_read_through_the_mapping_return_the_stored_bytes(conn: Any, width: int, page: int) -> None:
    keys, pages = stored(conn, "m", page)
    before = mapped_pages(conn)
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == [True] * N
    assert all(pages.matches(i, k) for i, k in enumerate(keys))
    assert mapped_pages(conn) - before == N  # (the counters are the process's)


def test_small_pages_and_switched_off_reads_use_preadv(tmp_path: Path) -> None:
    for page, settings_ in ((32 << 10, {}), (PAGE, {"mapped_reads": False})):
        ns = Namespace(model=f"m{page}", kv_dtype="bfloat16", layout="page_first", page_size=16)
        with open_connector("file", ns, root=str(tmp_path / str(page)), **settings_) as c:
            keys, pages = stored(c, "s", page)
            before = native().mapped_stats()["mapped_pages"]
            pages.wipe()
            assert c.batch_get(keys, pages.pages) == [True] * N
            assert all(pages.matches(i, k) for i, k in enumerate(keys))
            assert native().mapped_stats()["mapped_pages"] == before
            assert c.stats()["engine"]["mapped_reads"] is ("mapped_reads" not in settings_)


def test_a_corrupt_page_read_through_the_mapping_is_a_miss(conn: Any, tmp_path: Path) -> None:
    keys, pages = stored(conn, "c")
    where = slab_location(tmp_path, NS, keys[3])
    assert where is not None
    path, offset = where[0], where[1]
    with path.open("r+b") as f:  # one byte flipped in the page's data, in the page cache
        f.seek(offset + PAGE // 2)
        byte = f.read(1)
        f.seek(offset + PAGE // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = mapped_pages(conn)
    pages.wipe()
    got = conn.batch_get(keys, pages.pages)
    assert got == [i != 3 for i in range(N)]
    assert all(pages.matches(i, k) for i, k in enumerate(keys) if i != 3)
    assert mapped_pages(conn) > before


@pytest.fixture(params=[1, 0], ids=["cachestat", "mincore"])
def residency(request: pytest.FixtureRequest) -> Iterator[int]:
    """Each way a mapped read checks residency (cachestat where the kernel has it), restored after."""
    lib = native()
    before = lib.mapped_residency()
    if lib.mapped_residency(request.param) != request.param:
        pytest.skip("this kernel refuses cachestat")  # the mincore case still runs
    yield request.param
    lib.mapped_residency(before)


def test_a_page_partly_out_of_the_page_cache_is_not_read_through_the_mapping(
        conn: Any, tmp_path: Path, residency: int) -> None:
    keys, pages = stored(conn, "r")
    where = [slab_location(tmp_path, NS, k) for k in keys]
    assert all(w is not None and w[0] == where[0][0] for w in where)  # type: ignore[index]
    offsets = [w[1] for w in where]  # type: ignore[index]
    assert offsets == [offsets[0] + i * PAGE for i in range(N)], "one run of adjacent pages"
    fd = os.open(where[0][0], os.O_RDONLY)  # type: ignore[index]
    hole = 64 << 10
    try:  # every byte back in the page cache but page 3's last 64 KiB (no readahead here)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        for i in range(N):
            want = PAGE - hole if i == 3 else PAGE
            assert len(os.pread(fd, want, offsets[i])) == want
    finally:
        os.close(fd)
    before = native().mapped_stats()
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == [True] * N
    assert all(pages.matches(i, k) for i, k in enumerate(keys))
    after = native().mapped_stats()
    # page 3, alone or in a run of adjacent pages, is refused whole (a check of its first
    # bytes alone would copy it through the mapping, and the faults would read the hole
    # from the disk a few pages at a time); the reads that follow (whose readahead may
    # bring the hole back) leave pages 4-7 at least to the mapping
    assert after["mapped_not_resident"] - before["mapped_not_resident"] >= 1
    assert after["mapped_pages"] - before["mapped_pages"] >= 4


def test_a_truncated_slab_file_is_a_miss(conn: Any, tmp_path: Path) -> None:
    keys, pages = stored(conn, "t")
    where = slab_location(tmp_path, NS, keys[0])
    assert where is not None
    os.truncate(where[0], 4096)  # under the connector's mapping: past it, SIGBUS
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == [False] * N


def test_no_mapping_outlives_the_connector(tmp_path: Path) -> None:
    def slab_maps() -> list[str]:
        return [line for line in Path("/proc/self/maps").read_text().splitlines()
                if str(tmp_path) in line and ".dat" in line]

    with open_connector("file", NS, root=str(tmp_path)) as c:
        keys, pages = stored(c, "o")
        assert c.batch_get(keys, pages.pages) == [True] * N
        assert slab_maps(), "the slab file is mapped while the connector is open"
    assert slab_maps() == []


def test_a_descriptor_number_reused_for_another_file_maps_that_file(tmp_path: Path) -> None:
    def mapped() -> str:
        return Path("/proc/self/maps").read_text()

    lib = native()
    first, second = tmp_path / "first", tmp_path / "second"
    first.write_bytes(b"a" * 8192)
    second.write_bytes(b"b" * 8192)
    fd = os.open(first, os.O_RDONLY)
    assert lib.map_fd(fd) == 0
    assert lib.map_fd(fd) == 1  # the same file: mapped already
    os.close(fd)  # closed without unmap_fd: the number comes back for the next open
    again = os.open(second, os.O_RDONLY)
    try:
        assert again == fd
        assert lib.map_fd(again) == 0
        assert str(second) in mapped() and str(first) not in mapped()
    finally:
        lib.unmap_fd(again)
        os.close(again)
    assert str(second) not in mapped()
