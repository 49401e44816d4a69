"""A checkpoint of a namespace's index (``<namespace dir>/index.ckpt``), so that a fresh
process loads it and replays only the log records written since. Version 3 holds a C page
table image every process maps as its table's base; version 2 (no image) is read too.
Written atomically; a torn, damaged or other-version file is ignored and the logs replayed.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import errno
import functools
import gc
import logging
import mmap
import os
import stat
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import xxhash

from hicache_l3.common.safe_fs import write_synced
from hicache_l3.slab.files import open_file
from hicache_l3.slab.format import Entry
from hicache_l3.slab.table import TableImage, build_image

log = logging.getLogger("hicache_l3.slab")

CHECKPOINT_FILE = "index.ckpt"
MAGIC = b"HL3INDEX"
VERSION = 3  # the pages as a table image (written with the C table)
VERSION_PAGES = 2  # the pages as digests and entries (read always; :func:`encode` writes it)
STALE_TMP_S = 3600.0  # a temporary checkpoint file this old was left by a crashed writer
ANCHOR = 4096  # bytes of a log CRC-checked at its start and before the checkpointed offset
HEADER = struct.Struct("<8sIIQ")
COUNTS = struct.Struct("<IQQQQ")
COUNTS_IMAGE = struct.Struct("<IQQQQQQQ")
IMAGE_ALIGN = mmap.ALLOCATIONGRANULARITY  # an image's offset: mappable
WRITER = struct.Struct("<IIQQQII")
ENTRY = struct.Struct("<IIIQQQ")
DELETED = struct.Struct("<IIIQ")
_make_entry = functools.partial(tuple.__new__, Entry)


@dataclasses.dataclass
class LogMark:
    """How far one writer's log was read: inode, offset, highest generation, CRC32s of its
    first ``ANCHOR`` bytes (``head``) and of the ``ANCHOR`` bytes before ``offset``
    (``anchor``), and the DELs that writer issued for other writers' slots."""

    writer: int
    ino: int
    offset: int
    max_gen: int
    head: int
    anchor: int
    foreign_dels: list[tuple[str, Entry]]


@dataclasses.dataclass
class ImageRef:
    """A version-3 checkpoint's page table image, its hash checked: ``length`` bytes at
    ``offset`` of the file open on ``fd`` (the caller maps it, then :meth:`close`), holding
    ``pages`` pages."""

    fd: int
    offset: int
    length: int
    pages: int

    def close(self) -> None:
        """Close the file (a mapping made from it stays)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclasses.dataclass
class IndexState:
    """The log-derived state of an index: its pages (``digests`` concatenated and
    ``values``, six per page: a table export) or, read from a version-3 file, ``image``
    instead; deleted marks; each log's mark. ``table``: the pages as a C table copy instead,
    written as the image."""

    digests: bytes
    values: array.array[int]
    deleted: dict[tuple[int, int, int], int]
    marks: list[LogMark]
    image: ImageRef | None = None
    table: TableImage | None = dataclasses.field(default=None, compare=False)


def log_crcs(fd: int, offset: int) -> tuple[int, int]:
    """(head, anchor) CRC32s of the log open on ``fd`` read up to ``offset`` (:class:`LogMark`)."""
    span = min(ANCHOR, offset)
    head = zlib.crc32(os.pread(fd, span, 0))
    anchor = zlib.crc32(os.pread(fd, span, offset - span))
    return head, anchor


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The cyclic garbage collector paused (while building many tuples)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _marks_sections(state: IndexState) -> tuple[bytes, bytes, int] | None:
    """The writers section, the other sections joined, and the keys' byte count of
    ``state``'s body; None when a foreign DEL's key holds a NUL."""
    foreign = [fd for mark in state.marks for fd in mark.foreign_dels]
    with no_gc():
        keys = "\0".join([k for k, _ in foreign])
        if keys.count("\0") != max(0, len(foreign) - 1):
            return None
        key_bytes = keys.encode()
        writers = b"".join([WRITER.pack(m.writer, len(m.foreign_dels), m.ino, m.offset, m.max_gen,
                                        m.head, m.anchor) for m in state.marks])
        pack = ENTRY.pack
        parts = [pack(*e) for _, e in foreign]
        pack = DELETED.pack
        parts += [pack(*where, gen) for where, gen in state.deleted.items()]
        parts.append(key_bytes)
    return writers, b"".join(parts), len(key_bytes)


def _foreign_count(state: IndexState) -> int:
    return sum(len(mark.foreign_dels) for mark in state.marks)


def encode(state: IndexState) -> bytes | None:
    """The version-2 checkpoint file's bytes for ``state`` (its pages as digests and
    entries); None when a foreign DEL's key holds a NUL character."""
    n_pages = len(state.digests) // 16
    if len(state.digests) != 16 * n_pages or len(state.values) != 6 * n_pages:
        raise ValueError(f"{len(state.digests)} digest bytes for {len(state.values)} entry values")
    sections = _marks_sections(state)
    if sections is None:
        return None
    writers, rest, n_key_bytes = sections
    values = state.values
    if sys.byteorder != "little":
        values = array.array("Q", values)
        values.byteswap()
    body = b"".join([COUNTS.pack(len(state.marks), n_pages, len(state.deleted), _foreign_count(state),
                                 n_key_bytes), writers, state.digests, values.tobytes(), rest])
    return HEADER.pack(MAGIC, VERSION_PAGES, zlib.crc32(body), len(body)) + body


