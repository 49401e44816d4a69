"""Test pages: a registered host buffer cut into pages, and the bytes a key's page holds."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from hicache_l3.common.connector import Connector
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page, contiguous_pages, strided_pages

Pattern = Callable[[str, int], bytes]


def page_pattern(key: str, nbytes: int) -> bytes:
    """Deterministic bytes of a page stored under ``key`` (differs for every key)."""
    return hashlib.shake_128(key.encode()).digest(nbytes)


def numbered_keys(prefix: str, n: int) -> list[str]:
    """``n`` distinct keys starting with ``prefix``."""
    return [f"{prefix}-{i:06d}" for i in range(n)]


class Pages:
    """A host buffer registered with a connector, cut into ``count`` pages of ``page_bytes``."""

    def __init__(self, conn: Connector[Any], page_bytes: int, count: int) -> None:
        self.page_bytes = page_bytes
        self.buffer = HostBuffer(max(1, count) * page_bytes)
        self.view = self.buffer.view()
        conn.register(self.buffer)
        self.pages: list[Page] = contiguous_pages(self.buffer.address, page_bytes, range(count))

    def page(self, i: int) -> bytes:
        """The bytes page ``i`` holds now."""
        return bytes(self.view[i * self.page_bytes : (i + 1) * self.page_bytes])

    def fill(self, keys: list[str], pattern: Pattern = page_pattern) -> None:
        """Write each key's pattern into the page of the same index."""
        self.fill_at(list(range(len(keys))), keys, pattern)

    def fill_at(self, indices: list[int], keys: list[str], pattern: Pattern = page_pattern) -> None:
        """Write ``keys[j]``'s pattern into page ``indices[j]``."""
        pb = self.page_bytes
        for i, key in zip(indices, keys):
            self.view[i * pb : (i + 1) * pb] = pattern(key, pb)

    def wipe(self) -> None:
        """Zero the whole buffer."""
        self.view[:] = bytes(len(self.view))

    def matches(self, i: int, key: str, pattern: Pattern = page_pattern) -> bool:
        """True when page ``i`` holds ``key``'s pattern."""
        return self.page(i) == pattern(key, self.page_bytes)

    def holds(self, keys: list[str], pattern: Pattern = page_pattern) -> bool:
        """True when every page ``i`` holds ``keys[i]``'s pattern."""
        return all(self.matches(i, k, pattern) for i, k in enumerate(keys))


def store_pages(conn: Connector[Any], page_bytes: int, keys: list[str],
                pattern: Pattern = page_pattern) -> Pages:
    """New pages holding ``keys``' patterns, set on ``conn``; asserts every set is True."""
    pages = Pages(conn, page_bytes, len(keys))
    pages.fill(keys, pattern)
    assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
    return pages


def strided_roundtrip(conn: Connector[Any], page_bytes: int, keys: list[str],
                      pattern: Pattern = page_pattern, segments: int = 4) -> None:
    """Set and get ``keys`` as pages of ``segments`` strided segments each (a layer-first
    layout); asserts every op is True and every page reads back exactly."""
    count, seg = len(keys), page_bytes // segments
    stride = count * seg
    buf = HostBuffer(segments * stride)
    conn.register(buf)
    pages = strided_pages(buf.address, seg, segments, stride, range(count))
    view = buf.view()
    for i, key in enumerate(keys):
        data = pattern(key, page_bytes)
        for j in range(segments):
            view[j * stride + i * seg : j * stride + (i + 1) * seg] = data[j * seg : (j + 1) * seg]
    assert conn.batch_set(keys, pages) == [True] * count
    view[:] = bytes(len(view))
    assert conn.batch_get(keys, pages) == [True] * count
    for i, key in enumerate(keys):
        got = b"".join(view[j * stride + i * seg : j * stride + (i + 1) * seg] for j in range(segments))
        assert got == pattern(key, page_bytes), key
