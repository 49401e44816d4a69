"""``CompressionTests``: the ``compression`` setting's behaviour, mixed into every
connector's suite. A connector that does not declare ``compresses`` must refuse
``compression="zstd"`` with a ConfigError naming the setting (each test checks that
instead). Hostile frames are written at rest inside the connector's own envelope, so the
frame decoder itself must refuse them: a ``corrupt`` miss, nothing written outside the page.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, ClassVar

import pytest
import zstandard

from hicache_l3.common.compression import FRAME, FRAME_MAGIC, HIGH_PLANE, WHOLE
from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page
from hicache_l3.conformance.pages import Pages, page_pattern, store_pages, strided_roundtrip


def kv_pattern(key: str, nbytes: int) -> bytes:
    """Deterministic bf16-like bytes of ``key``'s page: random low bytes, high bytes of
    four values (compressible like real KV)."""
    raw = bytearray(hashlib.shake_128(b"kv" + key.encode()).digest(nbytes))
    raw[1::2] = bytes(0x3C + (b & 3) for b in raw[1::2])
    return bytes(raw)


def hostile_frames(page_bytes: int) -> dict[str, bytes]:
    """Frames (shorter than the page, starting with the magic) that must read as corrupt."""
    half = page_bytes // 2
    good = kv_pattern("hostile", page_bytes)
    cctx = zstandard.ZstdCompressor(level=1)

    def head(raw: int, transform: int = WHOLE, codec: int = 1, pad: int = 0) -> bytes:
        return FRAME.pack(FRAME_MAGIC, codec, transform, pad, raw)

    whole = cctx.compress(good)
    return {
        "header only": head(page_bytes),
        "another raw length": head(half) + cctx.compress(good[:half]),
        "decompresses to more than the page": head(page_bytes) + cctx.compress(bytes(4 * page_bytes)),
        "more than the page, size not declared": head(page_bytes) + zstandard.ZstdCompressor(
            write_content_size=False).compress(bytes(4 * page_bytes)),
        "decompresses to less than the page": head(page_bytes) + cctx.compress(bytes(half)),
        "truncated": (head(page_bytes) + whole)[:-7],
        "trailing bytes": head(page_bytes) + whole + b"\0" * 8,
        "two frames": head(page_bytes) + cctx.compress(good[:half]) + cctx.compress(good[half:]),
        "garbage body": head(page_bytes) + hashlib.shake_128(b"g").digest(half),
        "unknown codec": head(page_bytes, codec=9) + whole,
        "unknown transform": head(page_bytes, transform=7) + whole,
        "padding not zero": head(page_bytes, pad=8) + whole + b"\x01" * 8,
        "padding that eats the body's end": head(page_bytes, pad=1) + whole,
        "padding longer than the frame": head(page_bytes, pad=0xFFFF) + whole,
        "plane frame, low plane short": head(page_bytes, HIGH_PLANE) + good[:100],
        "plane frame, high plane of another size": head(page_bytes, HIGH_PLANE) + good[0::2]
        + cctx.compress(bytes(half + 2)),
    }


class CompressionTests:
    """The ``compression`` setting's tests; mixed into ``ConnectorTests``."""

    page_bytes: ClassVar[int]
    backdoor_read: Callable[[dict[str, Any], Namespace, str], bytes | None]
    backdoor_corrupt: Callable[[dict[str, Any], Namespace, str, str], None]

    def backdoor_write(self, settings: dict[str, Any], namespace: Namespace, key: str,
                       stored: bytes) -> None:
        """Make ``stored`` the bytes at rest of ``key``'s page, inside the connector's own
        envelope (header, checksum over ``stored``), without the connector."""
        raise NotImplementedError

    def backdoor_write_many(self, settings: dict[str, Any], namespace: Namespace,
                            stored: dict[str, bytes]) -> None:
        """:meth:`backdoor_write` of each ``key -> bytes`` (override to do it at once)."""
        for key, data in stored.items():
            self.backdoor_write(settings, namespace, key, data)

    @staticmethod
    def _compressing(open_conn: Any) -> Connector[Any] | None:
        """A connector with ``compression="zstd"``; None (after asserting it refuses the
        setting) for one that does not declare ``compresses``."""
        if not open_conn().capabilities.compresses:
            with pytest.raises(ConfigError, match="compression"):
                open_conn(compression="zstd")
            return None
        conn: Connector[Any] = open_conn(compression="zstd")
        return conn

    @pytest.fixture
    def zconn(self, open_conn: Any) -> Connector[Any] | None:
        """:meth:`_compressing`'s connector."""
        return self._compressing(open_conn)

    def test_compression_stores_kv_pages_shorter(self, zconn: Connector[Any] | None, settings: dict[str, Any],
                                                namespace: Namespace) -> None:
        if zconn is None:
            return
        keys = [f"z-{i}" for i in range(6)]
        pages = store_pages(zconn, self.page_bytes, keys, kv_pattern)
        for key in keys:
            stored = self.backdoor_read(settings, namespace, key)
            assert stored is not None and stored[:4] == FRAME_MAGIC
            assert len(stored) < self.page_bytes * 0.8, len(stored)
        pages.wipe()
        assert zconn.batch_get(keys, pages.pages) == [True] * len(keys)
        assert pages.holds(keys, kv_pattern)

    def test_compression_incompressible_page_is_stored_raw(self, zconn: Connector[Any] | None,
                                                           settings: dict[str, Any],
                                                           namespace: Namespace) -> None:
        if zconn is None:
            return
        keys = ["rnd-0", "rnd-1"]
        pages = store_pages(zconn, self.page_bytes, keys)  # random bytes
        for key in keys:
            assert self.backdoor_read(settings, namespace, key) == page_pattern(key, self.page_bytes)
        pages.wipe()
        assert zconn.batch_get(keys, pages.pages) == [True, True]
        assert pages.holds(keys)

    def test_compression_mixed_store_read_by_either_setting(self, open_conn: Any) -> None:
        packed = self._compressing(open_conn)
        if packed is None:
            return
        plain = open_conn(compression="none")
        raw_keys, z_keys = [f"raw-{i}" for i in range(4)], [f"zst-{i}" for i in range(4)]
        store_pages(plain, self.page_bytes, raw_keys, kv_pattern)
        store_pages(packed, self.page_bytes, z_keys, kv_pattern)
        keys = [k for pair in zip(raw_keys, z_keys) for k in pair]
        for reader in (plain, packed, open_conn(compression="none")):
            pages = Pages(reader, self.page_bytes, len(keys))
            assert reader.batch_get(keys, pages.pages) == [True] * len(keys)
            assert pages.holds(keys, kv_pattern), reader

    def test_compression_multi_segment_pages(self, zconn: Connector[Any] | None) -> None:
        if zconn is not None:
            strided_roundtrip(zconn, self.page_bytes, [f"zms-{i}" for i in range(4)], kv_pattern)

    def test_compression_unregistered_memory_is_refused_per_key(self, zconn: Connector[Any] | None) -> None:
        if zconn is None:
            return
        keys = ["zu-0", "zu-1"]
        pages = store_pages(zconn, self.page_bytes, keys, kv_pattern)
        stray = HostBuffer(self.page_bytes)  # never registered
        stray.view()[:] = kv_pattern("zu-x", self.page_bytes)
        bad: Page = ((stray.address, self.page_bytes),)
        pages.fill(["zu-0-new"], kv_pattern)
        assert zconn.batch_set(["zu-x", "zu-0-new"], [bad, pages.pages[0]]) == [False, True]
        assert zconn.batch_exists(["zu-x", "zu-0-new"]) == [False, True]
        assert zconn.batch_get([keys[1], "zu-0-new"], [bad, pages.pages[1]]) == [False, True]
        assert pages.matches(1, "zu-0-new", kv_pattern)

    def test_hostile_frames_are_corrupt_misses(self, open_conn: Any, settings: dict[str, Any],
                                               namespace: Namespace) -> None:
        if self._compressing(open_conn) is None:
            return
        frames = hostile_frames(self.page_bytes)
        for setting in ("none", "zstd"):
            conn = open_conn(compression=setting)
            keys = [f"hf-{setting}-{i}" for i in range(len(frames))]
            store_pages(conn, self.page_bytes, keys, kv_pattern)  # then their bytes at rest are replaced
            assert all(len(stored) < self.page_bytes for stored in frames.values())
            self.backdoor_write_many(settings, namespace, dict(zip(keys, frames.values())))
            # every other page of the buffer is a guard that must stay untouched
            pages = Pages(conn, self.page_bytes, 2 * len(keys) + 1)
            guard = b"\xa5" * self.page_bytes
            pages.view[:] = guard * (2 * len(keys) + 1)
            before = conn.stats()["ops"]["get"]["failed"].get("corrupt", 0)
            got = conn.batch_get(keys, pages.pages[1::2])
            assert got == [False] * len(keys), dict(zip(frames, got))
            assert conn.stats()["ops"]["get"]["failed"].get("corrupt", 0) - before == len(keys)
            for i in range(0, 2 * len(keys) + 1, 2):
                assert pages.page(i) == guard, f"guard page {i} written"

    def test_compressed_page_truncated_or_flipped_is_a_miss(self, open_conn: Any,
                                                           settings: dict[str, Any],
                                                           namespace: Namespace) -> None:
        conn = self._compressing(open_conn)
        if conn is None:
            return
        hows = ["truncate", "flip"] if conn.capabilities.detects_corruption else ["truncate"]
        for how in hows:
            keys = [f"zt-{how}-{i}" for i in range(3)]
            pages = store_pages(conn, self.page_bytes, keys, kv_pattern)
            self.backdoor_corrupt(settings, namespace, keys[1], how)
            pages.wipe()
            assert conn.batch_get(keys, pages.pages) == [True, False, True], how
            assert pages.matches(0, keys[0], kv_pattern) and pages.matches(2, keys[2], kv_pattern)
