"""The slab store's on-disk format (version 2; 3 for packed small slots): slot geometry,
the marker record of a slot, index log records (PUT, DEL, GEN) and ``namespace.json``.
A page is accepted only if its marker, read after its data, is exactly the one its index
entry implies (docs/architecture.md, "The slot layout").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import operator
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.integrity import key_fingerprint
from hicache_l3.common.keys import Namespace

FORMAT_VERSION = 2  # the marker record's version; namespace.json's format of 4 KiB-aligned slots
PACKED_FORMAT = 3  # namespace.json's format of a namespace whose small slots are packed
PACKED_MAX = 2048  # slots of at most this many bytes are packed (format 3); larger ones never
PACKED_MIN_STRIDE = 64  # a packed slot's data start on a cache line at least
MARKER = 64  # bytes of a start header and of an end marker
RECORD_BYTES = 2 * MARKER  # a slot's marker record: start header, then end marker
GROUP_SLOTS = 512  # slots per group: a 64 KiB table of marker records
_GROUP_SHIFT = GROUP_SLOTS.bit_length() - 1  # GROUP_SLOTS is a power of two
ALIGN = 4096
START = struct.Struct("<4sHHQQQ16s16x")  # magic, version, flags, gen, length, checksum, key fp
END = struct.Struct("<4s4xQ16s32x")  # magic, gen, key fp
START_MAGIC, END_MAGIC = b"HL3S", b"HL3E"
MARKER_RECORD = struct.Struct(START.format + END.format[1:])  # START then END, packed at once
# crc, kind, pad, key length, writer, slab, slot, pad, gen, length, checksum
RECORD = struct.Struct("<IBBHIIIIQQQ")
PUT, DEL, GEN = 1, 2, 3
NAMESPACE_FILE = "namespace.json"

log = logging.getLogger("hicache_l3.slab")


def round_up(value: int, align: int) -> int:
    """``value`` rounded up to a multiple of ``align``."""
    return (value + align - 1) // align * align


class Entry(NamedTuple):
    """Where one stored page is: writer, slab, slot, generation, length, checksum."""

    writer: int
    slab: int
    slot: int
    gen: int
    length: int
    checksum: int


_GEN, _LENGTH, _CHECKSUM = (operator.itemgetter(i) for i in (3, 4, 5))  # Entry fields


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
    """Byte offsets of a slot's parts, derived from the slot size: groups of
    :data:`GROUP_SLOTS` slots, each a marker table then the data. ``stride`` is what one slot
    counts against a capacity (data area plus marker record)."""

    slot_bytes: int
    pack: dataclasses.InitVar[bool | None] = None  # None: as a new namespace would (:func:`packs`)
    packed: bool = dataclasses.field(init=False, default=False)  # small slots packed (format 3)
    data_stride: int = 0  # bytes between the data of consecutive slots of a group
    table: int = 0  # bytes of a group's marker table
    group: int = 0  # bytes of a whole group
    stride: int = 0  # data_stride + RECORD_BYTES

    def __post_init__(self, pack: bool | None) -> None:
        packed = packs(self.slot_bytes) if pack is None else pack
        if packed and not packs(self.slot_bytes):
            raise ValueError(f"slots of {self.slot_bytes} bytes are never packed (at most {PACKED_MAX})")
        object.__setattr__(self, "packed", packed)
        if packed:  # the smallest power of two that holds the slot
            data_stride = max(PACKED_MIN_STRIDE, 1 << (self.slot_bytes - 1).bit_length())
        else:
            data_stride = round_up(self.slot_bytes, ALIGN)
        table = GROUP_SLOTS * RECORD_BYTES
        object.__setattr__(self, "data_stride", data_stride)
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "group", table + GROUP_SLOTS * data_stride)
        object.__setattr__(self, "stride", data_stride + RECORD_BYTES)

    def marker_offset(self, slot: int) -> int:
        """Offset of the slot's marker record (start header, then end marker)."""
        g, i = divmod(slot, GROUP_SLOTS)
        return g * self.group + i * RECORD_BYTES

    def data_offset(self, slot: int) -> int:
        """Offset of the slot's data (4 KiB aligned; packed: aligned to its data stride)."""
        g, i = divmod(slot, GROUP_SLOTS)
        return g * self.group + self.table + i * self.data_stride

    def offsets(self, slots: Iterable[int]) -> tuple[list[int], list[int]]:
        """(data offsets, marker offsets) of ``slots``, in order."""
        slots = list(slots)
        # with g = slot // GROUP_SLOTS: data = g * group + table + (slot - g * GROUP_SLOTS) *
        # data_stride = (g + 1) * table + slot * data_stride; marker likewise
        shift, table, data_stride = _GROUP_SHIFT, self.table, self.data_stride
        span = GROUP_SLOTS * data_stride
        return ([((s >> shift) + 1) * table + s * data_stride for s in slots],
                [(s >> shift) * span + s * RECORD_BYTES for s in slots])

    def bytes_for(self, slots: int) -> int:
        """Bytes a slab of ``slots`` slots spans, to the end of the last one's data (0 for none)."""
        if slots <= 0:
            return 0
        return self.data_offset(slots - 1) + self.data_stride

    def slots_in(self, nbytes: int) -> int:
        """How many whole slots the first ``nbytes`` of a slab hold (:meth:`bytes_for`'s inverse)."""
        g, rest = divmod(max(0, nbytes), self.group)
        partial = 0 if rest < self.table else min(GROUP_SLOTS - 1, (rest - self.table) // self.data_stride)
        return g * GROUP_SLOTS + partial


def packs(slot_bytes: int) -> bool:
    """Whether a new namespace of ``slot_bytes`` slots packs them (format 3)."""
    return 0 < slot_bytes <= PACKED_MAX


def layout_format(slot_bytes: int) -> int:
    """The ``format`` a new namespace of ``slot_bytes`` slots writes in ``namespace.json``."""
    return PACKED_FORMAT if packs(slot_bytes) else FORMAT_VERSION


def encode_start(gen: int, length: int, checksum: int, fingerprint: bytes) -> bytes:
    """The 64-byte start header of a slot (the first half of its marker record)."""
    return START.pack(START_MAGIC, FORMAT_VERSION, 0, gen, length, checksum, fingerprint)


def encode_end(gen: int, fingerprint: bytes) -> bytes:
    """The 64-byte end marker of a slot (the second half of its marker record)."""
    return END.pack(END_MAGIC, gen, fingerprint)


def encode_markers(gens: Iterable[int], lengths: Iterable[int], checksums: Iterable[int],
                   fingerprints: Iterable[bytes]) -> list[bytes]:
    """The 128-byte marker records of many slots, one per ``zip`` of the arguments
    (``checksum`` 0: none)."""
    pack = MARKER_RECORD.pack
    return [pack(START_MAGIC, FORMAT_VERSION, 0, gen, length, checksum, fp, END_MAGIC, gen, fp)
            for gen, length, checksum, fp in zip(gens, lengths, checksums, fingerprints)]


def encode_marker(gen: int, length: int, checksum: int, fingerprint: bytes) -> bytes:
    """:func:`encode_markers` of one slot."""
    return encode_markers((gen,), (length,), (checksum,), (fingerprint,))[0]


def expected_markers(entries: Sequence[Entry], keys: Iterable[str]) -> list[bytes]:
    """The marker record a reader must find in each entry's slot for its key (generation,
    length and checksum from ``entries[j]``, fingerprint of ``keys[j]``)."""
    return encode_markers(map(_GEN, entries), map(_LENGTH, entries), map(_CHECKSUM, entries),
                          map(key_fingerprint, keys))


def check_marker(record: bytes | memoryview, entry: Entry, fingerprint: bytes) -> bool:
    """True when a slot's marker record is the one ``entry`` and the key's fingerprint imply."""
    return record == encode_marker(entry.gen, entry.length, entry.checksum, fingerprint)


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
    were skipped as damaged. Decoding resynchronises past a damaged record; bytes after the
    last good record are not consumed."""
    out: list[Record] = []
    pos, n, skipped = 0, len(data), 0
    unpack, size, crc32, append = RECORD.unpack_from, RECORD.size, zlib.crc32, out.append
    while pos < n:
        # a whole, good record here (what _record_at checks, inlined: opening a store
        # replays every record through this loop)
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
        nxt = pos + 1  # none: the next good record, past damage
        while nxt < n and _record_at(data, nxt) is None:
            nxt += 1
        if nxt >= n:
            break  # nothing good follows: an incomplete tail, left for later
        skipped += nxt - pos
        pos = nxt
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


def write_namespace_file(directory: Path, namespace: Namespace, slot_bytes: int) -> Geometry:
    """Create ``namespace.json`` if absent, rebuild it if damaged (atomically), check
    that the namespace stores pages of ``slot_bytes``; returns the namespace's geometry (the
    layout it was created with). :class:`ConfigError` on a mismatch."""
    from hicache_l3.slab.files import make_dir, open_file

    make_dir(directory, exist_ok=True)
    path = directory / NAMESPACE_FILE
    body = {"format": layout_format(slot_bytes), "slot_bytes": slot_bytes, "namespace": namespace.fields()}
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
    geometry = geometry_of(directory, existing)
    if existing.get("slot_bytes") != slot_bytes:
        raise ConfigError(
            f"{directory} stores pages of {existing.get('slot_bytes')} bytes, "
            f"not {slot_bytes}: page_bytes differs for the same namespace"
        )
    return geometry


def check_format(directory: str | os.PathLike[str], meta: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` when ``meta`` (a ``namespace.json``) is of a format
    other than 2 or 3."""
    found = meta.get("format", 1)
    if not meta or found == FORMAT_VERSION:
        return
    if found == PACKED_FORMAT and packs(meta["slot_bytes"]):
        return
    raise ConfigError(
        f"{directory} holds a slab store in on-disk format {found} with "
        f"{meta.get('slot_bytes')}-byte slots; this version reads and writes format "
        f"{FORMAT_VERSION}, and format {PACKED_FORMAT} for slots of at most {PACKED_MAX} "
        f"bytes. The store is a cache: delete {directory} (or the whole root) and restart, "
        "or point root at another directory"
    )


def geometry_of(directory: str | os.PathLike[str], meta: dict[str, Any]) -> Geometry:
    """The slot geometry of a namespace from its ``namespace.json`` ``meta`` (checked)."""
    check_format(directory, meta)
    return Geometry(meta["slot_bytes"], pack=meta.get("format") == PACKED_FORMAT)
