"""A checkpoint of a namespace's index, so that a fresh process opens by loading it and
replaying only the log records written since, not every log from its start.

File: ``<namespace dir>/index.ckpt``. It holds the log-derived state of one process's
:class:`~hicache_l3.slab.index.SlabIndex` (see :class:`IndexState`): every page as
``digest(key) -> Entry`` (the page table's digests, :mod:`hicache_l3.slab.table`: the
keys stay in the logs), the ``deleted`` marks, and per writer log how far it was read
(the log's inode, the offset, the highest generation seen, CRC32s of its first and of
its last 4 KiB before that offset) and the DELs that writer issued for other writers'
slots (with their keys: a writer's log compaction rewrites them).

Layout (little-endian), version 2 (version 1 held keys instead of digests: a version-1
file is ignored like any other version, the logs are replayed)::

    header  magic "HL3INDEX", version u32, CRC32 of the body u32, body length u64
    body    counts: writers u32, pages u64, deleted u64, foreign DELs u64, key bytes u64
            per writer: writer u32, foreign DELs of it u32, inode u64, offset u64,
                        max generation u64, head CRC u32, anchor CRC u32
            the pages' digests, 16 bytes each
            the pages' entries: writer, slab, slot, gen, length, checksum u64 each
            per foreign DEL: writer, slab, slot u32, gen, length, checksum u64
            per deleted mark: writer, slab, slot u32, generation u64
            keys of the foreign DELs, UTF-8, NUL-separated

Crash guarantees. The file is written to a private (0600, ``O_NOFOLLOW | O_EXCL``)
temporary file, synced, and renamed over the old one: a reader sees the old checkpoint or
the new one, whole. One that is torn or damaged anyway (bad magic, version, length or
CRC), a symlink, or not a regular file is ignored with a warning: the opener replays the
logs from their start, as without a checkpoint. A writer log whose inode, size or CRCs no
longer match the checkpoint (compacted, set aside, replaced) is read again from its start
and the checkpoint's entries of that writer are dropped first, exactly as a running reader
does when it notices a compaction. Keys holding a NUL character cannot be stored in this
format: no checkpoint is written while a foreign DEL holds one (the logs stay the source).
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import stat
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from hicache_l3.common.safe_fs import write_synced
from hicache_l3.slab.files import open_file
from hicache_l3.slab.format import Entry

log = logging.getLogger("hicache_l3.slab")

CHECKPOINT_FILE = "index.ckpt"
MAGIC = b"HL3INDEX"
VERSION = 2
STALE_TMP_S = 3600.0  # a temporary checkpoint file this old was left by a crashed writer
ANCHOR = 4096  # bytes of a log CRC-checked at its start and before the checkpointed offset
HEADER = struct.Struct("<8sIIQ")
COUNTS = struct.Struct("<IQQQQ")
WRITER = struct.Struct("<IIQQQII")
ENTRY = struct.Struct("<IIIQQQ")
DELETED = struct.Struct("<IIIQ")
_make_entry = functools.partial(tuple.__new__, Entry)


@dataclasses.dataclass
class LogMark:
    """How far one writer's log was read: inode, offset, highest generation, the CRC32 of
    its first ``ANCHOR`` bytes (``head``) and of the ``ANCHOR`` bytes before ``offset``
    (``anchor``), and the DELs that writer issued for other writers' slots."""

    writer: int
    ino: int
    offset: int
    max_gen: int
    head: int
    anchor: int
    foreign_dels: list[tuple[str, Entry]]


@dataclasses.dataclass
class IndexState:
    """The log-derived state of an index: its pages (``digests``: 16 bytes each,
    concatenated; ``values``: the six fields of each page's entry, flat, same order: a
    :meth:`~hicache_l3.slab.table.PageTable.export`), deleted marks, and each log's mark."""

    digests: bytes
    values: array.array[int]
    deleted: dict[tuple[int, int, int], int]
    marks: list[LogMark]


