"""The tiers of the replay: a simulated L1/L2 per serving instance (LRU over page keys, L1 a
subset of L2, a request's pages touched last first so that suffixes are evicted before
prefixes) in front of one real L3 connector (:class:`L3Tier`: real bytes derived from each
key, every page a ``batch_get`` returns verified before it counts as a hit).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import hashlib
import time
from collections.abc import Sequence
from typing import Any

from hicache_l3.bench.runner import page_buffer
from hicache_l3.common.connector import Connector

PATTERN_UNIT = 64
POISON = 0xA5


class LRUTier:
    """A set of page keys with an LRU capacity in pages."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"tier capacity must be >= 1 page, got {capacity}")
        self.capacity = capacity
        self._pages: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._pages

    def __len__(self) -> int:
        return len(self._pages)

    def touch(self, key: str) -> None:
        """Make ``key`` the most recently used page (inserting it, evicting if full)."""
        pages = self._pages
        if key in pages:
            pages.move_to_end(key)
            return
        pages[key] = None
        if len(pages) > self.capacity:
            pages.popitem(last=False)


class InstanceCache:
    """L1 and L2 of one serving instance (see module docstring)."""

    def __init__(self, l1_pages: int, l2_pages: int) -> None:
        if l2_pages < l1_pages:
            raise ValueError(f"l2_pages ({l2_pages}) must be >= l1_pages ({l1_pages}): "
                             "HiCache keeps a host copy of every device page")
        self.l1 = LRUTier(l1_pages)
        self.l2 = LRUTier(l2_pages)
        self.seen: set[str] = set()

    def match(self, keys: Sequence[str]) -> tuple[int, int]:
        """Leading pages found in (L1, L2-but-not-L1); the match stops at the first
        page in neither."""
        l1 = l2 = 0
        for key in keys:
            if key in self.l1:
                l1 += 1
            elif key in self.l2:
                l2 += 1
            else:
                break
        return l1, l2

    def insert(self, keys: Sequence[str]) -> None:
        """The request's pages are now cached: touch them last page first."""
        self.seen.update(keys)
        for key in reversed(keys):
            self.l1.touch(key)
            self.l2.touch(key)


def page_pattern(key: str, page_bytes: int) -> bytes:
    """The bytes stored under ``key``: its 64-byte BLAKE2b digest, repeated."""
    unit = hashlib.blake2b(key.encode(), digest_size=PATTERN_UNIT).digest()
    return unit * (page_bytes // PATTERN_UNIT)


@dataclasses.dataclass
class LoadResult:
    """What one L3 lookup of a request found and moved."""

    hits: int = 0
    exists_s: float = 0.0
    get_s: float = 0.0
    get_failures: int = 0
    verify_failures: int = 0


class L3Tier:
    """Real L3 I/O for the replay: one connector per serving instance (or one shared),
    all on the same engine and namespace, over one registered host buffer of ``batch``
    pages. Not thread-safe (the replay is sequential)."""

    def __init__(self, connectors: Sequence[Connector[Any]], page_bytes: int, batch: int) -> None:
        if page_bytes < PATTERN_UNIT or page_bytes % PATTERN_UNIT:
            raise ValueError(f"page_bytes must be a multiple of {PATTERN_UNIT}, got {page_bytes}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.connectors = list(connectors)
        self.page_bytes = page_bytes
        self.batch = batch
        self.buffer, self.pages = page_buffer(batch, page_bytes, name="replay-l2-staging")
        self._view = self.buffer.view()
        for conn in self._distinct():
            conn.register(self.buffer)

    def _distinct(self) -> list[Connector[Any]]:
        return list({id(conn): conn for conn in self.connectors}.values())

    def connector(self, instance: int) -> Connector[Any]:
        """The connector serving ``instance``."""
        return self.connectors[instance % len(self.connectors)]

    def load(self, instance: int, keys: Sequence[str]) -> LoadResult:
        """Find the leading ``keys`` stored in L3 (``batch_exists``), load them
        (``batch_get``, timed) and verify every page's bytes. The prefix ends at the
        first page that is missing, fails to load or differs from its expected bytes."""
        out = LoadResult()
        conn = self.connector(instance)
        found = 0
        for lo in range(0, len(keys), self.batch):
            chunk = keys[lo : lo + self.batch]
            start = time.perf_counter()
            exists = conn.batch_exists(chunk)
            out.exists_s += time.perf_counter() - start
            n = next((i for i, e in enumerate(exists) if not e), len(chunk))
            found += n
            if n < len(chunk):
                break
        for lo in range(0, found, self.batch):
            chunk = keys[lo : min(found, lo + self.batch)]
            ctypes.memset(self.buffer.address, POISON, len(chunk) * self.page_bytes)
            start = time.perf_counter()
            ok = conn.batch_get(chunk, self.pages[: len(chunk)])
            out.get_s += time.perf_counter() - start
            for i, key in enumerate(chunk):
                if not ok[i]:
                    out.get_failures += 1
                    return out
                at = i * self.page_bytes
                if bytes(self._view[at : at + self.page_bytes]) != page_pattern(key, self.page_bytes):
                    out.verify_failures += 1
                    return out
                out.hits += 1
        return out

    def store(self, instance: int, keys: Sequence[str]) -> tuple[int, float]:
        """Write ``keys`` (their pattern bytes) from ``instance``; returns (pages the
        connector accepted, seconds spent in ``batch_set``)."""
        conn = self.connector(instance)
        stored, spent = 0, 0.0
        for lo in range(0, len(keys), self.batch):
            chunk = keys[lo : lo + self.batch]
            for i, key in enumerate(chunk):
                at = i * self.page_bytes
                self._view[at : at + self.page_bytes] = page_pattern(key, self.page_bytes)
            start = time.perf_counter()
            ok = conn.batch_set(chunk, self.pages[: len(chunk)])
            spent += time.perf_counter() - start
            stored += sum(ok)
        return stored, spent

    def close(self) -> None:
        """Close every connector once, then release the buffer view."""
        for conn in self._distinct():
            conn.close()
        self._view.release()