def _encode_image_body(state: IndexState, sections: tuple[bytes, bytes, int], offset: int,
                       length: int, digest: int, pages: int) -> bytes:
    """A version-3 file's header and body for ``state``, its image described as given."""
    writers, rest, n_key_bytes = sections
    body = b"".join([COUNTS_IMAGE.pack(len(state.marks), len(state.deleted), _foreign_count(state),
                                       n_key_bytes, offset, length, digest, pages), writers, rest])
    return HEADER.pack(MAGIC, VERSION, zlib.crc32(body), len(body)) + body


def image_hash(fd: int, offset: int, length: int) -> int:
    """XXH3-64 of ``length`` bytes at ``offset`` (a multiple of :data:`IMAGE_ALIGN`) of the
    file open on ``fd``, read through a mapping (no copy)."""
    with mmap.mmap(fd, length, mmap.MAP_SHARED, mmap.PROT_READ, offset=offset) as view:
        return xxhash.xxh3_64_intdigest(view)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (torn, damaged, another version)."""


def _header(data: bytes | memoryview) -> tuple[int, int, int]:
    """(version, CRC, body length) of a checkpoint's first bytes; :class:`CheckpointError`."""
    if len(data) < HEADER.size:
        raise CheckpointError("shorter than its header")
    magic, version, crc, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise CheckpointError("bad magic")
    if version not in (VERSION, VERSION_PAGES):
        raise CheckpointError(f"format version {version}, this code reads {VERSION_PAGES} and {VERSION}")
    return version, crc, length


def _checked_body(data: bytes | memoryview, crc: int, length: int) -> memoryview:
    body = memoryview(data)[HEADER.size : HEADER.size + length]
    if len(body) != length:
        raise CheckpointError(f"{len(body)} body bytes, the header says {length} (torn)")
    if zlib.crc32(body) != crc:
        raise CheckpointError("CRC mismatch (damaged)")
    return body


def decode(data: bytes | memoryview) -> IndexState:
    """The state a whole checkpoint file's bytes hold, pages as digests and entries
    whatever the version; :class:`CheckpointError` when it is not whole."""
    version, crc, length = _header(data)
    body = _checked_body(data, crc, length)
    if version == VERSION_PAGES:
        if HEADER.size + length != len(data):
            raise CheckpointError(f"{len(data) - HEADER.size} body bytes, the header says {length} (torn)")
        try:
            return _decode_body(body)
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointError(f"inconsistent body: {exc}") from None
    state, (offset, image_len, digest, _) = _decode_image_state(body)
    image = memoryview(data)[offset : offset + image_len]
    if len(image) != image_len or offset + image_len != len(data):
        raise CheckpointError("the image is not whole (torn)")
    if xxhash.xxh3_64_intdigest(image) != digest:
        raise CheckpointError("image hash mismatch (damaged)")
    fd = os.memfd_create("hl3-image")
    try:
        os.write(fd, image)
        from hicache_l3.slab.table import NativePageTable, native_library

        table = NativePageTable(native_library())
        try:
            table.attach(fd, 0, image_len)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        state.digests, state.values = table.export()
    finally:
        os.close(fd)
    return state


def _decode_image_state(body: memoryview) -> tuple[IndexState, tuple[int, int, int, int]]:
    """A version-3 body's state (no pages) and its image's (offset, bytes, hash, pages)."""
    try:
        (n_writers, n_deleted, n_foreign, n_key_bytes, offset, length, digest,
         pages) = COUNTS_IMAGE.unpack_from(body)
        state = _decode_marks(body, COUNTS_IMAGE.size, n_writers, n_foreign, n_deleted, n_key_bytes)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"inconsistent body: {exc}") from None
    if offset % IMAGE_ALIGN or offset < HEADER.size + len(body):
        raise CheckpointError(f"inconsistent body: image offset {offset}")
    return state, (offset, length, digest, pages)


