"""The slab store's on-disk format: slot geometry, the start header and end marker of a
slot, index log records, and ``namespace.json``.

Layout under ``<root>/ns-<namespace digest>/``::

    namespace.json            the namespace and the slot size, written once
    writers/wNNNN/lock        flock-ed by the process that owns this writer directory
    writers/wNNNN/index.log   append-only index records of this writer
    writers/wNNNN/slab-NNNNNN.dat   preallocated data files cut into slots

Slots. A slot is a 4 KiB header block, the data, and an end marker::

    [ ... | start header (64 B) ][ data (slot_bytes) ][ end marker (64 B) | pad ]

The start header holds (magic, generation, length, checksum, key fingerprint); the
end marker holds (generation, key fingerprint). Every write gets a new generation,
unique per writer. A writer fills a slot in two steps: first the end marker, then the
start header and data. A reader reads header, data and marker and accepts the page only
if both carry the generation and fingerprint the index gave it. A reader that overlaps a
rewrite of the slot either reads the new end marker (generation differs: miss) or
finished reading the data before the rewrite began. A torn write, a recycled slot or a
crash mid-write therefore reads as a miss, never as somebody else's bytes; checksums add
detection of bytes altered at rest.

A checksummed page may be written in one step instead: header, data and end marker in
one vectored write, in file order. Every reader verifies the checksum of an entry that
has one, so a reader overlapping that rewrite reads a new header (miss) or data that
fail the checksum (miss); a write cut short leaves a new header before an old end
marker, and its page was never published.

Records. An index record is a CRC32 over its body, then kind, key length, (writer, slab,
slot, generation, length, checksum) and the key: PUT (a page is in that slot), DEL (that
exact page is gone) or GEN (generations up to this one were used; kept by compaction).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace

FORMAT_VERSION = 1
HEADER_BLOCK = 4096
MARKER = 64  # bytes of a start header and of an end marker
ALIGN = 4096
START = struct.Struct("<4sHHQQQ16s16x")  # magic, version, flags, gen, length, checksum, key fp
END = struct.Struct("<4s4xQ16s32x")  # magic, gen, key fp
START_MAGIC, END_MAGIC = b"HL3S", b"HL3E"
# crc, kind, pad, key length, writer, slab, slot, pad, gen, length, checksum
RECORD = struct.Struct("<IBBHIIIIQQQ")
PUT, DEL, GEN = 1, 2, 3
NAMESPACE_FILE = "namespace.json"

log = logging.getLogger("hicache_l3.slab")


def round_up(value: int, align: int) -> int:
    """``value`` rounded up to a multiple of ``align``."""
    return (value + align - 1) // align * align


class Entry(NamedTuple):
    """Where one stored page is: writer, slab, slot, generation, length, checksum.

    A named tuple, not a frozen dataclass: one is built per page committed or read from a
    log, and a frozen dataclass's ``__init__`` measured ~5x slower on that path."""

    writer: int
    slab: int
    slot: int
    gen: int
    length: int
    checksum: int


class Slot(NamedTuple):
    """A reserved own slot: the slab's descriptor (read-write), slab, slot, and the
    generation the write must carry."""

    fd: int
    slab: int
    slot: int
    gen: int


class Located(NamedTuple):
    """A page found in the index: a descriptor on its slab and its entry."""

    fd: int
    entry: Entry


class Record(NamedTuple):
    """One decoded index log record."""

    kind: int
    key: str
    entry: Entry


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Byte offsets of a slot's parts, derived from the slot size."""

    slot_bytes: int
    stride: int = 0  # bytes one slot takes in its slab (header block + data + marker, aligned)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stride", HEADER_BLOCK + round_up(self.slot_bytes + MARKER, ALIGN))

    def header_offset(self, slot: int) -> int:
        """Offset of the start header; the data follows it immediately."""
        return slot * self.stride + HEADER_BLOCK - MARKER

    def data_offset(self, slot: int) -> int:
        """Offset of the data (4 KiB aligned, so O_DIRECT can move it)."""
        return slot * self.stride + HEADER_BLOCK

    def end_offset(self, slot: int) -> int:
        """Offset of the end marker (fixed, after ``slot_bytes`` of data)."""
        return slot * self.stride + HEADER_BLOCK + self.slot_bytes


def encode_start(gen: int, length: int, checksum: int, fingerprint: bytes) -> bytes:
    """The 64-byte start header of a slot."""
    return START.pack(START_MAGIC, FORMAT_VERSION, 0, gen, length, checksum, fingerprint)


def encode_end(gen: int, fingerprint: bytes) -> bytes:
    """The 64-byte end marker of a slot."""
    return END.pack(END_MAGIC, gen, fingerprint)


def check_slot(start: bytes | memoryview, end: bytes | memoryview, entry: Entry,
               fingerprint: bytes) -> bool:
    """True when a slot's header and marker both carry ``entry``'s generation, length and
    checksum and the key's fingerprint: the bytes between them are that page's, untorn."""
    return start == encode_start(entry.gen, entry.length, entry.checksum, fingerprint) and (
        end == encode_end(entry.gen, fingerprint)
    )


_RECORD_BODY = struct.Struct(RECORD.format[:1] + RECORD.format[2:])  # RECORD without its CRC
_CRC = struct.Struct("<I")


