"""Compressed pages in slab slots (``compression="zstd"`` on file, hf3fs and nixl file
roots). A page whose frame (:mod:`hicache_l3.common.compression`) is shorter than its slot
is stored as that frame at the start of the slot; its index entry and marker record carry
the frame's length, its checksum covers the frame. Frames are zero-padded to
:func:`frame_align` bytes so that a store holds few distinct lengths (the page table keeps
one class per length).

Frames move through the store's buffered descriptors, not the connector's transport: a
frame lives in Python memory (not registered with NIXL or USRBIO) and is decoded in memory
anyway. As for every slot, a write puts the marker record first and a read takes it last;
a get batch's frames are read and checked by the C library's planned read, then decoded.
"""

from __future__ import annotations

import array
import ctypes
import errno
import os
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import cast

from hicache_l3.common.compression import read_stored
from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
from hicache_l3.common.pages import Page
from hicache_l3.common.parallel import BatchPool
from hicache_l3.slab.format import (
    RECORD_BYTES,
    Entry,
    Geometry,
    Slot,
    check_marker,
    encode_marker,
    expected_markers,
)
from hicache_l3.slab.fresh import drop_cached
from hicache_l3.slab.io import CHECKSUM, HEADER, OK, PENDING, SHORT, UNREGISTERED
from hicache_l3.slab.native import library

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


class FrameBatch:
    """The frames of one get batch read into one scratch buffer by the C library's planned
    read (data, then marker records, then the checksums; the GIL released), shaped as the
    :class:`~hicache_l3.slab.native.PlannedRead` it takes. Frames whose slab cannot be
    opened are left out with their ``-errno`` in :attr:`status`."""

    def __init__(self, geometry: Geometry, file_of: FileOf, keys: Sequence[str],
                 entries: Sequence[Entry]) -> None:
        n = len(entries)
        self.status = [PENDING] * n
        fds = []
        for j, e in enumerate(entries):
            try:
                fds.append(file_of(e.writer, e.slab))
            except OSError as exc:
                fds.append(-1)
                self.status[j] = -(exc.errno or errno.EIO)
        self.read = [j for j in range(n) if fds[j] >= 0]  # the frames of the plan, in order
        entries = [entries[j] for j in self.read]
        self.count = len(self.read)
        self.fds = array.array("i", [fds[j] for j in self.read])
        data_at, marker_at = geometry.offsets(e.slot for e in entries)
        self.data_offs, self.marker_offs = array.array("q", data_at), array.array("q", marker_at)
        self.expect = bytearray(b"".join(expected_markers(entries, [keys[j] for j in self.read])))
        self.csums = array.array("Q", [e.checksum for e in entries])
        self.lengths = [e.length for e in entries]
        self.starts = list(accumulate(self.lengths, initial=0))
        self.scratch = bytearray(max(1, self.starts[-1]))
        base = ctypes.addressof((ctypes.c_char * len(self.scratch)).from_buffer(self.scratch))
        self.pages: list[Page] = [[(base + at, length)] for at, length in zip(self.starts, self.lengths)]

    def stored(self, k: int) -> memoryview:
        """The bytes read of the plan's frame ``k``."""
        return memoryview(self.scratch)[self.starts[k]:self.starts[k + 1]]


def read_frames(geometry: Geometry, file_of: FileOf, keys: Sequence[str], entries: Sequence[Entry],
                views: Sequence[list[memoryview] | None], fresh: bool, io: BatchPool,
                cpu: BatchPool) -> list[int]:
    """Read, check and decode the frames of ``entries`` into ``views`` (None:
    :data:`UNREGISTERED`): per frame :func:`read_frame`'s status. The reads run on ``io``'s
    threads (each waits on the device), the decoding on ``cpu``'s (one per core)."""
    batch = FrameBatch(geometry, file_of, keys, entries)
    status = batch.status
    if batch.count:
        call = library().plan_read(batch, batch.pages)
        io.map(lambda lo, hi: library().read_plan(call, lo, hi), batch.count)
        for k, j in enumerate(batch.read):
            status[j] = call.status[k]
    todo = []  # (frame of the plan, key index) read and checked: to decode
    for k, j in enumerate(batch.read):
        page = views[j]
        if page is None:
            status[j] = UNREGISTERED
        elif status[j] == OK:
            todo.append((k, j))
        elif fresh and status[j] in (SHORT, HEADER, CHECKSUM):  # again, past this node's page cache
            status[j] = read_frame(geometry, batch.fds[k], entries[j], keys[j], page, True)

    def decode(lo: int, hi: int) -> None:
        for k, j in todo[lo:hi]:
            if read_stored(batch.stored(k), cast("list[memoryview]", views[j])) is not Reason.OK:
                status[j] = CHECKSUM

    cpu.map(decode, len(todo))
    return status
