"""Test pages: a registered host buffer cut into pages, and the bytes a key's page holds."""

from __future__ import annotations

import hashlib
from typing import Any

from hicache_l3.common.connector import Connector
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page, contiguous_pages


def page_pattern(key: str, nbytes: int) -> bytes:
    """Deterministic bytes of a page stored under ``key`` (differs for every key)."""
    return hashlib.shake_128(key.encode()).digest(nbytes)


class Pages:
    """A host buffer registered with a connector, cut into pages, with helpers."""

    def __init__(self, conn: Connector[Any], page_bytes: int, count: int) -> None:
        self.page_bytes = page_bytes
        self.buffer = HostBuffer(max(1, count) * page_bytes)
        self.view = self.buffer.view()
        conn.register(self.buffer)
        self.pages: list[Page] = contiguous_pages(self.buffer.address, page_bytes, range(count))

    def fill(self, keys: list[str]) -> None:
        """Write each key's pattern into the page of the same index."""
        pb = self.page_bytes
        for i, key in enumerate(keys):
            self.view[i * pb : (i + 1) * pb] = page_pattern(key, pb)

    def fill_at(self, indices: list[int], keys: list[str]) -> None:
        """Write ``keys[j]``'s pattern into page ``indices[j]``."""
        pb = self.page_bytes
        for i, key in zip(indices, keys):
            self.view[i * pb : (i + 1) * pb] = page_pattern(key, pb)

    def wipe(self) -> None:
        """Zero the whole buffer."""
        self.view[:] = bytes(len(self.view))

    def matches(self, i: int, key: str) -> bool:
        """True when page ``i`` holds ``key``'s pattern."""
        pb = self.page_bytes
        return self.view[i * pb : (i + 1) * pb] == page_pattern(key, pb)
