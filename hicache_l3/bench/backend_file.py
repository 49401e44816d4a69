"""Bench backend ``file``: the file connector against raw ``preadv``/``pwritev`` (raw-posix:
one call per page into a file written in full once, one thread, no fsync). The connector's
capacity is exactly one repetition's pages, so timed repetitions measure a full cache
reusing its slots. :class:`RawPosixBatch` is the batch-at-a-time variant that
benchmarks/sglang_controller.py uses.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hicache_l3.bench.targets import BenchOptions, BenchTarget, ConnectorTarget, Pair, bench_namespace
from hicache_l3.common.memory import MemoryRegion, RegionTable
from hicache_l3.common.pages import Page, page_nbytes
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import Geometry


class RawPosix(BenchTarget):
    """The machine's limit for the same pages: pwritev/preadv per page, one thread; page
    ``i`` of a buffer at file offset ``i * page_bytes``."""

    backend = "raw-posix"
    ops = ("set", "get")

    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        self.size = size
        self.fd = -1
        self.regions = RegionTable()

    def prepare(self, buffers: Sequence[MemoryRegion], page_bytes: int) -> None:
        """Register ``buffers`` (any host memory) and write the whole file once from the first."""
        for b in buffers:
            self.regions.add(b)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        src, written = buffers[0].view(), 0
        while written < self.size:
            written += os.pwrite(self.fd, src[written : self.size], written)

    def _offset(self, page: Page) -> int:
        region = self.regions.find(page[0][0], page[0][1])
        assert region is not None
        return page[0][0] - region.address

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """Per page: its memoryviews and its file offset."""
        return [(self.regions.views(page), self._offset(page)) for page in pages]

    def run(self, op: str, plan: Any) -> list[bool]:
        """pwritev or preadv, one call per page."""
        call = os.pwritev if op == "set" else os.preadv
        return [call(self.fd, views, off) == sum(map(len, views)) for views, off in plan]

    def close(self) -> None:
        """Close and remove the file."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class Iovec(ctypes.Structure):
    """``struct iovec``."""

    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around every call
for _name in ("pwritev", "preadv"):
    getattr(_LIBC, _name).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    getattr(_LIBC, _name).restype = ctypes.c_ssize_t

Call = tuple[Any, int, int, int]  # one vectored call: (struct iovec array, its length, offset, bytes)


class RawPosixBatch(RawPosix):
    """raw-posix a batch at a time: one libc ``pwritev``/``preadv`` per batch (GIL released),
    the pages back to back in the file, a call cut at IOV_MAX segments, iovec arrays built
    before the clock. ``parts`` > 1 cuts each batch into that many runs of whole pages, moved
    at once by the caller and ``parts - 1`` helper threads and joined before :meth:`move`
    returns."""

    backend = "raw-posix-batch"

    def __init__(self, path: Path, size: int, parts: int = 1) -> None:
        super().__init__(path, size)
        self.parts = parts
        self.pool = ThreadPoolExecutor(parts - 1) if parts > 1 else None

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """The batch's calls from the file offset of its first page."""
        return self.plan_at(pages, self._offset(pages[0]))

    def plan_at(self, pages: Sequence[Page], offset: int) -> list[list[Call]]:
        """The calls moving ``pages`` to or from the file from ``offset`` on, one list per part."""
        step = max(1, os.sysconf("SC_IOV_MAX") // max(map(len, pages), default=1))  # pages a call
        cuts = [len(pages) * t // self.parts for t in range(self.parts + 1)]
        parts: list[list[Call]] = []
        for a, b in itertools.pairwise(cuts):
            calls: list[Call] = []
            at = offset + sum(map(page_nbytes, pages[:a]))
            for lo in range(a, b, step):
                segs = [seg for page in pages[lo : min(b, lo + step)] for seg in page]
                nbytes = sum(n for _, n in segs)
                calls.append(((Iovec * len(segs))(*(Iovec(p, n) for p, n in segs)), len(segs), at, nbytes))
                at += nbytes
            parts.append(calls)
        return parts

    def _calls(self, fn: Any, fd: int, calls: list[Call]) -> None:
        for arr, count, offset, nbytes in calls:
            done = fn(fd, ctypes.addressof(arr), count, offset)
            if done != nbytes:
                err = ctypes.get_errno()
                raise OSError(err, f"{fn.__name__} moved {done} of {nbytes} bytes: "
                                   f"{os.strerror(err) if done < 0 else 'short transfer'}")

    def move(self, op: str, fd: int, plan: list[list[Call]]) -> None:
        """One planned batch, ``"set"`` (pwritev) or ``"get"`` (preadv), into or from ``fd``;
        OSError on a failed or short call."""
        fn = _LIBC.pwritev if op == "set" else _LIBC.preadv
        first, *rest = plan
        futures = [self.pool.submit(self._calls, fn, fd, part) for part in rest] if self.pool else []
        self._calls(fn, fd, first)
        for future in futures:
            future.result()

    def run(self, op: str, plan: Any) -> list[bool]:
        """One planned batch with this target's file: one result, the whole batch's."""
        try:
            self.move(op, self.fd, plan)
        except OSError:
            return [False]
        return [True]

    def close(self) -> None:
        """Close the file and the helper threads."""
        super().close()
        if self.pool is not None:
            self.pool.shutdown()


def slab_pairs(opts: BenchOptions, stack: contextlib.ExitStack, backend: str,
               **defaults: Any) -> tuple[Any, RawPosix]:
    """A slab connector ``backend`` (capacity: one repetition's pages; ``--set`` overrides
    win) and a raw-posix contender, both closed by ``stack``."""
    settings: dict[str, Any] = {"root": str(opts.workdir / f"{backend}-store"),
                                "capacity_bytes": opts.pages * Geometry(opts.page_bytes).stride,
                                **defaults, **opts.settings.get(backend, {})}
    conn = open_connector(backend, bench_namespace(opts.page_bytes, f"bench-{backend}"), settings)
    stack.callback(conn.close)
    suffix = "" if backend == "file" else f"-{backend}"
    raw = RawPosix(opts.workdir / f"raw-posix{suffix}.dat", opts.pages * opts.page_bytes)
    stack.callback(raw.close)
    return conn, raw


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """The file connector in ``workdir`` (or the configured root) and raw-posix."""
    conn, raw = slab_pairs(opts, stack, "file")
    return [Pair(ConnectorTarget(conn, "file"), raw)]
