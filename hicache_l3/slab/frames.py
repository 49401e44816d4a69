"""Compressed pages in slab slots (``compression="zstd"`` on file, hf3fs and nixl file
roots). A page whose frame (:mod:`hicache_l3.common.compression`) is shorter than its slot
is stored as that frame at the start of the slot; its index entry and marker record carry
the frame's length, its checksum covers the frame. Frames are zero-padded to
:func:`frame_align` bytes so that a store holds few distinct lengths (the page table keeps
one class per length).

Frames move through the store's buffered descriptors, not the connector's transport: a
frame lives in Python memory (not registered with NIXL or USRBIO) and is decoded in memory
anyway. As for every slot, a write puts the marker record first and a read takes it last;
a get batch's frames are read and checked by the C library's planned read, then decoded,
in passes of at most one reused buffer (:class:`FrameBuffers`): a buffer allocated per
batch costs a page fault per 4 KiB on every get.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import errno
import os
import threading
from collections.abc import Iterator, Sequence
from functools import partial
from itertools import accumulate
from typing import Any, cast

from hicache_l3.common.compression import read_stored
from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import buffer_checksum, key_fingerprint
from hicache_l3.common.pages import Page
from hicache_l3.common.parallel import BatchPool, Started
from hicache_l3.slab.format import (
    RECORD_BYTES,
    Entry,
    Geometry,
    Slot,
    encode_marker,
    expected_markers,
)
from hicache_l3.slab.fresh import FileOf, drop_cached
from hicache_l3.slab.io import CHECKSUM, HEADER, OK, PENDING, SHORT, UNREGISTERED
from hicache_l3.slab.native import library


def frame_align(slot_bytes: int) -> int:
    """The multiple of bytes a stored frame is padded to: about 1/1024 of the slot, at
    least 64 and at most 32 KiB (at most ~1,024 frame lengths per slot size)."""
    return min(1 << 15, max(64, 1 << max(0, (slot_bytes - 1).bit_length() - 10)))


def is_frame_length(length: int, slot_bytes: int) -> bool:
    """Whether a page indexed with ``length`` bytes in slots of ``slot_bytes`` is stored as
    a frame (anything shorter than a slot: one that does not decode is corrupt)."""
    return 0 < length < slot_bytes


def write_frames(geometry: Geometry, keys: Sequence[str], frames: Sequence[bytes], slots: Sequence[Slot],
                 checksum: bool) -> tuple[list[int], list[int]]:
    """Write ``frames[j]`` of ``keys[j]`` into the reserved ``slots[j]``: per frame its
    status (:data:`OK` or ``-errno``) and the checksum its marker carries (0 without
    ``checksum``)."""
    status, sums = [], []
    for key, frame, slot in zip(keys, frames, slots):
        csum = buffer_checksum([frame]) if checksum else 0
        record = encode_marker(slot.gen, len(frame), csum, key_fingerprint(key))
        try:  # (the slot is preallocated: a short write is a full disk)
            whole = os.pwrite(slot.fd, record, geometry.marker_offset(slot.slot)) == len(record) and \
                os.pwrite(slot.fd, frame, geometry.data_offset(slot.slot)) == len(frame)
            status.append(OK if whole else -errno.ENOSPC)
        except OSError as exc:
            status.append(-(exc.errno or errno.EIO))
        sums.append(csum)
    return status, sums


class FrameBuffers:
    """Read buffers of ``size`` bytes that outlive a get, one per concurrent get; at most
    ``keep`` are kept between gets."""

    def __init__(self, size: int, keep: int = 2) -> None:
        self.size, self._keep = size, keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def taken(self) -> Iterator[bytearray]:
        """A buffer of :attr:`size` bytes for the caller alone until the block ends."""
        with self._lock:
            buffer = self._free.pop() if self._free else None
        buffer = buffer if buffer is not None else bytearray(self.size)
        try:
            yield buffer
        finally:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(buffer)


def frame_passes(lengths: Sequence[int], size: int) -> Iterator[tuple[int, int]]:
    """Consecutive ``[lo, hi)`` runs of frames whose lengths add up to at most ``size``
    (a longer frame alone)."""
    lo, total = 0, 0
    for j, length in enumerate(lengths):
        if j > lo and total + length > size:
            yield lo, j
            lo, total = j, 0
        total += length
    if lo < len(lengths):
        yield lo, len(lengths)


class FrameBatch:
    """Frames of a get read into ``buffer`` (one of their own when they do not fit) by the
    C library's planned read (data, then marker records, then the checksums; the GIL
    released), shaped as the :class:`~hicache_l3.slab.native.PlannedRead` it takes. Frames
    without a destination (``views[j]`` None) are left out as :data:`UNREGISTERED`, those
    whose slab cannot be opened with their ``-errno`` in :attr:`status`."""

    def __init__(self, geometry: Geometry, file_of: FileOf, keys: Sequence[str],
                 entries: Sequence[Entry], views: Sequence[list[memoryview] | None],
                 buffer: bytearray) -> None:
        n = len(entries)
        self.views = views
        self.status = [PENDING] * n
        fds = []
        for j, e in enumerate(entries):
            try:
                fds.append(file_of(e.writer, e.slab) if views[j] is not None else -1)
            except OSError as exc:
                fds.append(-1)
                self.status[j] = -(exc.errno or errno.EIO)
            if views[j] is None:
                self.status[j] = UNREGISTERED
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
        self.scratch = buffer if len(buffer) >= self.starts[-1] else bytearray(self.starts[-1])
        base = ctypes.addressof((ctypes.c_char * len(self.scratch)).from_buffer(self.scratch))
        self.pages: list[Page] = [[(base + at, length)] for at, length in zip(self.starts, self.lengths)]

    def stored(self, k: int) -> memoryview:
        """The bytes read of the plan's frame ``k``."""
        return memoryview(self.scratch)[self.starts[k]:self.starts[k + 1]]


