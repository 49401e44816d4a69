"""``o_direct=auto``: the page cache a process may use (machine memory, memory cgroups v1
and v2), the rule, and the file connector moving to O_DIRECT once the page size is known."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.common.errors import ConfigError
from hicache_l3.conformance.pages import Pages
from hicache_l3.connectors import file as file_connector
from hicache_l3.slab.auto_direct import (
    AUTO_PAGE_BYTES,
    AUTO_STORE_RATIO,
    choose_o_direct,
    memory_total,
    page_cache_bytes,
)

GiB = 1 << 30
NS = Namespace(model="auto/m", kv_dtype="bfloat16", layout="page_first", page_size=16)


def _proc(tmp_path: Path, cgroup: str, mem_kib: int = 16 << 20) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal:       {mem_kib} kB\nMemFree: 1 kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    return proc


def _limit(path: Path, name: str, value: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / name).write_text(value + "\n")


def test_memory_total_reads_meminfo(tmp_path: Path) -> None:
    assert memory_total(_proc(tmp_path, "", mem_kib=1024)) == 1 << 20


def test_page_cache_is_the_machines_memory_without_a_limit(tmp_path: Path) -> None:
    cgroups = tmp_path / "cg"
    _limit(cgroups / "job", "memory.max", "max")
    _limit(cgroups / "memory" / "job", "memory.limit_in_bytes", str(1 << 62))
    proc = _proc(tmp_path, "0::/job\n4:memory:/job\n3:cpu,cpuacct:/job\nbroken line\n")
    assert page_cache_bytes(proc, cgroups) == 16 * GiB


@pytest.mark.parametrize("v2", [True, False])
def test_page_cache_is_the_lowest_limit_of_the_cgroup_or_one_above(tmp_path: Path, v2: bool) -> None:
    cgroups = tmp_path / "cg"
    base, name = (cgroups, "memory.max") if v2 else (cgroups / "memory", "memory.limit_in_bytes")
    _limit(base / "pod", name, str(2 * GiB))
    _limit(base / "pod" / "job", name, "max" if v2 else str(1 << 62))
    line = "0::/pod/job\n" if v2 else "7:memory,hugetlb:/pod/job\n"
    assert page_cache_bytes(_proc(tmp_path, line), cgroups) == 2 * GiB
    _limit(base / "pod" / "job", name, str(GiB // 2))
    assert page_cache_bytes(_proc(tmp_path / "again", line), cgroups) == GiB // 2


def test_rule_takes_large_pages_in_a_store_many_times_the_page_cache() -> None:
    cache = 4 * GiB
    assert choose_o_direct(AUTO_PAGE_BYTES, AUTO_STORE_RATIO * cache, cache)
    assert not choose_o_direct(AUTO_PAGE_BYTES // 2, 100 * cache, cache)
    assert not choose_o_direct(AUTO_PAGE_BYTES, AUTO_STORE_RATIO * cache - 1, cache)


@pytest.mark.parametrize("page, setting, direct", [
    (1 << 20, "auto", True),  # a store 4x the page cache
    (64 << 10, "auto", False),  # small pages: buffered
    (1 << 20, "false", False),
    (1 << 20, False, False),
])
def test_file_connector_chooses_o_direct_by_the_page_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           page: int, setting: object, direct: bool) -> None:
    monkeypatch.setattr(file_connector, "page_cache_bytes", lambda: 64 << 20)
    with open_connector("file", NS, root=str(tmp_path), capacity_bytes=256 << 20, o_direct=setting) as conn:
        assert "O_DIRECT" not in conn.stats()["engine"]["io_path"]  # no page size known yet
        keys = [f"a{i}" for i in range(4)]
        pages = Pages(conn, page, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        assert ("O_DIRECT" in conn.stats()["engine"]["io_path"]) is direct


def test_auto_stays_buffered_where_the_store_fits_the_page_cache(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_connector, "page_cache_bytes", lambda: 128 << 20)
    with open_connector("file", NS, root=str(tmp_path), capacity_bytes=256 << 20) as conn:
        pages = Pages(conn, 1 << 20, 1)
        pages.fill(["k"])
        assert conn.batch_set(["k"], pages.pages) == [True]
        assert "O_DIRECT" not in conn.stats()["engine"]["io_path"]


def test_auto_stays_buffered_where_the_filesystem_refuses_o_direct(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(root: Path) -> None:
        raise ConfigError(f"the filesystem of {root} refuses O_DIRECT")

    monkeypatch.setattr(file_connector, "page_cache_bytes", lambda: 64 << 20)
    monkeypatch.setattr(file_connector, "_probe_o_direct", refuse)
    with open_connector("file", NS, root=str(tmp_path), capacity_bytes=256 << 20) as conn:
        pages = Pages(conn, 1 << 20, 1)
        pages.fill(["k"])
        assert conn.batch_set(["k"], pages.pages) == [True]
        assert "O_DIRECT" not in conn.stats()["engine"]["io_path"]