def log_crcs(fd: int, offset: int) -> tuple[int, int]:
    """(head, anchor) CRC32s of the log open on ``fd`` read up to ``offset`` (see
    :class:`LogMark`)."""
    span = min(ANCHOR, offset)
    head = zlib.crc32(os.pread(fd, span, 0))
    anchor = zlib.crc32(os.pread(fd, span, offset - span))
    return head, anchor


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused: building millions of tuples otherwise
    triggers collections that cost more than the building (measured ~4x)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def encode(state: IndexState) -> bytes | None:
    """The checkpoint file's bytes for ``state``; None when a foreign DEL's key holds a
    NUL character (this format separates keys with NUL)."""
    foreign = [fd for mark in state.marks for fd in mark.foreign_dels]
    n_pages = len(state.digests) // 16
    if len(state.digests) != 16 * n_pages or len(state.values) != 6 * n_pages:
        raise ValueError(f"{len(state.digests)} digest bytes for {len(state.values)} entry values")
    with no_gc():
        keys = "\0".join([k for k, _ in foreign])
        if keys.count("\0") != max(0, len(foreign) - 1):
            return None
        key_bytes = keys.encode()
        values = state.values
        if sys.byteorder != "little":
            values = array.array("Q", values)
            values.byteswap()
        parts = [COUNTS.pack(len(state.marks), n_pages, len(state.deleted),
                             len(foreign), len(key_bytes))]
        parts += [WRITER.pack(m.writer, len(m.foreign_dels), m.ino, m.offset, m.max_gen,
                              m.head, m.anchor) for m in state.marks]
        parts += [state.digests, values.tobytes()]
        pack = ENTRY.pack
        parts += [pack(*e) for _, e in foreign]
        pack = DELETED.pack
        parts += [pack(*where, gen) for where, gen in state.deleted.items()]
        parts.append(key_bytes)
        body = b"".join(parts)
    return HEADER.pack(MAGIC, VERSION, zlib.crc32(body), len(body)) + body


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (torn, damaged, another version)."""


def decode(data: bytes | memoryview) -> IndexState:
    """The state a checkpoint file holds; :class:`CheckpointError` when it is not whole."""
    if len(data) < HEADER.size:
        raise CheckpointError("shorter than its header")
    magic, version, crc, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError("bad magic")
    if version != VERSION:
        raise CheckpointError(f"format version {version}, this code reads {VERSION}")
    body = memoryview(data)[HEADER.size:]
    if len(body) != length:
        raise CheckpointError(f"{len(body)} body bytes, the header says {length} (torn)")
    if zlib.crc32(body) != crc:
        raise CheckpointError("CRC mismatch (damaged)")
    try:
        return _decode_body(body)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"inconsistent body: {exc}") from None


def _decode_body(body: memoryview) -> IndexState:
    n_writers, n_entries, n_deleted, n_foreign, n_key_bytes = COUNTS.unpack_from(body)
    pos = COUNTS.size
    sizes = (n_writers * WRITER.size, n_entries * 16, n_entries * 48, n_foreign * ENTRY.size,
             n_deleted * DELETED.size, n_key_bytes)
    if pos + sum(sizes) != len(body):
        raise ValueError("section sizes do not add up to the body")
    writers = list(WRITER.iter_unpack(body[pos : pos + sizes[0]]))
    pos += sizes[0]
    digests = bytes(body[pos : pos + sizes[1]])
    pos += sizes[1]
    values = array.array("Q")
    values.frombytes(body[pos : pos + sizes[2]])
    if sys.byteorder != "little":
        values.byteswap()
    pos += sizes[2]
    with no_gc():
        foreign = list(map(_make_entry, ENTRY.iter_unpack(body[pos : pos + sizes[3]])))
        pos += sizes[3]
        deleted = {(w, slab, slot): gen for w, slab, slot, gen in
                   DELETED.iter_unpack(body[pos : pos + sizes[4]])}
        pos += sizes[4]
        keys = str(body[pos:], "utf-8").split("\0") if n_foreign else []
        if len(keys) != n_foreign:
            raise ValueError(f"{len(keys)} keys for {n_foreign} foreign DELs")
    marks, at = [], 0
    if sum(w[1] for w in writers) != n_foreign:
        raise ValueError("foreign DEL counts do not add up")
    for writer, n_dels, ino, offset, max_gen, head, anchor in writers:
        dels = list(zip(keys[at : at + n_dels], foreign[at : at + n_dels]))
        at += n_dels
        marks.append(LogMark(writer, ino, offset, max_gen, head, anchor, dels))
    return IndexState(digests, values, deleted, marks)


def _remove_stale_temporaries(directory: Path) -> None:
    """Remove temporary checkpoint files that crashed writers left (untouched for
    :data:`STALE_TMP_S`: a live writer's is younger)."""
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(f".{CHECKPOINT_FILE}.") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if now - os.lstat(directory / name).st_mtime > STALE_TMP_S:
                        os.unlink(directory / name)


def write(directory: Path, state: IndexState) -> bool:
    """Replace ``directory``'s checkpoint with ``state`` atomically (private temporary
    file, synced, renamed); False when ``state`` cannot be encoded (see :func:`encode`)."""
    data = encode(state)
    if data is None:
        log.info("%s: a deleted key holds a NUL character: no index checkpoint written", directory)
        return False
    _remove_stale_temporaries(directory)
    tmp = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of a crashed process that had our pid and thread id
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        write_synced(fd, data)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    os.close(fd)
    os.replace(tmp, directory / CHECKPOINT_FILE)
    return True


def read(directory: Path) -> IndexState | None:
    """The checkpoint of ``directory``, or None when there is none or it cannot be used
    (logged: the caller replays the logs from their start)."""
    path = directory / CHECKPOINT_FILE
    try:
        fd = open_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink planted there
        log.warning("%s: cannot open (%s): ignored, the logs are replayed", path, exc.strerror)
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.warning("%s is not a regular file: ignored, the logs are replayed", path)
            return None
        buf = bytearray(st.st_size)  # read in place: no second copy of a big file
        view, got = memoryview(buf), 0
        while got < len(buf):
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break  # shrank meanwhile: decode reports it torn
            got += n
        data = view[:got]
    finally:
        os.close(fd)
    try:
        return decode(data)
    except CheckpointError as exc:
        log.warning("%s: %s: ignored, the logs are replayed", path, exc)
        return None
