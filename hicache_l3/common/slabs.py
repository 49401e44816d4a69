"""The slab store: pages packed into preallocated, reused slab files, with an index that
every process of a namespace can read. Shared by the file, nixl (file mode) and hf3fs
connectors, which differ only in how bytes move.

Layout under ``<root>/ns-<namespace digest>/``::

    namespace.json            the namespace and the slot size, written once
    writers/wNNNN/lock        flock-ed by the process that owns this writer directory
    writers/wNNNN/index.log   append-only index records of this writer
    writers/wNNNN/slab-NNNNNN.dat   preallocated data files cut into slots

Writers. Each process that stores pages owns one writer directory (it adopts a free
one on open, so restarts reuse their slabs instead of growing the disk) and writes
only into its own slots: writers never contend for a slot. It evicts its own least
recently used slots when its capacity is reached.

Slots. A slot is a 4 KiB header block, the data, and an end marker::

    [ ... | start header (64 B) ][ data (slot_bytes) ][ end marker (64 B) | pad ]

The start header holds (magic, generation, length, checksum, key fingerprint); the
end marker holds (generation, key fingerprint). Every write gets a new generation,
unique per writer. A writer fills a slot in two steps: first the end marker, then the
start header and data in one ``pwritev``. A reader reads header, data and marker in one
``preadv`` and accepts the page only if both carry the generation and fingerprint the
index gave it. A reader that overlaps a rewrite of the slot either reads the new end
marker (generation differs: miss) or finished reading the data before the rewrite
began. A torn write, a recycled slot or a crash mid-write therefore reads as a miss,
never as somebody else's bytes; checksums add detection of bytes altered at rest.

Index. A record is appended to the writer's ``index.log`` only after the data is
written (and synced, under ``fsync="data"``), so an entry is never visible before its
bytes. Readers tail every writer's log (one ``fstat`` per writer per call, one
``stat`` of ``writers/`` to notice new writers), so ``exists`` sees other processes'
pages on the next call. A PUT record for a slot supersedes whatever that slot held; a
DEL record names the exact (writer, slab, slot, generation) it removes, so a stale DEL
can never remove a newer page. The owner frees its slot when it reads a DEL for it.

What the index relies on from the filesystem: ``write(2)`` with ``O_APPEND`` by a single
owner per log; ``stat``/``fstat`` sizes and directory mtime that reflect other local
processes' writes; ``flock`` to adopt a writer directory; ``mkdir`` atomicity to create
one. (Multi-node use over a network filesystem is the hf3fs connector's concern.)
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import struct
import threading
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace

log = logging.getLogger("hicache_l3.slabs")

FORMAT_VERSION = 1
HEADER_BLOCK = 4096
MARKER = 64  # bytes of a start header and of an end marker
ALIGN = 4096
START = struct.Struct("<4sHHQQQ16s16x")  # magic, version, flags, gen, length, checksum, key fp
END = struct.Struct("<4s4xQ16s32x")  # magic, gen, key fp
START_MAGIC, END_MAGIC = b"HL3S", b"HL3E"
# crc, kind, pad, key length, writer, slab, slot, pad, gen, length, checksum
RECORD = struct.Struct("<IBBHIIIIQQQ")
PUT, DEL, GEN = 1, 2, 3  # GEN: "generations up to this one were used" (kept by compaction)
PREALLOCATE_CHUNK = 32 << 20  # slab space is reserved as slots are first used: doubling, this at most
COMPACT_MIN_BYTES = 4 << 20  # a writer's log is rewritten once larger than this and 3x its live part


def _round_up(value: int, align: int) -> int:
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


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Byte offsets of a slot's parts, derived from the slot size."""

    slot_bytes: int
    stride: int = 0  # bytes one slot takes in its slab (header block + data + marker, aligned)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stride", HEADER_BLOCK + _round_up(self.slot_bytes + MARKER, ALIGN))

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


