"""The index reader every process of a namespace runs: it tails every writer's
``index.log`` and keeps ``key -> Entry``.

Readers tail every writer's log (one ``stat`` per writer per call, one ``stat`` of
``writers/`` to notice new writers), so ``exists`` sees other processes' pages on the next
call. A PUT record for a slot supersedes whatever that slot held; a DEL record names the
exact (writer, slab, slot, generation) it removes, so a stale DEL can never remove a newer
page. Logs are read in any order: a DEL read before the PUT it removes still wins.

What the index relies on from the filesystem: ``stat``/``fstat`` sizes and directory
mtime that reflect other local processes' writes (multi-node use rescans instead: see
:mod:`hicache_l3.slab.shared`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from hicache_l3.slab.files import SlabFiles, is_real_dir, open_file, parse_writer_name, writer_name
from hicache_l3.slab.format import DEL, GEN, PUT, Entry, Located, decode_records

log = logging.getLogger("hicache_l3.slab")
MAX_DROPPED = 1 << 16


class LogTail:
    """A reader's position in one writer's index log (the file may be replaced by the
    writer's compaction: a new inode means "read it again from the start")."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_file(path, os.O_RDONLY)
        self.ino = os.fstat(self.fd).st_ino
        self.offset = 0
        self.max_gen = 0

    def reopen(self) -> None:
        """Follow the path to its current file, from offset 0."""
        fd = open_file(self.path, os.O_RDONLY)
        os.close(self.fd)
        self.fd, self.ino, self.offset = fd, os.fstat(fd).st_ino, 0


class SlabIndex:
    """``key -> Entry`` for one namespace, built from every writer's log.

    ``lock`` guards the index and is shared with the writer that composes it. ``own`` is
    the writer this process owns (its log is appended by this process, not tailed);
    ``on_free(slab, slot)`` is called when a DEL read from a log frees one of its slots.
    """

    def __init__(self, writers_dir: Path, files: SlabFiles) -> None:
        self.writers_dir = writers_dir
        self.files = files
        self.lock = threading.RLock()
        self.entries: dict[str, Entry] = {}
        self.slot_key: dict[tuple[int, int, int], str] = {}
        self.deleted: dict[tuple[int, int, int], int] = {}  # slot -> newest generation deleted
        self.tails: dict[int, LogTail] = {}
        self.dir_mtime = -1
        self.pending: set[int] = set()  # writer directories seen without an index.log yet
        self.ignored: set[str] = set()  # entries of writers/ that are not writer directories
        self.own: int | None = None
        # other writers' pages this process found unreadable: when it stores one of these
        # keys again it logs a DEL for the old page, so that no reader (whatever order it
        # reads the logs in) keeps preferring the unreadable copy
        self.dropped: dict[str, Entry] = {}
        self.on_free: Callable[[int, int], None] = lambda slab, slot: None

    # ---- following the logs -------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up records appended by every writer (new writers included). Caller holds
        ``lock``."""
        try:
            mtime = os.stat(self.writers_dir).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self.dir_mtime:
            self.dir_mtime = mtime
            self._scan_writers()
        elif self.pending:  # a log is created inside its directory: writers/ does not change
            for writer in list(self.pending):
                self._follow(writer, writer_name(writer))
        for writer, tail in self.tails.items():
            if writer == self.own:
                continue
            try:
                st = os.stat(tail.path)
            except FileNotFoundError:
                continue
            if st.st_ino != tail.ino:  # the writer compacted its log
                self.forget_writer(writer)
                tail.reopen()
                st = os.fstat(tail.fd)
            if st.st_size > tail.offset:
                self.read_tail(writer, tail, st.st_size)

    def _scan_writers(self) -> None:
        for name in os.listdir(self.writers_dir):
            writer = parse_writer_name(name)
            if writer is None or writer in self.tails:
                continue
            self._follow(writer, name)

    def _follow(self, writer: int, name: str) -> None:
        """Start tailing writer ``name``'s log; remember it as pending while it has none,
        and ignore (logged once) an entry that is not a writer directory."""
        try:
            if not is_real_dir(self.writers_dir / name):
                raise NotADirectoryError(20, "not a real directory")
            self.tails[writer] = LogTail(self.writers_dir / name / "index.log")
        except FileNotFoundError:
            self.pending.add(writer)
            return
        except OSError as exc:  # a file named like a writer directory, a planted link, junk
            self.pending.discard(writer)
            if name not in self.ignored:
                self.ignored.add(name)
                log.warning("%s: ignoring %s, not a writer directory (%s)", self.writers_dir,
                            name, exc.strerror)
            return
        self.pending.discard(writer)

    def tail_of(self, writer: int) -> LogTail:
        """The tail of ``writer``'s log, opened now if not followed yet."""
        tail = self.tails.get(writer)
        if tail is None:
            tail = self.tails[writer] = LogTail(self.writers_dir / writer_name(writer) / "index.log")
        return tail

    def forget_writer(self, writer: int) -> None:
        """Drop every entry of ``writer`` (its log is about to be read again)."""
        for key, entry in list(self.entries.items()):
            if entry.writer == writer:
                del self.entries[key]
                self.slot_key.pop((writer, entry.slab, entry.slot), None)

    def read_tail(self, writer: int, tail: LogTail, size: int,
                  foreign_dels: list[tuple[str, Entry]] | None = None) -> None:
        """Apply ``writer``'s records from ``tail.offset`` up to ``size``; DELs it issued
        for other writers' slots go to ``foreign_dels`` when given (adoption)."""
        data = os.pread(tail.fd, size - tail.offset, tail.offset)
        records, used, skipped = decode_records(data)
        if skipped:
            log.warning("%s: %d damaged bytes skipped (the records around them are kept)",
                        tail.path, skipped)
        for kind, key, entry in records:
            if kind == PUT:
                self.apply_put(key, entry)
                tail.max_gen = max(tail.max_gen, entry.gen)
            elif kind == DEL:
                self.apply_del(key, entry)
                if foreign_dels is not None and entry.writer != writer:
                    foreign_dels.append((key, entry))
            elif kind == GEN:
                tail.max_gen = max(tail.max_gen, entry.gen)
        tail.offset += used

    def apply_put(self, key: str, entry: Entry) -> None:
        """``key`` is now in ``entry``'s slot (superseding what that slot held)."""
        where = (entry.writer, entry.slab, entry.slot)
        if self.deleted.get(where, 0) >= entry.gen:
            return  # a DEL read earlier (from another writer's log) already removed it
        old_key = self.slot_key.get(where)
        if old_key is not None:
            old = self.entries.get(old_key)
            if old is not None and (old.writer, old.slab, old.slot) == where:
                del self.entries[old_key]
        previous = self.entries.get(key)
        if previous is not None:
            self.slot_key.pop((previous.writer, previous.slab, previous.slot), None)
        self.entries[key] = entry
        self.slot_key[where] = key

    def apply_own_puts(self, keys: Sequence[str], entries: Sequence[Entry]) -> None:
        """:meth:`apply_put` of each ``keys[j]``/``entries[j]``, entries this process just
        wrote into its own reserved slots: the common case (a new key in a slot no key
        holds) costs two dict stores, the others take :meth:`apply_put`."""
        index, slot_key, deleted, apply = self.entries, self.slot_key, self.deleted, self.apply_put
        for key, entry in zip(keys, entries):
            where = entry[:3]
            if key in index or where in slot_key or where in deleted:
                apply(key, entry)
            else:
                index[key] = entry
                slot_key[where] = key

    def apply_del(self, key: str, entry: Entry) -> None:
        """The exact page ``entry`` of ``key`` is gone (a newer page of the slot stays)."""
        where = (entry.writer, entry.slab, entry.slot)
        if self.deleted.get(where, 0) < entry.gen:
            self.deleted[where] = entry.gen
        current = self.entries.get(key)
        if current is None or current[:4] != entry[:4]:
            return
        del self.entries[key]
        self.slot_key.pop(where, None)
        if entry.writer == self.own:
            self.on_free(entry.slab, entry.slot)

    # ---- answering ----------------------------------------------------------------------
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: is it indexed now?"""
        entries = self.entries
        return [k in entries for k in keys]

    def lookup(self, keys: Sequence[str]) -> list[Located | None]:
        """Per key: a descriptor and entry to read it from, or None. A slab that cannot be
        opened (missing, unreadable) drops its keys from the index: they miss, ``exists``
        stops reporting them and a later set stores them again. Caller holds ``lock``."""
        get, fd = self.entries.get, self.files.get
        out: list[Located | None] = []
        for key in keys:
            entry = get(key)
            if entry is None:
                out.append(None)
                continue
            try:
                out.append(Located(fd(entry.writer, entry.slab), entry))
            except OSError as exc:
                self._drop_slab(entry.writer, entry.slab, exc)
                out.append(None)
        return out

    def _drop_slab(self, writer: int, slab: int, exc: OSError) -> None:
        lost = [(k, e) for k, e in self.entries.items() if e.writer == writer and e.slab == slab]
        for key, entry in lost:
            self.drop(key, entry)
        log.warning("%s: cannot open (%s): its %d pages dropped from the index",
                    self.files.path(writer, slab), exc.strerror, len(lost))

    def drop(self, key: str, entry: Entry) -> bool:
        """Forget ``key`` if it still maps to ``entry`` (found unreadable); True if it did."""
        if self.entries.get(key) != entry:
            return False
        del self.entries[key]
        self.slot_key.pop((entry.writer, entry.slab, entry.slot), None)
        if entry.writer != self.own:
            if len(self.dropped) >= MAX_DROPPED:
                self.dropped.clear()
            self.dropped[key] = entry
        return True
