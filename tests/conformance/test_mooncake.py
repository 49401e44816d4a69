"""The conformance suite on the Mooncake connector, against a real ``mooncake_master``
(embedded HTTP metadata server) and a ``mooncake_client`` segment holder started here.

The connector holds no segment (``global_segment_size=0``): pages live in the holder, so
they outlive the connector (declared ``persistent``). The backdoor is a second, raw
``MooncakeDistributedStore`` client of the same master: it reads objects by storage key
(``namespace.storage_key(key)``) and damages them by replacing the object.

Two classes: the default settings (which declare neither ``detects_corruption`` nor
``evicts``, so the suite skips those two tests there), and ``checksum="xxh3"`` with
``capacity_bytes`` set, where every test of the suite runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.conformance import ConnectorTests
from hicache_l3.conformance.plugin import engine_launcher
from hicache_l3.engines import MooncakeEngine

TRAILER_BYTES = 32  # hicache_l3.connectors.mooncake.TRAILER.size


@pytest.fixture(scope="module")
def engine(request: pytest.FixtureRequest) -> Iterator[MooncakeEngine]:
    """master + 1 GB segment holder, for the whole module (processes or containers: --engines)."""
    with engine_launcher(request.config, "mooncake")(holder=True, segment_size="1 GB") as eng:
        yield eng  # type: ignore[misc]


@pytest.fixture(scope="module")
def raw(engine: MooncakeEngine) -> Iterator[Any]:
    """The backdoor: a raw Mooncake client of the same master (no segment of its own)."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", engine.metadata_server, 0, 64 << 20, "tcp", "",
                     engine.master_address)
    assert rc == 0, f"backdoor client setup failed: {rc}"
    yield store
    store.close()


class TestMooncakeConnector(ConnectorTests):
    stateful_kills = True
    connector_name = "mooncake"
    trailer = 0

    @pytest.fixture
    def settings(self, engine: MooncakeEngine, raw: Any) -> dict[str, Any]:
        self.raw = raw
        return dict(engine.settings)

    def backdoor_read(self, settings: dict[str, Any], namespace: Namespace, key: str) -> bytes | None:
        skey = namespace.storage_key(key)
        if self.raw.is_exist(skey) != 1:
            return None
        data: bytes = self.raw.get(skey)
        return data[: len(data) - self.trailer] if self.trailer else data

    def backdoor_corrupt(self, settings: dict[str, Any], namespace: Namespace, key: str,
                         how: str) -> None:
        skey = namespace.storage_key(key)
        data = bytearray(self.raw.get(skey))
        assert len(data) <= self.page_bytes + self.trailer
        if how == "flip":
            data[(len(data) - self.trailer) // 2] ^= 0xFF
        else:
            data = data[: len(data) - 100]
        assert self.raw.remove(skey, True) == 0
        assert self.raw.put(skey, bytes(data)) == 0


    def backdoor_write(self, settings: dict[str, Any], namespace: Namespace, key: str,
                       stored: bytes) -> None:
        from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
        from hicache_l3.connectors.mooncake import TRAILER, TRAILER_MAGIC

        skey = namespace.storage_key(key)
        if self.trailer:
            stored += TRAILER.pack(TRAILER_MAGIC, len(stored), buffer_checksum([stored]),
                                   key_fingerprint(skey)[:8])
        assert self.raw.remove(skey, True) == 0
        assert self.raw.put(skey, stored) == 0

    def eviction_settings(self, settings: dict[str, Any], capacity_pages: int) -> dict[str, Any]:
        return {**settings, "capacity_bytes": capacity_pages * self.page_bytes}


class TestMooncakeChecksumCapacity(TestMooncakeConnector):
    """The same suite with every optional capability declared: ``checksum="xxh3"`` (a
    trailer with the page's checksum: ``detects_corruption``) and ``capacity_bytes``
    (the connector bounds its own pages: ``evicts``). Nothing is skipped here."""

    trailer = TRAILER_BYTES

    @pytest.fixture
    def settings(self, engine: MooncakeEngine, raw: Any) -> dict[str, Any]:
        self.raw = raw
        return {**engine.settings, "checksum": "xxh3", "capacity_bytes": "256MiB"}