def _decode_body(body: memoryview) -> IndexState:
    n_writers, n_entries, n_deleted, n_foreign, n_key_bytes = COUNTS.unpack_from(body)
    pos = COUNTS.size
    sizes = (n_writers * WRITER.size, n_entries * 16, n_entries * 48)
    if pos + sum(sizes) > len(body):
        raise ValueError("section sizes do not add up to the body")
    digests = bytes(body[pos + sizes[0] : pos + sizes[0] + sizes[1]])
    values = array.array("Q")
    values.frombytes(body[pos + sizes[0] + sizes[1] : pos + sum(sizes)])
    if sys.byteorder != "little":
        values.byteswap()
    rest = bytes(body[pos : pos + sizes[0]]) + bytes(body[pos + sum(sizes):])
    state = _decode_marks(memoryview(rest), 0, n_writers, n_foreign, n_deleted, n_key_bytes)
    state.digests, state.values = digests, values
    return state


def _decode_marks(body: memoryview, pos: int, n_writers: int, n_foreign: int, n_deleted: int,
                  n_key_bytes: int) -> IndexState:
    """The sections from ``pos`` to the end of ``body`` as a state without pages."""
    sizes = (n_writers * WRITER.size, n_foreign * ENTRY.size, n_deleted * DELETED.size, n_key_bytes)
    if pos + sum(sizes) != len(body):
        raise ValueError("section sizes do not add up to the body")
    writers = list(WRITER.iter_unpack(body[pos : pos + sizes[0]]))
    pos += sizes[0]
    with no_gc():
        foreign = list(map(_make_entry, ENTRY.iter_unpack(body[pos : pos + sizes[1]])))
        pos += sizes[1]
        deleted = {(w, slab, slot): gen for w, slab, slot, gen in
                   DELETED.iter_unpack(body[pos : pos + sizes[2]])}
        pos += sizes[2]
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
    return IndexState(b"", array.array("Q"), deleted, marks)


def _remove_stale_temporaries(directory: Path) -> None:
    """Remove temporary checkpoint files left by crashed writers (older than :data:`STALE_TMP_S`)."""
    now = time.time()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(f".{CHECKPOINT_FILE}.") and name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    if now - os.lstat(directory / name).st_mtime > STALE_TMP_S:
                        os.unlink(directory / name)


def write(directory: Path, state: IndexState, expect: int | None = None,
          written: list[ImageRef] | None = None) -> bool:
    """Replace ``directory``'s checkpoint with ``state`` atomically (version 3, its image
    sized for ``expect`` pages at most); False when ``state`` cannot be encoded. With
    ``written``, the image of the file written is appended to it, its file open (the caller
    closes it)."""
    sections = _marks_sections(state)
    if sections is None:
        log.info("%s: a deleted key holds a NUL character: no index checkpoint written", directory)
        return False
    try:
        image = state.table or build_image(state.digests, state.values, expect)  # (without the GIL)
        image.prepare()  # (a snapshot's standalone copy, made here without the GIL)
    except MemoryError as exc:
        raise OSError(errno.ENOMEM, f"no memory for the checkpoint's table image ({exc})") from exc
    _remove_stale_temporaries(directory)
    tmp = directory / f".{CHECKPOINT_FILE}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # a leftover of a crashed process that had our pid and thread id
    fd = open_file(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
    try:
        head = _encode_image_body(state, sections, 0, image.nbytes, 0, image.pages)
        offset = -(-len(head) // IMAGE_ALIGN) * IMAGE_ALIGN
        image.write(fd, offset)
        head = _encode_image_body(state, sections, offset, image.nbytes,
                                  image_hash(fd, offset, image.nbytes), image.pages)
        write_synced(fd, head)  # (at offset 0: nothing was written through the offset)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if written is not None:
        written.append(ImageRef(os.dup(fd), offset, image.nbytes, image.pages))
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
    keep = False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            log.warning("%s is not a regular file: ignored, the logs are replayed", path)
            return None
        version, crc, length = _header(os.pread(fd, HEADER.size, 0))
        if version == VERSION:  # the body, then the image's hash through a mapping
            data = os.pread(fd, HEADER.size + length, 0)
            state, (offset, image_len, digest, pages) = _decode_image_state(_checked_body(data, crc, length))
            if offset + image_len != st.st_size or image_len == 0:
                raise CheckpointError(f"{st.st_size} bytes, the image ends at {offset + image_len} (torn)")
            try:
                hashed = image_hash(fd, offset, image_len)
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"image not readable ({exc})") from None
            if hashed != digest:
                raise CheckpointError("image hash mismatch (damaged)")
            state.image, keep = ImageRef(fd, offset, image_len, pages), True
            return state
        return decode(_read_all(fd, st.st_size))
    except CheckpointError as exc:
        log.warning("%s: %s: ignored, the logs are replayed", path, exc)
        return None
    finally:
        if not keep:
            os.close(fd)


def _read_all(fd: int, size: int) -> memoryview:
    buf = bytearray(size)  # read in place: no second copy of a big file
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            break  # shrank meanwhile: decode reports it torn
        got += n
    return view[:got]
