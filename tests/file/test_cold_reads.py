"""Pages that are not in the page cache (a store bigger than memory, the usual L3 case): a
get reads what the cache holds in its own calls (``hl3_read_plan_nowait``) and the rest on
the cold pool, many at once (``cold_read_threads``), so that the disk sees a queue of them
instead of one or two. The bytes and verdicts are exactly a warm read's: a damaged page
read cold is a miss, never its bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_l3 import Namespace, open_connector
from hicache_l3.bench.runner import drop_page_cache
from hicache_l3.conformance.pages import Pages
from hicache_l3.conformance.slab_backdoor import SlabBackdoor

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
