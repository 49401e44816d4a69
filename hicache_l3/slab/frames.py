"""Compressed pages in slab slots (``compression="zstd"`` on file, hf3fs and nixl file
roots). A page whose frame (:mod:`hicache_l3.common.compression`) is shorter than its slot
is stored as that frame at the start of the slot; its index entry and marker record carry
the frame's length, its checksum covers the frame. Frames are zero-padded to
:func:`frame_align` bytes so that a store holds few distinct lengths (the page table keeps
one class per length).

Frames move through the store's buffered descriptors, not the connector's transport: a
frame lives in Python memory (not registered with NIXL or USRBIO) and is decoded in memory
anyway. As for every slot, a write puts the marker record first and a read takes it last.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence

from hicache_l3.common.compression import read_stored
from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
from hicache_l3.slab.format import RECORD_BYTES, Entry, Geometry, Slot, check_marker, encode_marker
from hicache_l3.slab.fresh import drop_cached
from hicache_l3.slab.io import CHECKSUM, HEADER, OK, SHORT, UNREGISTERED

FileOf = Callable[[int, int], int]
"""``(writer, slab) -> descriptor`` of a slab file (the store's cached descriptors)."""


def frame_align(slot_bytes: int) -> int:
    """The multiple of bytes a stored frame is padded to: about 1/1024 of the slot, at
    least 64 and at most 32 KiB (at most ~1,024 frame lengths per slot size)."""
    return min(1 << 15, max(64, 1 << max(0, (slot_bytes - 1).bit_length() - 10)))


def is_frame_length(length: int, slot_bytes: int) -> bool:
    """Whether a page indexed with ``length`` bytes in slots of ``slot_bytes`` is stored as
    a frame (anything shorter than a slot: one that does not decode is corrupt)."""
    return 0 < length < slot_bytes


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[n:], offset + n


def write_frames(geometry: Geometry, keys: Sequence[str], frames: Sequence[bytes], slots: Sequence[Slot],
                 checksum: bool) -> tuple[list[int], list[int]]:
    """Write ``frames[j]`` of ``keys[j]`` into the reserved ``slots[j]``: per frame its
    status (:data:`OK` or ``-errno``) and the checksum its marker carries (0 without
    ``checksum``)."""
    status, sums = [], []
    for key, frame, slot in zip(keys, frames, slots):
        csum = buffer_checksum([frame]) if checksum else 0
        try:
            _pwrite_all(slot.fd, encode_marker(slot.gen, len(frame), csum, key_fingerprint(key)),
                        geometry.marker_offset(slot.slot))
            _pwrite_all(slot.fd, frame, geometry.data_offset(slot.slot))
            status.append(OK)
        except OSError as exc:
            status.append(-(exc.errno or errno.EIO))
        sums.append(csum)
    return status, sums


def read_frame(geometry: Geometry, fd: int, entry: Entry, key: str, views: list[memoryview],
               fresh: bool) -> int:
    """Read the frame of ``entry``, check it (marker record, checksum) and decode it into
    ``views``, the caller's page: :data:`OK`, :data:`SHORT`, :data:`HEADER`,
    :data:`CHECKSUM` (a checksum mismatch or a frame that does not decode to the page;
    ``views`` untouched then) or ``-errno``. ``fresh``: a failed check is read once more
    past this node's page cache (a store shared across nodes)."""
    data_at, marker_at = geometry.data_offset(entry.slot), geometry.marker_offset(entry.slot)
    length = entry.length
    status = SHORT
    for again in (False, True) if fresh else (False,):
        stored, record = bytearray(length), bytearray(RECORD_BYTES)
        try:
            if again:
                drop_cached(fd, data_at, length)
            whole = os.preadv(fd, [stored], data_at) == length
            if again:
                drop_cached(fd, marker_at, RECORD_BYTES)
            whole = os.preadv(fd, [record], marker_at) == RECORD_BYTES and whole
        except OSError as exc:
            return -(exc.errno or errno.EIO)
        if not whole:
            status = SHORT
        elif not check_marker(memoryview(record), entry, key_fingerprint(key)):
            status = HEADER
        elif entry.checksum and buffer_checksum([memoryview(stored)]) != entry.checksum:
            status = CHECKSUM
        elif read_stored(stored, views) is Reason.OK:
            return OK
        else:
            status = CHECKSUM
    return status


def read_frames(geometry: Geometry, file_of: FileOf, keys: Sequence[str], entries: Sequence[Entry],
                views: Sequence[list[memoryview] | None], fresh: bool, lo: int, hi: int) -> list[int]:
    """:func:`read_frame` of pages ``lo..hi-1`` (``views[j]`` None: :data:`UNREGISTERED`)."""
    out = []
    for j in range(lo, hi):
        page, entry = views[j], entries[j]
        if page is None:
            out.append(UNREGISTERED)
            continue
        try:
            fd = file_of(entry.writer, entry.slab)
        except OSError as exc:
            out.append(-(exc.errno or errno.EIO))
            continue
        out.append(read_frame(geometry, fd, entry, keys[j], page, fresh))
    return out
