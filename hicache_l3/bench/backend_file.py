"""Bench backend ``file``: the file connector against raw ``preadv``/``pwritev``.

raw-posix follows the baseline rules: one ``os.pwritev`` per page into one file that
was fully written once before timing, one ``os.preadv`` per page back, from and into
the bench's pre-touched buffers, one thread, no fsync. The connector runs with a
capacity of exactly one repetition's pages, so that the timed repetitions measure the
steady state of a full cache (slots reused) rather than first writes into new files.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hicache_l3.bench.targets import BenchOptions, BenchTarget, ConnectorTarget, Pair
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer, RegionTable
from hicache_l3.common.pages import Page
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import Geometry


def bench_namespace(opts: BenchOptions, backend: str) -> Namespace:
    """The namespace bench pages are stored in (one per backend and page size)."""
    return Namespace(model="hicache-l3-bench", kv_dtype="uint8", layout="page_first",
                     page_size=opts.page_bytes, tag=f"bench-{backend}")


class RawPosix(BenchTarget):
    """The machine's limit for the same pages: pwritev/preadv per page, one thread."""

    backend = "raw-posix"
    ops = ("set", "get")

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.fd = -1
        self.regions = RegionTable()
        self.base = 0

    def prepare(self, buffers: list[HostBuffer], page_bytes: int) -> None:
        """Register the buffers and write the whole file once (so timing overwrites)."""
        for b in buffers:
            self.regions.add(b)
        self.base = buffers[0].address
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        src = buffers[0].view()
        written = 0
        while written < self.size:
            written += os.pwrite(self.fd, src[written : self.size], written)

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """Per page: the memoryview and the file offset (page i of the bench at i * size)."""
        out = []
        for page in pages:
            region = self.regions.find(page[0][0], page[0][1])
            assert region is not None
            views = self.regions.views(page)
            assert views is not None
            out.append((views, page[0][0] - region.address))
        return out

    def run(self, op: str, plan: Any) -> list[bool]:
        """pwritev or preadv, one call per page."""
        fd = self.fd
        if op == "set":
            return [os.pwritev(fd, views, off) == sum(map(len, views)) for views, off in plan]
        return [os.preadv(fd, views, off) == sum(map(len, views)) for views, off in plan]

    def close(self) -> None:
        """Close and remove the file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """The file connector in ``workdir`` (or the configured root) and raw-posix."""
    settings: dict[str, Any] = {
        "root": str(opts.workdir / "file-store"),
        "capacity_bytes": opts.pages * Geometry(opts.page_bytes).stride,
    }
    settings.update(opts.settings.get("file", {}))
    conn = open_connector("file", bench_namespace(opts, "file"), settings)
    stack.callback(conn.close)
    raw = RawPosix(opts.workdir / "raw-posix.dat", opts.pages * opts.page_bytes)
    stack.callback(raw.close)
    return [Pair(ConnectorTarget(conn, "file"), raw)]
