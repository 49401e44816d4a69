"""The conformance suite on the hf3fs connector, three times: POSIX-mount mode on a local
directory; USRBIO mode through the named test double of ``hf3fs_fuse.io`` with pages in
ordinary memory (one staging copy); and USRBIO mode with pages in shared memory
(zero-copy). What several nodes sharing one mount need is in tests/hf3fs/test_hf3fs_nodes.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.conformance import ConnectorTests
from hicache_l3.conformance import pages as pages_module
from hicache_l3.conformance import suite as suite_module
from hicache_l3.conformance.pages import Pages
from hicache_l3.conformance.slab_integrity import SlabIntegrityTests
from hicache_l3.connectors.hf3fs import SharedHostBuffer
from hicache_l3.slab.format import Geometry

REPO = Path(__file__).resolve().parents[2]
DOUBLE = "tests.doubles.hf3fs_usrbio_double"
PAGE = 16 << 10


class Hf3fsBackdoor(SlabIntegrityTests):
    """Backdoor reads and damage for the hf3fs slab layout."""

    def eviction_settings(self, settings: dict[str, Any], capacity_pages: int) -> dict[str, Any]:
        stride = Geometry(PAGE).stride
        return {**settings, "capacity_bytes": capacity_pages * stride, "max_writers": 1}


class TestHf3fsPosix(Hf3fsBackdoor, ConnectorTests):
    """POSIX-mount mode on a local directory (what runs for real here)."""

    connector_name = "hf3fs"
    page_bytes = PAGE

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "store"), "capacity_bytes": "1GiB", "usrbio": "off"}

    def test_mode_is_posix(self, conn: Any) -> None:
        assert conn.mode == "posix"
        assert conn.stats()["engine"]["mode"] == "posix"


class TestHf3fsUsrbioStaged(TestHf3fsPosix):
    """USRBIO mode through the test double, pages in ordinary memory: one copy each."""

    @pytest.fixture
    def settings(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
        from tests.doubles.hf3fs_usrbio_double import make_test_mount

        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        mount = make_test_mount(str(tmp_path / "mnt"))
        return {"root": f"{mount}/store", "capacity_bytes": "1GiB", "usrbio": "on",
                "usrbio_module": DOUBLE, "usrbio_entries": 32, "usrbio_staging_bytes": "256KiB"}

    expect_zero_copy = False

    def test_mode_is_posix(self, conn: Any) -> None:  # the inherited check, inverted
        assert conn.mode == "usrbio"

    def test_pages_move_through_the_rings(self, conn: Any) -> None:
        from tests.doubles import hf3fs_usrbio_double as double

        before = dict(double.STATS)
        keys = [f"ring-{i}" for i in range(40)]  # more than one ring round
        pages = Pages(conn, self.page_bytes, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        assert double.STATS["ios"] - before["ios"] >= 4 * len(keys)
        assert double.STATS["bytes"] - before["bytes"] >= 2 * len(keys) * self.page_bytes
        counters = conn.stats()["ops"]["counters"]
        if self.expect_zero_copy:
            assert counters.get("usrbio_zero_copy") == 2 * len(keys)
            assert "usrbio_staged" not in counters or counters["usrbio_staged"] == 0
        else:
            assert counters.get("usrbio_staged") == 2 * len(keys)

    def test_posix_and_usrbio_read_each_other(self, open_conn: Any) -> None:
        usrbio = open_conn()
        posix = open_conn(usrbio="off")
        a, b = ["from-usrbio-0", "from-usrbio-1"], ["from-posix-0", "from-posix-1"]
        pa, pb = Pages(usrbio, self.page_bytes, 2), Pages(posix, self.page_bytes, 2)
        pa.fill(a)
        pb.fill(b)
        assert usrbio.batch_set(a, pa.pages) == [True, True]
        assert posix.batch_set(b, pb.pages) == [True, True]
        pa.wipe()
        pb.wipe()
        assert usrbio.batch_get(b, pa.pages) == [True, True]
        assert posix.batch_get(a, pb.pages) == [True, True]
        assert all(pa.matches(i, k) for i, k in enumerate(b))
        assert all(pb.matches(i, k) for i, k in enumerate(a))


class TestHf3fsUsrbioZeroCopy(TestHf3fsUsrbioStaged):
    """USRBIO mode with every suite buffer in shared memory: pages move zero-copy."""

    expect_zero_copy = True

    @pytest.fixture(autouse=True)
    def _shared_buffers(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(suite_module, "HostBuffer", SharedHostBuffer)
        monkeypatch.setattr(pages_module, "HostBuffer", SharedHostBuffer)  # the suite's Pages
