"""Bench backend ``file``: the file connector against raw ``preadv``/``pwritev``.

raw-posix follows the baseline rules: one ``os.pwritev`` per page into one file that
was fully written once before timing, one ``os.preadv`` per page back, from and into
the bench's pre-touched buffers, one thread, no fsync. The connector runs with a
capacity of exactly one repetition's pages, so that the timed repetitions measure the
steady state of a full cache (slots reused) rather than first writes into new files.
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

from hicache_l3.bench.targets import BenchOptions, BenchTarget, ConnectorTarget, Pair
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import MemoryRegion, RegionTable
from hicache_l3.common.pages import Page, page_nbytes
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

    def prepare(self, buffers: Sequence[MemoryRegion], page_bytes: int) -> None:
        """Register the buffers (any host memory: the bench's, SGLang's host pool) and write
        the whole file once from the first (so timing overwrites)."""
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


class Iovec(ctypes.Structure):
    """``struct iovec``."""

    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_LIBC = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around every call
for _name in ("pwritev", "preadv"):
    getattr(_LIBC, _name).argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    getattr(_LIBC, _name).restype = ctypes.c_ssize_t

Call = tuple[Any, int, int, int]  # one vectored call: (struct iovec array, its length, offset, bytes)


class RawPosixBatch(RawPosix):
    """raw-posix a batch at a time (the controller benchmark's raw contenders,
    benchmarks/README.md): one libc ``pwritev``/``preadv`` per batch instead of one ``os``
    call per page; ctypes releases the GIL around it. :meth:`plan_at` builds the calls'
    ``struct iovec`` arrays before the clock: the pages back to back in the file, a call cut
    at IOV_MAX segments. ``parts`` > 1 cuts each batch into that many runs of whole pages,
    moved at once by the caller and ``parts - 1`` helper threads and joined before
    :meth:`move` returns: the limit of a synchronous batch call on ``parts`` threads."""

    backend = "raw-posix-batch"

    def __init__(self, path: Path, size: int, parts: int = 1) -> None:
        super().__init__(path, size)
        self.parts = parts
        self.pool = ThreadPoolExecutor(parts - 1) if parts > 1 else None

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """The batch's calls from the file offset of its first page (its place in its
        buffer, as raw-posix's)."""
        region = self.regions.find(pages[0][0][0], pages[0][0][1])
        assert region is not None
        return self.plan_at(pages, pages[0][0][0] - region.address)

    def plan_at(self, pages: Sequence[Page], offset: int) -> list[list[Call]]:
        """The calls moving ``pages`` to or from the file from ``offset`` on, one list per part."""
        iov_max = os.sysconf("SC_IOV_MAX")
        step = max(1, iov_max // max(map(len, pages), default=1))  # pages a call
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
