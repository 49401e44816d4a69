"""Reading slots again past this node's page cache, for stores shared across nodes: each
part fetched after this node's cached copy was dropped, the data first and the marker
record after, then verified with the entry's checksum.
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
    """Read each slot of ``entries`` into its page past the page cache and verify it; one
    status per page (``verify``'s, :data:`SHORT`, :data:`UNREGISTERED` or ``-errno``)."""
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