class _LogTail:
    """A reader's position in one writer's index log (the file may be replaced by the
    writer's compaction: a new inode means "read it again from the start")."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.ino = os.fstat(self.fd).st_ino
        self.offset = 0
        self.max_gen = 0

    def reopen(self) -> None:
        """Follow the path to its current file, from offset 0."""
        fd = os.open(self.path, os.O_RDONLY)
        os.close(self.fd)
        self.fd, self.ino, self.offset = fd, os.fstat(fd).st_ino, 0


class SlabStore:
    """Slots in slab files plus the shared index, for one namespace under ``root``.

    Thread-safe. The store owns metadata only; the caller moves the bytes with the
    offsets it gets from :meth:`reserve` (set) and :meth:`lookup` (get), then calls
    :meth:`commit` / :meth:`abort`, or :meth:`invalidate` on a failed check.

    ``capacity_bytes`` bounds this writer's slabs (each writer process has its own);
    when full, the least recently used own slot is reused. ``fsync`` is ``"none"``
    (page cache only), ``"data"`` (slabs synced before index records are published) or
    ``"always"`` (the index log synced too).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        slot_bytes: int,
        *,
        capacity_bytes: int | None = None,
        slab_bytes: int = 256 << 20,
        fsync: str = "none",
        direct: bool = False,
    ) -> None:
        if fsync not in ("none", "data", "always"):
            raise ConfigError(f"fsync must be 'none', 'data' or 'always', got {fsync!r}")
        self.namespace = namespace
        self.directory = Path(root) / f"ns-{namespace.digest()}"
        self.writers_dir = self.directory / "writers"
        self.geometry = Geometry(slot_bytes)
        self.fsync = fsync
        self.direct = direct
        stride = self.geometry.stride
        self.slots_per_slab = max(1, slab_bytes // stride)
        self.max_slots = None if capacity_bytes is None else max(1, capacity_bytes // stride)
        if self.max_slots is not None:
            self.slots_per_slab = min(self.slots_per_slab, self.max_slots)
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._slot_key: dict[tuple[int, int, int], str] = {}
        self._deleted: dict[tuple[int, int, int], int] = {}  # slot -> newest generation deleted
        self._tails: dict[int, _LogTail] = {}
        self._fds: dict[tuple[int, int, bool], int] = {}
        self._retired: list[int] = []  # descriptors replaced while possibly in use
        self._dir_mtime = -1
        self._closed = False
        # writer state, created on first write
        self.me: int | None = None
        self._lock_fd = -1
        self._log_fd = -1
        self._lru: collections.OrderedDict[tuple[int, int], str] = collections.OrderedDict()
        self._free: list[tuple[int, int]] = []
        self._n_slabs = 0
        self._allocated: dict[int, int] = {}  # own slab -> bytes preallocated from its start
        self._next_gen = 1
        self._foreign_dels: list[tuple[str, Entry]] = []  # our DELs of other writers' slots
        self._adopting = -1
        self.evictions = 0
        self.compactions = 0
        self._write_namespace_file()
        self.writers_dir.mkdir(parents=True, exist_ok=True)

    # ---- namespace file -------------------------------------------------------------
    def _write_namespace_file(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / "namespace.json"
        body = {
            "format": FORMAT_VERSION,
            "slot_bytes": self.geometry.slot_bytes,
            "namespace": self.namespace.fields(),
        }
        if not path.exists():
            tmp = self.directory / f".namespace.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp.write_text(json.dumps(body, indent=1, sort_keys=True))
            try:
                os.link(tmp, path)  # atomic create-if-absent
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
        existing = read_namespace_file(self.directory)
        if existing.get("slot_bytes") != self.geometry.slot_bytes:
            raise ConfigError(
                f"{self.directory} stores pages of {existing.get('slot_bytes')} bytes, "
                f"not {self.geometry.slot_bytes}: page_bytes differs for the same namespace"
            )

    # ---- reading the shared index ------------------------------------------------------
    def refresh(self) -> None:
        """Pick up index records appended by every writer (new writers included)."""
        with self._lock:
            self._check_open()
            try:
                mtime = os.stat(self.writers_dir).st_mtime_ns
            except FileNotFoundError:
                return
            if mtime != self._dir_mtime:
                self._dir_mtime = mtime
                self._scan_writers()
            for writer, tail in self._tails.items():
                if writer == self.me:
                    continue
                try:
                    st = os.stat(tail.path)
                except FileNotFoundError:
                    continue
                if st.st_ino != tail.ino:  # the writer compacted its log
                    self._forget_writer(writer)
                    tail.reopen()
                    st = os.fstat(tail.fd)
                if st.st_size > tail.offset:
                    self._read_tail(writer, tail, st.st_size)

    def _forget_writer(self, writer: int) -> None:
        for key, entry in list(self._entries.items()):
            if entry.writer == writer:
                del self._entries[key]
                self._slot_key.pop((writer, entry.slab, entry.slot), None)

    def _scan_writers(self) -> None:
        for name in os.listdir(self.writers_dir):
            if not (name.startswith("w") and name[1:].isdigit()):
                continue
            writer = int(name[1:])
            if writer in self._tails:
                continue
            try:
                self._tails[writer] = _LogTail(self.writers_dir / name / "index.log")
            except FileNotFoundError:
                continue

    def _read_tail(self, writer: int, tail: _LogTail, size: int) -> None:
        data = os.pread(tail.fd, size - tail.offset, tail.offset)
        pos, n = 0, len(data)
        hsize = RECORD.size
        while pos + hsize <= n:
            crc, kind, _, keylen, w, slab, slot, _, gen, length, checksum = RECORD.unpack_from(
                data, pos
            )
            end = pos + hsize + keylen
            if end > n:
                break
            if zlib.crc32(data[pos + 4 : end]) != crc:
                break  # a record still being written (or a crashed writer's tail)
            key = data[pos + hsize : end].decode()
            if kind == PUT:
                self._apply_put(key, Entry(w, slab, slot, gen, length, checksum))
                tail.max_gen = max(tail.max_gen, gen)
            elif kind == DEL:
                self._apply_del(key, Entry(w, slab, slot, gen, length, checksum))
                if w != writer and writer == self._adopting:
                    self._foreign_dels.append((key, Entry(w, slab, slot, gen, length, checksum)))
            elif kind == GEN:
                tail.max_gen = max(tail.max_gen, gen)
            pos = end
        tail.offset += pos

    def _apply_put(self, key: str, entry: Entry) -> None:
        where = (entry.writer, entry.slab, entry.slot)
        if self._deleted.get(where, 0) >= entry.gen:
            return  # a DEL read earlier (from another writer's log) already removed it
        old_key = self._slot_key.get(where)
        if old_key is not None:
            old = self._entries.get(old_key)
            if old is not None and (old.writer, old.slab, old.slot) == where:
                del self._entries[old_key]
        previous = self._entries.get(key)
        if previous is not None:
            self._slot_key.pop((previous.writer, previous.slab, previous.slot), None)
        self._entries[key] = entry
        self._slot_key[where] = key

    def _apply_del(self, key: str, entry: Entry) -> None:
        where = (entry.writer, entry.slab, entry.slot)
        if self._deleted.get(where, 0) < entry.gen:
            self._deleted[where] = entry.gen  # logs are read in any order: DEL wins over PUT
        current = self._entries.get(key)
        if current is None or (current.writer, current.slab, current.slot, current.gen) != (
            entry.writer, entry.slab, entry.slot, entry.gen
        ):
            return
        del self._entries[key]
        self._slot_key.pop((entry.writer, entry.slab, entry.slot), None)
        if entry.writer == self.me:
            self._release((entry.slab, entry.slot))

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: is it in the index (after a refresh)?"""
        self.refresh()
        entries = self._entries
        return [k in entries for k in keys]

    def lookup(self, keys: Sequence[str]) -> list[tuple[int, Entry] | None]:
        """Per key: ``(fd, entry)`` to read the slot from, or None for a miss."""
        self.refresh()
        out: list[tuple[int, Entry] | None] = []
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                out.append(None if entry is None else (self._fd(entry.writer, entry.slab), entry))
        return out

    def touch(self, own: Sequence[tuple[int, int]]) -> None:
        """Mark own ``(slab, slot)`` pairs as recently used (LRU order)."""
        if not own:
            return
        with self._lock:
            lru = self._lru
            for where in own:
                if where in lru:
                    lru.move_to_end(where)

    def invalidate(self, key: str, entry: Entry) -> None:
        """Forget ``key`` if it still maps to ``entry`` (its slot failed a check)."""
        with self._lock:
            if self._entries.get(key) == entry:
                del self._entries[key]
                self._slot_key.pop((entry.writer, entry.slab, entry.slot), None)

    def fd(self, writer: int, slab: int, direct: bool = False) -> int:
        """A file descriptor on a slab (cached; O_DIRECT when ``direct``)."""
        with self._lock:
            return self._fd(writer, slab, direct)

    def _fd(self, writer: int, slab: int, direct: bool = False) -> int:
        fd = self._fds.get((writer, slab, direct))
        if fd is None:
            flags = os.O_RDWR if writer == self.me else os.O_RDONLY
            if direct:
                flags |= os.O_DIRECT
            fd = os.open(self._slab_path(writer, slab), flags)
            self._fds[(writer, slab, direct)] = fd
        return fd

    def _slab_path(self, writer: int, slab: int) -> Path:
        return self.writers_dir / f"w{writer:04d}" / f"slab-{slab:06d}.dat"

    # ---- writing -----------------------------------------------------------------------
    def reserve(self, count: int) -> list[tuple[int, int, int, int]]:
        """Up to ``count`` own slots as ``(fd, slab, slot, gen)``; fewer when full.

        Evicts least recently used own pages when the capacity is reached; their keys
        are gone from the index at once.
        """
        with self._lock:
            self._check_open()
            self._become_writer()
            taken = []
            for _ in range(count):
                where = self._take_slot()
                if where is None:
                    break
                taken.append(where)
            highest: dict[int, int] = {}
            for slab, slot in taken:
                if slot > highest.get(slab, -1):
                    highest[slab] = slot
            fds, usable = {}, {}  # per slab: its fd, and the slots below this bound have space
            for slab, slot in highest.items():
                fds[slab] = fd = self._fd(self.me, slab)  # type: ignore[arg-type]
                try:
                    self._preallocate(fd, (slab, slot))  # space up to the batch's highest slot
                    usable[slab] = slot + 1
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    usable[slab] = self._allocated.get(slab, 0) // self.geometry.stride
            out = []
            for i, (slab, slot) in enumerate(taken):
                if slot >= usable[slab]:  # the disk is full: this and the rest get no slot
                    self._free.extend(reversed(taken[i:]))
                    break
                out.append((fds[slab], slab, slot, self._next_gen))
                self._next_gen += 1
            return out

    def _preallocate(self, fd: int, where: tuple[int, int]) -> None:
        """Reserve disk space up to and past this slot, a chunk at a time, so that a full
        disk shows as ``NO_SPACE`` here and a slab's space is allocated only once used."""
        slab, slot = where
        end = (slot + 1) * self.geometry.stride
        done = self._allocated.get(slab, 0)
        if end <= done:
            return
        size = os.fstat(fd).st_size
        upto = min(size, max(end, min(2 * done, done + PREALLOCATE_CHUNK)))  # doubling, capped
        try:
            os.posix_fallocate(fd, done, upto - done)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        self._allocated[slab] = upto

    def reserve_new(self, keys: Sequence[str]) -> tuple[list[tuple[int, tuple[int, int, int, int]]],
                                                         list[int]]:
        """Slots for the keys that are not stored yet (each key once): ``[(index, (fd, slab,
        slot, gen))]``, and the indices of keys left without a slot because the store is
        full. Keys already stored need no write (same key, same bytes)."""
        present = self.contains(keys)
        seen: set[str] = set()
        todo = []
        for i, key in enumerate(keys):
            if not present[i] and key not in seen:
                seen.add(key)
                todo.append(i)
        slots = self.reserve(len(todo))
        return list(zip(todo, slots)), todo[len(slots):]

    def _take_slot(self) -> tuple[int, int] | None:
        if self._free:
            return self._free.pop()
        if self.max_slots is None or self._n_slabs * self.slots_per_slab < self.max_slots:
            self._grow()
            return self._free.pop()
        while self._lru:
            where, key = self._lru.popitem(last=False)
            entry = self._entries.get(key)
            if entry is not None and (entry.writer, entry.slab, entry.slot) == (self.me, *where):
                del self._entries[key]
            self._slot_key.pop((self.me, *where), None)  # type: ignore[arg-type]
            self.evictions += 1
            return where
        return None

    def _grow(self) -> None:
        slab = self._n_slabs
        slots = self.slots_per_slab
        if self.max_slots is not None:
            slots = min(slots, self.max_slots - slab * self.slots_per_slab)
        size = slots * self.geometry.stride
        fd = os.open(self._slab_path(self.me, slab), os.O_RDWR | os.O_CREAT, 0o644)  # type: ignore[arg-type]
        os.ftruncate(fd, size)  # sparse: space is reserved chunk by chunk as slots are first used
        self._fds[(self.me, slab, False)] = fd  # type: ignore[index]
        self._n_slabs += 1
        self._free.extend((slab, s) for s in reversed(range(slots)))

    def commit(self, items: Sequence[tuple[str, int, int, int, int, int]]) -> None:
        """Publish written pages: ``(key, slab, slot, gen, length, checksum)`` each.

        Call only after the bytes are written; syncs slabs first under ``fsync="data"``.
        """
        if not items:
            return
        me = self.me
        assert me is not None
        if self.fsync != "none":
            for slab in {it[1] for it in items}:
                os.fdatasync(self.fd(me, slab))
        records = b"".join([_encode_record(PUT, key, me, s, sl, g, ln, cs)
                            for key, s, sl, g, ln, cs in items])
        with self._lock:
            self._check_open()
            os.write(self._log_fd, records)
            self._tails[me].offset += len(records)
            apply, lru = self._apply_put, self._lru
            for key, slab, slot, gen, length, checksum in items:
                apply(key, Entry(me, slab, slot, gen, length, checksum))
                where = (slab, slot)
                lru.pop(where, None)  # a reserved slot is not in the LRU; be sure it ends last
                lru[where] = key
            self._maybe_compact()
        if self.fsync == "always":
            os.fdatasync(self._log_fd)

    def abort(self, slots: Iterable[tuple[int, int]]) -> None:
        """Give back reserved ``(slab, slot)`` pairs that were not committed."""
        with self._lock:
            for where in slots:
                self._free.append(where)

    def _release(self, where: tuple[int, int]) -> None:
        if self._lru.pop(where, None) is not None:
            self._free.append(where)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys from the shared index (any writer's); True where a key was there."""
        self.refresh()
        with self._lock:
            self._become_writer()
            found, records = [], []
            for key in keys:
                entry = self._entries.pop(key, None)
                found.append(entry is not None)
                if entry is None:
                    continue
                self._slot_key.pop((entry.writer, entry.slab, entry.slot), None)
                self._deleted[(entry.writer, entry.slab, entry.slot)] = entry.gen
                records.append(_encode_record(DEL, key, entry.writer, entry.slab, entry.slot,
                                              entry.gen, entry.length, entry.checksum))
                if entry.writer == self.me:
                    self._release((entry.slab, entry.slot))
                else:
                    self._foreign_dels.append((key, entry))
            if records:
                data = b"".join(records)
                os.write(self._log_fd, data)
                self._tails[self.me].offset += len(data)  # type: ignore[index]
                self._maybe_compact()
            return found

    def _maybe_compact(self) -> None:
        size = self._tails[self.me].offset  # type: ignore[index]
        live = (len(self._lru) + len(self._foreign_dels)) * (RECORD.size + 80)
        if size > COMPACT_MIN_BYTES and size > 3 * live:
            self.compact()

    def compact(self) -> None:
        """Rewrite this writer's log with only what is live: a GEN record, a PUT per own
        page, and the DELs of other writers' slots that no newer PUT superseded. Readers
        notice the new file (inode) and re-read it; the rename is atomic."""
        with self._lock:
            me = self.me
            if me is None:
                return
            records = [_encode_record(GEN, "", me, 0, 0, self._next_gen - 1, 0, 0)]
            for where, key in self._lru.items():
                e = self._entries.get(key)
                if e is not None and e.writer == me and (e.slab, e.slot) == where:
                    records.append(_encode_record(PUT, key, me, e.slab, e.slot, e.gen, e.length,
                                                  e.checksum))
            kept = []
            for key, d in self._foreign_dels:
                current = self._slot_key.get((d.writer, d.slab, d.slot))
                newer = current is not None and self._entries[current].gen > d.gen
                if not newer:
                    kept.append((key, d))
                    records.append(_encode_record(DEL, key, d.writer, d.slab, d.slot, d.gen,
                                                  d.length, d.checksum))
            self._foreign_dels = kept
            data = b"".join(records)
            tail = self._tails[me]
            tmp = tail.path.with_name(f"index.log.compact-{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, data)
                if self.fsync != "none":
                    os.fdatasync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, tail.path)
            os.close(self._log_fd)
            self._log_fd = os.open(tail.path, os.O_RDWR | os.O_APPEND)
            tail.reopen()
            tail.offset = len(data)
            self.compactions += 1

    def clear(self) -> int:
        """Delete every key of this namespace known now; returns how many."""
        self.refresh()
        with self._lock:
            keys = list(self._entries)
        return sum(self.delete(keys))

    def _become_writer(self) -> None:
        if self.me is not None:
            return
        self.refresh()
        existing = sorted(int(n[1:]) for n in os.listdir(self.writers_dir)
                          if n.startswith("w") and n[1:].isdigit())
        for writer in existing:
            if self._try_own(writer):
                return
        writer = (existing[-1] + 1) if existing else 0
        while True:
            try:
                (self.writers_dir / f"w{writer:04d}").mkdir()
            except FileExistsError:
                writer += 1
                continue
            if self._try_own(writer):
                return
            writer += 1

    def _try_own(self, writer: int) -> bool:
        wdir = self.writers_dir / f"w{writer:04d}"
        fd = os.open(wdir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        if not self._lock_writer(fd):
            os.close(fd)
            return False
        self._lock_fd = fd
        log_path = wdir / "index.log"
        self._log_fd = os.open(log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        tail = self._tails.get(writer)
        if tail is None:
            tail = _LogTail(log_path)
            self._tails[writer] = tail
        else:  # read our own log from the start, to collect the DELs we issued
            self._forget_writer(writer)
            tail.reopen()
        self._adopting = writer
        size = os.fstat(tail.fd).st_size
        if size > tail.offset:
            self._read_tail(writer, tail, size)
        self._adopting = -1
        if os.fstat(self._log_fd).st_size > tail.offset:
            os.ftruncate(self._log_fd, tail.offset)  # drop a crashed writer's torn tail
        self.me = writer
        # descriptors opened while we only read this writer's slabs are read-only; threads
        # may still be reading through them, so retire them (closed at close) rather than close
        for cached in [k for k in self._fds if k[0] == writer]:
            self._retired.append(self._fds.pop(cached))
        self._next_gen = tail.max_gen + 1
        owned = sorted(
            ((e.gen, (e.slab, e.slot), k) for k, e in self._entries.items() if e.writer == writer)
        )
        for _, where, key in owned:
            self._lru[where] = key
        while self._slab_path(writer, self._n_slabs).exists():
            slab = self._n_slabs
            size = os.path.getsize(self._slab_path(writer, slab))
            self._n_slabs += 1
            self._free.extend((slab, s) for s in reversed(range(size // self.geometry.stride))
                              if (slab, s) not in self._lru)
        return True

    def _lock_writer(self, fd: int) -> bool:
        """Take the writer directory's lock on ``fd`` without blocking; False if held.
        (``flock``: exclusive per node only on FUSE mounts; the hf3fs store adds leases.)"""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        return True

    # ---- lifecycle ---------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("slab store is closed")

    def stats(self) -> dict[str, Any]:
        """Counts of indexed pages, own slots, free slots and evictions."""
        with self._lock:
            return {
                "indexed_pages": len(self._entries),
                "writer": self.me,
                "own_pages": len(self._lru),
                "free_slots": len(self._free),
                "slabs": self._n_slabs,
                "max_slots": self.max_slots,
                "evictions": self.evictions,
                "log_compactions": self.compactions,
                "writers_seen": len(self._tails),
            }

    def close(self) -> None:
        """Close every file descriptor and release the writer directory."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            fds = [*self._fds.values(), *self._retired, *(t.fd for t in self._tails.values())]
            fds += [fd for fd in (self._log_fd, self._lock_fd) if fd >= 0]
            self._fds.clear()
            self._tails.clear()
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)


_RECORD_BODY = struct.Struct(RECORD.format[:1] + RECORD.format[2:])  # RECORD without its CRC
_CRC = struct.Struct("<I")


def _encode_record(kind: int, key: str, writer: int, slab: int, slot: int, gen: int,
                   length: int, checksum: int) -> bytes:
    kb = key.encode()
    body = _RECORD_BODY.pack(kind, 0, len(kb), writer, slab, slot, 0, gen, length, checksum) + kb
    return _CRC.pack(zlib.crc32(body)) + body


def read_namespace_file(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``namespace.json`` of a namespace directory ({} when absent)."""
    try:
        data: dict[str, Any] = json.loads((Path(directory) / "namespace.json").read_text())
        return data
    except FileNotFoundError:
        return {}
