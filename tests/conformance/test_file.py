"""The conformance suite on the file connector: slab store on local disk, and the
fsspec path through fsspec's real ``file://`` implementation."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.conformance import ConnectorTests
from hicache_l3.conformance.slab_integrity import SlabIntegrityTests
from hicache_l3.slab.format import MARKER, read_namespace_file


class TestFileConnector(SlabIntegrityTests, ConnectorTests):
    connector_name = "file"

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "store"), "capacity_bytes": "1GiB"}

    # ---- file-specific -------------------------------------------------------------------
    def test_hostile_keys_create_nothing_outside_root(self, open_conn: Any, tmp_path: Path) -> None:
        from hicache_l3.conformance.suite import HOSTILE_KEYS, Pages

        conn = open_conn()
        pages = Pages(conn, self.page_bytes, len(HOSTILE_KEYS))
        conn.batch_set(HOSTILE_KEYS, pages.pages)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["store"]
        names = {p.name for p in (tmp_path / "store").rglob("*")}
        assert not any("passwd" in n for n in names)

    def test_few_files_for_many_pages(self, open_conn: Any, tmp_path: Path) -> None:
        from hicache_l3.conformance.suite import Pages

        conn = open_conn()
        keys = [f"many-{i}" for i in range(2000)]
        pages = Pages(conn, self.page_bytes, len(keys))
        assert all(conn.batch_set(keys, pages.pages))
        files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
        assert len(files) <= 6, files

    def test_restart_reuses_writer_slabs(self, open_conn: Any, tmp_path: Path) -> None:
        from hicache_l3.conformance.suite import Pages

        for round_ in range(3):
            conn = open_conn()
            keys = [f"r{round_}-{i}" for i in range(4)]
            pages = Pages(conn, self.page_bytes, 4)
            assert all(conn.batch_set(keys, pages.pages))
            conn.close()
        writers = list((tmp_path / "store").glob("ns-*/writers/w*"))
        assert len(writers) == 1, writers

    def test_stale_slot_after_reuse_is_a_miss(self, open_conn: Any) -> None:
        """A reader whose index still points at a reused slot must not get the new bytes."""
        from hicache_l3.conformance.suite import Pages

        writer = open_conn(**self.eviction_settings({}, 2))
        reader = open_conn()
        pages = Pages(writer, self.page_bytes, 4)
        keys = ["old-0", "old-1", "new-0", "new-1"]
        pages.fill(keys)
        assert writer.batch_set(keys[:2], pages.pages[:2]) == [True, True]
        assert reader.batch_exists(keys[:2]) == [True, True]  # reader indexed the old slots
        rpages = Pages(reader, self.page_bytes, 2)
        store = reader._store  # freeze the reader's index: it does not see the reuse yet
        assert store is not None
        frozen = store.index.table.export()
        assert writer.batch_set(keys[2:], pages.pages[2:]) == [True, True]  # evicts old-*
        store.index.table.load(*frozen)  # the stale pages back in their slots
        store.refresh = lambda: None  # type: ignore[method-assign]
        assert reader.batch_get(keys[:2], rpages.pages) == [False, False]
        assert reader.stats()["ops"]["get"]["failed"] == {"corrupt": 2}

    def test_torn_log_tail_is_ignored_and_repaired(self, open_conn: Any, tmp_path: Path) -> None:
        from hicache_l3.conformance.suite import Pages

        conn = open_conn()
        pages = Pages(conn, self.page_bytes, 2)
        pages.fill(["t0", "t1"])
        assert conn.batch_set(["t0", "t1"], pages.pages) == [True, True]
        conn.close()
        log = next((tmp_path / "store").glob("ns-*/writers/w*/index.log"))
        with open(log, "ab") as f:  # a crashed writer's half record
            f.write(struct.pack("<I", 123) + b"\x01\x00\x20")
        again = open_conn()
        assert again.batch_exists(["t0", "t1"]) == [True, True]
        pages2 = Pages(again, self.page_bytes, 1)
        pages2.fill(["t2"])
        assert again.batch_set(["t2"], pages2.pages) == [True]
        third = open_conn()
        assert third.batch_exists(["t0", "t1", "t2"]) == [True, True, True]

    def test_page_size_is_pinned_per_namespace(self, open_conn: Any, namespace: Namespace) -> None:
        from hicache_l3.common.errors import ConfigError

        conn = open_conn()
        from hicache_l3.conformance.suite import Pages

        Pages(conn, self.page_bytes, 1)
        pages = Pages(conn, self.page_bytes, 1)
        assert conn.batch_set(["pin"], pages.pages) == [True]
        with pytest.raises(ConfigError, match="page_bytes differs"):
            open_conn(page_bytes=self.page_bytes * 2)

    def test_namespace_file_records_the_namespace(self, conn: Any, tmp_path: Path,
                                                  namespace: Namespace) -> None:
        from hicache_l3.conformance.suite import Pages

        pages = Pages(conn, self.page_bytes, 1)
        conn.batch_set(["nsfile"], pages.pages)
        meta = read_namespace_file(tmp_path / "store" / f"ns-{namespace.digest()}")
        assert meta["namespace"]["kv_dtype"] == namespace.kv_dtype
        assert meta["slot_bytes"] == self.page_bytes


class TestFileDirectBlocking(TestFileConnector):
    """The same suite with ``o_direct=true`` and no ring: pages move by blocking C calls,
    aligned data through the slab's O_DIRECT descriptor."""

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "store"), "capacity_bytes": "1GiB", "o_direct": True,
                "io_uring_depth": 0}


