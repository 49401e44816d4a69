"""Read a byte range of a file in a fresh process: node B's side of the GlusterFS
stale-page tests (tests/glusterfs/test_gluster_engine.py). Standard library only, so it
starts fast under ``python -I -S``.

``python gluster_reader.py PATH OFFSET LENGTH MODE`` prints one JSON line:
``{"n", "old", "new", "other", "first_new", "last_old"}`` (counts of 0x01 and 0x02 bytes,
the index of the first 0x02 and of the last 0x01, -1 if none), or ``{"errno", "error"}``.

Modes:

* ``plain``: ``os.pread`` (through the page cache);
* ``fadvise``: ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the range, then ``os.pread``;
* ``direct``: ``O_DIRECT`` into a page-aligned buffer, offset and length as given;
* ``direct-buf+1``: ``O_DIRECT`` into a buffer that starts 1 byte past a page boundary;
* ``direct-off+1``: ``O_DIRECT``, aligned buffer, at ``OFFSET + 1``;
* ``direct-len+1``: ``O_DIRECT``, aligned buffer, ``LENGTH + 1`` bytes (the count is of
  the first ``LENGTH``).
"""

from __future__ import annotations

import json
import mmap
import os
import sys


def read(path: str, off: int, length: int, mode: str) -> bytes:
    """The bytes ``mode`` reads (see the module docstring)."""
    if not mode.startswith("direct"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if mode == "fadvise":
                os.posix_fadvise(fd, off, length, os.POSIX_FADV_DONTNEED)
            return os.pread(fd, length, off)
        finally:
            os.close(fd)
    shift = 1 if mode == "direct-buf+1" else 0
    if mode == "direct-off+1":
        off += 1
    want = length + 1 if mode == "direct-len+1" else length
    buf = mmap.mmap(-1, want + mmap.PAGESIZE)  # page-aligned
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with memoryview(buf)[shift:shift + want] as view:
            n = os.preadv(fd, [view], off)
            return bytes(view[:min(n, length)])
    finally:
        os.close(fd)
        buf.close()


def main() -> None:
    path, off, length, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        data = read(path, off, length, mode)
    except OSError as exc:
        print(json.dumps({"errno": exc.errno, "error": exc.strerror}))
        return
    print(json.dumps({"n": len(data), "old": data.count(1), "new": data.count(2),
                      "other": len(data) - data.count(1) - data.count(2),
                      "first_new": data.find(2), "last_old": data.rfind(1)}))


if __name__ == "__main__":
    main()
