"""File connector options and multi-process behaviour beyond the shared suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages, strided_pages
from hicache_l3.conformance.pages import Pages, page_pattern
from hicache_l3.slab.format import Geometry

NS = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
PAGE = 16 << 10


@pytest.mark.parametrize("io_uring_depth", [128, 0])
def test_o_direct_moves_aligned_pages_and_falls_back_for_unaligned(tmp_path: Path,
                                                                   io_uring_depth: int) -> None:
    """Pages whose every segment is 4 KiB-aligned (one segment, or scattered ones like SGLang's
    K and V halves) move with O_DIRECT; a page with an unaligned segment through the page cache."""
    with open_connector("file", NS, root=str(tmp_path), o_direct=True, io_uring_depth=io_uring_depth) as conn:
        keys = [f"d{i}" for i in range(8)]
        pages = Pages(conn, PAGE, 8)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * 8
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * 8
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        assert conn.stats()["ops"]["counters"].get("direct_fallback", 0) == 0
        buf = HostBuffer(5 * PAGE)
        conn.register(buf)
        view = buf.view()
        for name, first, fallbacks in (("scattered", 0, 0), ("unaligned", 512, 2)):
            page = strided_pages(buf.address + first, PAGE // 4, 4, PAGE, range(1))
            parts = [view[first + s * PAGE : first + s * PAGE + PAGE // 4] for s in range(4)]
            for s, part in enumerate(parts):
                part[:] = bytes([s + 1 + first % 7]) * len(part)
            written = [bytes(part) for part in parts]
            assert conn.batch_set([name], page) == [True]
            for part in parts:
                part[:] = bytes(len(part))
            assert conn.batch_get([name], page) == [True]
            assert [bytes(part) for part in parts] == written
            assert conn.stats()["ops"]["counters"].get("direct_fallback", 0) == fallbacks, name


@pytest.mark.parametrize("policy, min_syncs", [("none", 0), ("data", 1), ("always", 2)])
def test_fsync_policy_syncs_before_publishing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              policy: str, min_syncs: int) -> None:
    calls: list[int] = []
    real = os.fdatasync

    def counting(fd: int) -> None:
        calls.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", counting)
    with open_connector("file", NS, root=str(tmp_path), fsync=policy) as conn:
        pages = Pages(conn, PAGE, 4)
        assert conn.batch_set([f"f{i}" for i in range(4)], pages.pages) == [True] * 4
    assert (len(calls) >= min_syncs) if min_syncs else calls == []


def test_concurrent_writer_processes_share_one_index(tmp_path: Path) -> None:
    """Three processes write at once (some keys in common); every page is readable by all."""
    root = str(tmp_path / "shared")
    common = [f"common-{i}" for i in range(40)]
    procs = []
    for w in range(3):
        keys = [f"w{w}-{i}" for i in range(150)] + common
        spec = {"name": "file", "namespace": NS.fields(), "settings": {"root": root},
                "op": "set", "keys": keys, "page_bytes": PAGE}
        procs.append(subprocess.Popen([sys.executable, "-m", "hicache_l3.conformance.worker",
                                       json.dumps(spec)], stdout=subprocess.PIPE, text=True))
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        assert all(json.loads(out)["results"])
    every = [f"w{w}-{i}" for w in range(3) for i in range(150)] + common
    with open_connector("file", NS, root=root) as conn:
        assert conn.batch_exists(every) == [True] * len(every)
        buf = HostBuffer(len(every) * PAGE)
        conn.register(buf)
        pages = contiguous_pages(buf.address, PAGE, range(len(every)))
        assert conn.batch_get(every, pages) == [True] * len(every)
        view = buf.view()
        for i, key in enumerate(every):
            assert view[i * PAGE : (i + 1) * PAGE] == page_pattern(key, PAGE), key
    writers = sorted(p.name for p in Path(root).glob("ns-*/writers/w*"))
    assert 1 <= len(writers) <= 3  # at most one per process alive at once; freed ones are reused


def test_capacity_bounds_disk_use(tmp_path: Path) -> None:
    stride = Geometry(PAGE).stride
    with open_connector("file", NS, root=str(tmp_path), capacity_bytes=32 * stride) as conn:
        pages = Pages(conn, PAGE, 16)
        for r in range(10):
            keys = [f"cap{r}-{i}" for i in range(16)]
            pages.fill(keys)
            assert conn.batch_set(keys, pages.pages) == [True] * 16
        stats = conn.stats()["engine"]
        assert stats["evictions"] == 160 - 32
    slabs = list(tmp_path.rglob("slab-*.dat"))
    used = sum(p.stat().st_size for p in slabs)
    # the capacity counts data area + marker record per slot; a slab's last, partial
    # group of slots has a whole group's marker table (slab/format.py)
    assert used <= 32 * stride + len(slabs) * Geometry(PAGE).table


def test_index_log_compaction_keeps_pages_and_bounds_the_log(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Under eviction the log is rewritten; other readers and a restart still see exactly the
    live pages (and deleted foreign pages stay deleted)."""
    from hicache_l3.slab import store

    monkeypatch.setattr(store, "COMPACT_MIN_BYTES", 16 << 10)
    stride = Geometry(PAGE).stride
    root = str(tmp_path)
    other = open_connector("file", NS, root=root)
    pages_o = Pages(other, PAGE, 2)
    pages_o.fill(["foreign-0", "foreign-1"])
    assert other.batch_set(["foreign-0", "foreign-1"], pages_o.pages) == [True, True]
    conn = open_connector("file", NS, root=root, capacity_bytes=16 * stride)
    reader = open_connector("file", NS, root=root)
    assert conn.delete(["foreign-0"]) == [True]
    other.close()  # the owner is gone: only conn's DEL record keeps foreign-0 deleted
    pages = Pages(conn, PAGE, 16)
    for r in range(40):
        keys = [f"c{r}-{i}" for i in range(16)]
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * 16
        assert reader.batch_exists(keys) == [True] * 16
    conn._store_for_io().wait_compaction(30)  # (compactions run on a background thread)
    assert conn.stats()["engine"]["log_compactions"] >= 1
    log = next(tmp_path.glob(f"ns-{NS.digest()}/writers/w*/index.log"))
    last = [f"c39-{i}" for i in range(16)]
    rpages = Pages(reader, PAGE, 16)
    assert reader.batch_get(last, rpages.pages) == [True] * 16
    assert all(rpages.matches(i, k) for i, k in enumerate(last))
    assert reader.batch_exists(["c0-0", "foreign-0", "foreign-1"]) == [False, False, True]
    conn.close()
    reader.close()
    sizes = [p.stat().st_size for p in tmp_path.glob(f"ns-{NS.digest()}/writers/w*/index.log")]
    assert max(sizes) < 64 << 10, sizes
    with open_connector("file", NS, root=root) as again:
        assert again.batch_exists([*last, "c0-0", "foreign-0", "foreign-1"]) == [True] * 16 + [
            False, False, True]
    assert log.exists()


def test_slab_space_is_reserved_as_it_is_used(tmp_path: Path) -> None:
    """A 256 MiB slab holding one page must not take 256 MiB of disk (it did, and filled CI's)."""
    with open_connector("file", NS, root=str(tmp_path)) as conn:
        pages = Pages(conn, PAGE, 1)
        assert conn.batch_set(["one"], pages.pages) == [True]
        slab = next(tmp_path.glob("ns-*/writers/w*/slab-*.dat"))
        assert slab.stat().st_size > 255 << 20  # the slab's full extent (whole slots) exists, sparse
        assert slab.stat().st_blocks * 512 < 1 << 20  # but only what was used is allocated
        more = Pages(conn, PAGE, 64)
        assert all(conn.batch_set([f"m{i}" for i in range(64)], more.pages))
        assert slab.stat().st_blocks * 512 >= 64 * PAGE