class TestFileUringDirect(TestFileConnector):
    """The same suite with ``o_direct=true``, whose pages move through io_uring (the C ring:
    each page's marker read linked after its data, every marker written before the data)."""

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "store"), "capacity_bytes": "1GiB", "o_direct": True,
                "io_uring_depth": 8}

    def test_pages_move_through_the_ring(self, open_conn: Any) -> None:
        from hicache_l3.conformance.suite import Pages

        conn = open_conn()
        assert conn.transport.name == "io_uring O_DIRECT (C)"
        keys = [f"ring-{i}" for i in range(40)]  # more pages than the ring's depth
        pages = Pages(conn, self.page_bytes, len(keys))
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        counters = conn.stats()["ops"]["counters"]
        assert counters.get("direct_fallback", 0) == 0 and counters["io_uring_pages"] == 2 * len(keys)


class TestFileFsspec(ConnectorTests):
    """The copying fsspec path, run on fsspec's real local (``file://``) filesystem."""

    connector_name = "file"

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": f"file://{tmp_path}/fs-store", "io_threads": 2}

    def _path(self, settings: dict[str, Any], namespace: Namespace, key: str) -> Path:
        from hicache_l3.common.integrity import key_fingerprint

        base = Path(settings["root"].removeprefix("file://")) / f"ns-{namespace.digest()}"
        return base / key_fingerprint(key).hex()[:2] / f"{key}.page"

    def backdoor_read(self, settings: dict[str, Any], namespace: Namespace, key: str) -> bytes | None:
        path = self._path(settings, namespace, key)
        return path.read_bytes()[MARKER:] if path.exists() else None

    def backdoor_corrupt(self, settings: dict[str, Any], namespace: Namespace, key: str,
                         how: str) -> None:
        path = self._path(settings, namespace, key)
        data = bytearray(path.read_bytes())
        if how == "flip":
            data[len(data) // 2] ^= 0xFF
        else:
            data = data[: len(data) - 100]
        path.write_bytes(bytes(data))

    def backdoor_write(self, settings: dict[str, Any], namespace: Namespace, key: str,
                       stored: bytes) -> None:
        from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
        from hicache_l3.slab.format import encode_start

        head = encode_start(0, len(stored), buffer_checksum([stored]), key_fingerprint(key))
        self._path(settings, namespace, key).write_bytes(head + stored)
