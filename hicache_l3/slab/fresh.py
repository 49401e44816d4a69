"""Reading slots again past this node's page cache, for stores shared across nodes.

On a filesystem that several nodes mount (:mod:`hicache_l3.common.filesystems`), this
node's page cache may hold parts of a slot from before another node rewrote it, so a read
can pair the new marker record with old data (:mod:`hicache_l3.slab.format`, "Across
nodes"). A checksum catches the pair; the page is then read once more here, each part
fetched from the filesystem after this node's cached copy of it was dropped, the data
first and the marker record after it, as the torn-slot argument needs:

1. drop the cached data range, read the data;
2. drop the cached marker range (after the data were read), read the marker record;
3. verify both against the index entry, with its checksum.

A marker record cached again by another thread between 2's drop and its read was fetched
after the data were, which is all the argument asks.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence

from hicache_l3.common.pages import Page
from hicache_l3.slab.format import RECORD_BYTES, Entry, Geometry
from hicache_l3.slab.io import SHORT, UNREGISTERED, verify

FileOf = Callable[[int, int], int]
"""``(writer, slab) -> descriptor`` of a slab file (the store's cached descriptors)."""


def drop_cached(fd: int, offset: int, length: int) -> None:
    """Drop this node's cached copy of ``length`` bytes at ``offset`` of ``fd``'s file
    (the 4 KiB pages covering them), so that the next read fetches them again."""
    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def reread(geometry: Geometry, file_of: FileOf, views_of: Callable[[Page], list[memoryview] | None],
           keys: Sequence[str], pages: Sequence[Page], entries: Sequence[Entry]) -> list[int]:
    """Read each slot of ``entries`` into its page past the page cache (module docstring)
    and verify it (:func:`~hicache_l3.slab.io.verify`, with the entry's checksum); one
    status per page (``verify``'s, :data:`SHORT`,
    :data:`UNREGISTERED` or ``-errno``)."""
    nbytes = geometry.slot_bytes
    data_at, marker_at = geometry.offsets(e.slot for e in entries)
    record = memoryview(bytearray(RECORD_BYTES))
    out: list[int] = []
    for j, entry in enumerate(entries):
        views = views_of(pages[j])
        if views is None:
            out.append(UNREGISTERED)
            continue
        try:
            fd = file_of(entry.writer, entry.slab)
            drop_cached(fd, data_at[j], nbytes)
            whole = os.preadv(fd, views, data_at[j]) == nbytes
            drop_cached(fd, marker_at[j], RECORD_BYTES)
            whole = whole and os.preadv(fd, [record], marker_at[j]) == RECORD_BYTES
        except OSError as exc:
            out.append(-(exc.errno or errno.EIO))
            continue
        out.append(verify(record, entry, keys[j], pages[j]) if whole else SHORT)
    return out
