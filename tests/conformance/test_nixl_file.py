"""The conformance suite on the nixl connector in file mode: NIXL's real POSIX plugin
moving pages into the shared slab store on local disk.

The backdoor reads the slabs directly (:mod:`hicache_l3.conformance.slab_backdoor`).
The settings leave ``checksum`` at its default (``auto``: xxh3), so the suite's corruption
tests check what a user gets; ``checksum=none`` is tested for its slot markers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.conformance import ConnectorTests
from hicache_l3.conformance.slab_integrity import SlabIntegrityTests
from hicache_l3.conformance.suite import Pages


class TestNixlFile(SlabIntegrityTests, ConnectorTests):
    connector_name = "nixl"

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"mode": "file", "root": str(tmp_path / "store"), "capacity_bytes": "1GiB"}

    # ---- nixl file mode specifics -------------------------------------------------------
    @pytest.mark.parametrize("engine", ["aio", "uring", "posix_aio"])
    def test_every_posix_engine_round_trips(self, open_conn: Any, engine: str) -> None:
        conn = open_conn(posix_engine=engine)
        keys = [f"eng-{engine}-{i}" for i in range(16)]
        pages = Pages(conn, self.page_bytes, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * 16
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * 16
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        assert conn.stats()["engine"]["posix_engine"] == engine

    def test_markers_move_through_the_c_library(self, conn: Any) -> None:
        assert "C batch library" in conn.transport.name

    def test_slabs_registered_once(self, conn: Any) -> None:
        pages = Pages(conn, self.page_bytes, 32)
        for r in range(4):
            keys = [f"reg{r}-{i}" for i in range(32)]
            pages.fill(keys)
            assert conn.batch_set(keys, pages.pages) == [True] * 32
            assert conn.batch_get(keys, pages.pages) == [True] * 32
        engine = conn.stats()["engine"]
        assert engine["registered_files"] == engine["slabs"] == 1

    def test_default_checksum_catches_a_bit_flipped_at_rest(self, open_conn: Any, settings: dict[str, Any],
                                                            namespace: Namespace) -> None:
        conn = open_conn()
        assert conn.config.checksum == "auto" and conn.capabilities.detects_corruption
        keys = ["bf-0", "bf-1", "bf-2"]
        pages = Pages(conn, self.page_bytes, 3)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * 3
        self.backdoor_corrupt(settings, namespace, keys[1], "flip")
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True, False, True]
        assert conn.stats()["ops"]["get"]["failed"] == {"corrupt": 1}

    def test_checksum_none_markers_still_guard(self, open_conn: Any, settings: dict[str, Any],
                                               namespace: Namespace) -> None:
        conn = open_conn(checksum="none")
        assert not conn.capabilities.detects_corruption
        keys = ["mk-0", "mk-1", "mk-2"]
        pages = Pages(conn, self.page_bytes, 3)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * 3
        self.backdoor_corrupt(settings, namespace, keys[1], "truncate")
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True, False, True]
        assert conn.stats()["ops"]["get"]["failed"] == {"corrupt": 1}

    def test_reads_pages_of_the_file_connector(self, open_conn: Any, settings: dict[str, Any],
                                               namespace: Namespace) -> None:
        from hicache_l3.common.registry import open_connector

        keys = [f"interop-{i}" for i in range(4)]
        with open_connector("file", namespace, {"root": settings["root"]}) as writer:
            wpages = Pages(writer, self.page_bytes, 4)
            wpages.fill(keys)
            assert writer.batch_set(keys, wpages.pages) == [True] * 4
        conn = open_conn(checksum="auto")
        pages = Pages(conn, self.page_bytes, 4)
        assert conn.batch_get(keys, pages.pages) == [True] * 4
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