def encode_record(kind: int, key: str, entry: Entry) -> bytes:
    """One index log record."""
    kb = key.encode()
    body = _RECORD_BODY.pack(kind, 0, len(kb), entry.writer, entry.slab, entry.slot, 0, entry.gen,
                             entry.length, entry.checksum) + kb
    return _CRC.pack(zlib.crc32(body)) + body


def encode_puts(keys: Sequence[str], entries: Sequence[Entry]) -> bytes:
    """The PUT records of ``keys[j]`` in ``entries[j]``, concatenated: what
    ``b"".join(encode_record(PUT, k, e) ...)`` gives, without a call per record."""
    pack_body, pack_crc, crc32 = _RECORD_BODY.pack, _CRC.pack, zlib.crc32
    out: list[bytes] = []
    append = out.append
    for key, (writer, slab, slot, gen, length, checksum) in zip(keys, entries):
        kb = key.encode()
        body = pack_body(PUT, 0, len(kb), writer, slab, slot, 0, gen, length, checksum) + kb
        append(pack_crc(crc32(body)))
        append(body)
    return b"".join(out)


def _record_at(data: bytes, pos: int) -> Record | None:
    """The record starting at ``pos`` if one is there whole, with a good CRC."""
    if pos + RECORD.size > len(data):
        return None
    crc, kind, _, keylen, w, slab, slot, _, gen, length, checksum = RECORD.unpack_from(data, pos)
    end = pos + RECORD.size + keylen
    if end > len(data) or kind not in (PUT, DEL, GEN) or zlib.crc32(data[pos + 4 : end]) != crc:
        return None
    try:
        key = data[pos + RECORD.size : end].decode()
    except UnicodeDecodeError:
        return None
    return Record(kind, key, Entry(w, slab, slot, gen, length, checksum))


_new_entry = functools.partial(tuple.__new__, Entry)  # Entry(*fields) without its Python __new__
_new_record = functools.partial(tuple.__new__, Record)


def decode_records(data: bytes) -> tuple[list[Record], int, int]:
    """The whole, CRC-checked records of ``data``, the bytes consumed, and how many bytes
    were skipped as damaged.

    Records are self-delimiting: where one fails its check, decoding resynchronises on
    the next position holding a whole record with a good CRC, so a damaged record loses
    only itself. Bytes after the last good record are not consumed (a record still being
    written, or a crashed writer's torn tail)."""
    out: list[Record] = []
    pos, n, skipped = 0, len(data), 0
    unpack, size, crc32, append = RECORD.unpack_from, RECORD.size, zlib.crc32, out.append
    while pos < n:
        # fast path: a whole, good record here (what _record_at checks, inlined: opening
        # a store replays every record through this loop)
        if pos + size <= n:
            crc, kind, _, keylen, w, slab, slot, _, gen, length, checksum = unpack(data, pos)
            end = pos + size + keylen
            if end <= n and PUT <= kind <= GEN and crc32(data[pos + 4 : end]) == crc:
                try:
                    key = data[pos + size : end].decode()
                except UnicodeDecodeError:
                    pass
                else:
                    append(_new_record((kind, key, _new_entry((w, slab, slot, gen, length, checksum)))))
                    pos = end
                    continue
        record = _record_at(data, pos)
        if record is None:
            nxt = pos + 1
            while nxt < n and _record_at(data, nxt) is None:
                nxt += 1
            if nxt >= n:
                break  # nothing good follows: an incomplete tail, left for later
            skipped += nxt - pos
            pos = nxt
            continue
        out.append(record)
        pos += RECORD.size + len(record.key.encode())
    return out, pos, skipped


def namespace_dir(root: str | os.PathLike[str], namespace: Namespace) -> Path:
    """The directory holding one namespace's writers under ``root``."""
    return Path(root) / f"ns-{namespace.digest()}"


def read_namespace_file(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``namespace.json`` of a namespace directory ({} when absent or damaged: it is
    derivable, and the next writer that knows the page size rewrites it)."""
    path = Path(directory) / NAMESPACE_FILE
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("%s is damaged (%s): treated as absent until a writer rebuilds it", path, exc)
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("slot_bytes"), int):
        log.warning("%s is damaged (no slot_bytes): treated as absent until a writer rebuilds it",
                    path)
        return {}
    return data


def write_namespace_file(directory: Path, namespace: Namespace, slot_bytes: int) -> None:
    """Create ``namespace.json`` if absent, rebuild it if damaged (atomically either way:
    a synced temporary file linked or renamed into place), then check that the namespace
    stores pages of ``slot_bytes``."""
    from hicache_l3.slab.files import make_dir, open_file

    make_dir(directory, exist_ok=True)
    path = directory / NAMESPACE_FILE
    body = {"format": FORMAT_VERSION, "slot_bytes": slot_bytes, "namespace": namespace.fields()}
    existing = read_namespace_file(directory)
    if not existing:
        damaged = path.exists()
        tmp = directory / f".namespace.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            os.write(fd, json.dumps(body, indent=1, sort_keys=True).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            if damaged:
                os.replace(tmp, path)
                log.warning("%s was damaged: rebuilt for %d-byte pages", path, slot_bytes)
            else:
                os.link(tmp, path)  # atomic create-if-absent
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        existing = read_namespace_file(directory)
    if existing.get("slot_bytes") != slot_bytes:
        raise ConfigError(
            f"{directory} stores pages of {existing.get('slot_bytes')} bytes, "
            f"not {slot_bytes}: page_bytes differs for the same namespace"
        )