def read_frames(geometry: Geometry, file_of: FileOf, keys: Sequence[str], entries: Sequence[Entry],
                views: Sequence[list[memoryview] | None], fresh: bool, io: BatchPool,
                cpu: BatchPool, buffers: FrameBuffers) -> list[int]:
    """Read, check and decode the frames of ``entries`` into ``views`` (None:
    :data:`UNREGISTERED`): per frame :data:`OK`, :data:`SHORT`, :data:`HEADER`,
    :data:`CHECKSUM` (a checksum mismatch, or a frame that does not decode to the page: the
    page untouched then) or ``-errno``. ``fresh``: a frame failing its checks is read once
    more past this node's page cache (a store shared across nodes).

    Frames go in passes of one buffer of ``buffers``, two buffers taking turns: ``io``'s
    threads read a pass (each waits on the device) while the caller and ``cpu``'s threads
    (one per core) decode the pass before it."""
    status: list[int] = []
    passes = list(frame_passes([e.length for e in entries], buffers.size))
    started: list[Started] = []
    with contextlib.ExitStack() as held:
        turns = [held.enter_context(buffers.taken()) for _ in passes[:2]]
        try:
            reading: tuple[FrameBatch, Any, Started] | None = None
            for i, (lo, hi) in enumerate(passes):
                batch = FrameBatch(geometry, file_of, keys[lo:hi], entries[lo:hi], views[lo:hi], turns[i % 2])
                call = library().plan_read(batch, batch.pages) if batch.count else None
                started.append(io.start(partial(_read, call), batch.count))
                if reading is not None:
                    status += _checked(*reading, fresh, cpu)
                reading = (batch, call, started[-1])
            if reading is not None:
                status += _checked(*reading, fresh, cpu)
        finally:  # interrupted: no read goes on into a buffer given back
            for reads in started:
                reads.guard.settle()
    return status


def _read(call: Any, lo: int, hi: int) -> None:
    library().read_plan(call, lo, hi)


def _checked(batch: FrameBatch, call: Any, reads: Started, fresh: bool, cpu: BatchPool) -> list[int]:
    """The statuses of a pass read by ``call`` once ``reads`` end, its frames that read
    whole decoded."""
    reads.wait()
    status = batch.status
    if batch.count:
        for k in range(batch.count) if fresh else ():
            if call.status[k] in (SHORT, HEADER, CHECKSUM):
                drop_cached(batch.fds[k], batch.data_offs[k], batch.lengths[k])
                drop_cached(batch.fds[k], batch.marker_offs[k], RECORD_BYTES)
                library().read_plan(call, k, k + 1)
        for k, j in enumerate(batch.read):
            status[j] = call.status[k]
    todo = [(k, j) for k, j in enumerate(batch.read) if status[j] == OK]  # read and checked
    views = batch.views

    def decode(lo: int, hi: int) -> None:
        for k, j in todo[lo:hi]:
            if read_stored(batch.stored(k), cast("list[memoryview]", views[j])) is not Reason.OK:
                status[j] = CHECKSUM

    cpu.map(decode, len(todo))
    return status
