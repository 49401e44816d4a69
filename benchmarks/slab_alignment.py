"""Does aligning page data to 64 KiB file offsets pay, through the C batch path?

(Updated for slab format 2, whose ``PageBatch`` takes data and marker offsets apart: the
two layouts are now format 1's slot (72 KiB stride, data 4 KiB in, its 128-byte marker
record right before the data) and format 2's groups (:class:`~hicache_l3.slab.format.Geometry`).)

    .venv/bin/python benchmarks/slab_alignment.py [--pages 1024] [--reps 3] [--dir /tmp]

Writes (fresh, fallocated file) then reads ``--pages`` 64 KiB pages of two 32 KiB segments,
checksummed, with the C batch library on two threads, in two layouts: the slab's (a 72 KiB
stride, data 4 KiB into each slot, the header right before it) and an aligned one (a 128 KiB
stride, data at 64 KiB, the header right before it: the I/O cost of an out-of-line header
table, without building one). Prints GB/s per layout and repetition. The result decided
against a new slab format: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from hicache_l3.slab import native as batch_io
from hicache_l3.slab.format import Geometry
from hicache_l3.slab.native import PageBatch

PAGE = 64 << 10
GEOMETRY = Geometry(PAGE)


def _format1(n: int) -> tuple[list[int], list[int]]:
    data = [j * (PAGE + 8192) + 4096 for j in range(n)]
    return data, [d - 128 for d in data]


LAYOUTS = {"format 1 (72 KiB stride, data +4 KiB)": (_format1, lambda n: (PAGE + 8192) * n),
           "format 2 (grouped, data aligned)": (lambda n: GEOMETRY.offsets(range(n)), GEOMETRY.bytes_for)}


def main() -> int:
    """Run the comparison and print one line per repetition."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="directory for the scratch file (default: the temp dir)")
    args = ap.parse_args()
    native = batch_io.library()
    if native is None:
        raise SystemExit(f"needs the C batch library: {batch_io.describe()}")
    n = args.pages
    buf = mmap.mmap(-1, n * PAGE)
    buf.write(os.urandom(1 << 20) * (n * PAGE >> 20))
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    pages = [((base + j * PAGE, PAGE // 2), (base + j * PAGE + PAGE // 2, PAGE // 2)) for j in range(n)]
    pool = ThreadPoolExecutor(1)

    def two_threads(fn: Callable[[int, int], int], count: int) -> float:
        t = time.perf_counter()
        other = pool.submit(fn, count // 2, count)
        fn(0, count // 2)
        other.result()
        return time.perf_counter() - t

    gb = n * PAGE / 1e9
    fd_, path = tempfile.mkstemp(prefix="hicache-l3-align-", dir=args.dir)
    os.close(fd_)
    try:
        for rep in range(args.reps):
            cells = []
            for name, (offsets, size) in LAYOUTS.items():
                os.truncate(path, 0)
                fd = os.open(path, os.O_RDWR)
                try:
                    os.ftruncate(fd, size(n))
                    os.posix_fallocate(fd, 0, size(n))
                    data_at, marker_at = offsets(n)
                    w = PageBatch(128, [fd] * n, data_at, marker_at, pages, [bytes(128)] * n,
                                  writing=True)
                    dw = two_threads(partial(native.write, w, checksum=True), n)
                    expect = [bytes(w.markers[j * 128 : (j + 1) * 128]) for j in range(n)]
                    r = PageBatch(128, [fd] * n, data_at, marker_at, pages, expect, list(w.checksums),
                                  writing=False)
                    dr = two_threads(partial(native.read, r), n)
                    if any(r.status):
                        raise SystemExit(f"{name}: read back failed: {set(r.status)}")
                finally:
                    os.close(fd)
                cells.append(f"{name}: write {gb / dw:.2f} GB/s, read {gb / dr:.2f} GB/s")
            print(f"rep {rep}: " + " | ".join(cells))
    finally:
        os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
