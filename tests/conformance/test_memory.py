"""The conformance suite on the reference ``memory`` connector (pages in a dict of this
process). Its backdoor is the dict itself (:func:`~hicache_l3.connectors.memory.stored_pages`).
It declares none of the optional capabilities, so the suite checks that pages are gone
after the last connector closes and skips corruption, second-process and eviction tests."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.conformance import ConnectorTests
from hicache_l3.connectors.memory import stored_pages


class TestMemoryConnector(ConnectorTests):
    connector_name = "memory"

    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        return {"store": f"conformance-{uuid.uuid4().hex[:8]}"}

    def backdoor_read(self, settings: dict[str, Any], namespace: Namespace, key: str) -> bytes | None:
        pages = stored_pages(settings["store"], namespace)
        return None if pages is None else pages.get(key)

    def backdoor_corrupt(self, settings: dict[str, Any], namespace: Namespace, key: str,
                         how: str) -> None:
        pages = stored_pages(settings["store"], namespace)
        assert pages is not None and key in pages
        value = pages[key]
        pages[key] = value[:-1] if how == "truncate" else bytes([value[0] ^ 0xFF]) + value[1:]

    # ---- memory-specific -------------------------------------------------------------------
    def test_stores_are_separate(self, open_conn: Any, namespace: Namespace) -> None:
        from hicache_l3.conformance.suite import Pages

        first = open_conn()
        other = open_conn(store="another-store")
        pages = Pages(first, self.page_bytes, 1)
        assert first.batch_set(["k"], pages.pages) == [True]
        assert other.batch_exists(["k"]) == [False]

    def test_pages_are_dropped_with_the_last_connector(self, open_conn: Any, settings: dict[str, Any],
                                                       namespace: Namespace) -> None:
        from hicache_l3.conformance.suite import Pages

        first, second = open_conn(), open_conn()
        pages = Pages(first, self.page_bytes, 1)
        assert first.batch_set(["k"], pages.pages) == [True]
        first.close()
        assert second.batch_exists(["k"]) == [True]
        second.close()
        assert stored_pages(settings["store"], namespace) is None

    def backdoor_write(self, settings: dict[str, Any], namespace: Namespace, key: str,
                       stored: bytes) -> None:
        pages = stored_pages(settings["store"], namespace)
        assert pages is not None
        pages[key] = stored
