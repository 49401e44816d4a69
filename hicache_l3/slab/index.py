"""The index reader every process of a namespace runs: it tails every writer's
``index.log`` and keeps ``key -> Entry``.

Readers tail every writer's log (one ``stat`` per writer per call, one ``stat`` of
``writers/`` to notice new writers), so ``exists`` sees other processes' pages on the next
call. A PUT record for a slot supersedes whatever that slot held; a DEL record names the
exact (writer, slab, slot, generation) it removes, so a stale DEL can never remove a newer
page. Logs are read in any order: a DEL read before the PUT it removes still wins.

Opening. The first refresh loads the namespace's checkpoint (:mod:`hicache_l3.slab.checkpoint`)
when there is a usable one and then reads each log only from the offset the checkpoint
recorded for it, so opening costs the checkpoint's load plus the records written since.

What the index relies on from the filesystem: ``stat``/``fstat`` sizes and directory
mtime that reflect other local processes' writes (multi-node use rescans instead: see
:mod:`hicache_l3.slab.shared`).
"""

from __future__ import annotations

import logging
import operator
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from hicache_l3.slab import checkpoint
from hicache_l3.slab.files import SlabFiles, is_real_dir, open_file, parse_writer_name, writer_name
from hicache_l3.slab.format import DEL, GEN, PUT, Entry, Located, decode_records

log = logging.getLogger("hicache_l3.slab")
MAX_DROPPED = 1 << 16
CHECKPOINT_MIN_RECORDS = 1 << 16  # records applied since the last checkpoint before a new one
CHECKPOINT_FRACTION = 4  # ... and at least 1/this of the indexed pages
_where = operator.itemgetter(0, 1, 2)  # (writer, slab, slot) of an Entry


class LogTail:
    """A reader's position in one writer's index log (the file may be replaced by the
    writer's compaction: a new inode means "read it again from the start"), the highest
    generation the log used, and the DELs it holds for other writers' slots (a writer
    that adopts this log needs them: its compaction keeps them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = open_file(path, os.O_RDONLY)
        self.ino = os.fstat(self.fd).st_ino
        self.offset = 0
        self.max_gen = 0
        self.foreign_dels: list[tuple[str, Entry]] = []

    def reopen(self) -> None:
        """Follow the path to its current file, from offset 0."""
        fd = open_file(self.path, os.O_RDONLY)
        os.close(self.fd)
        self.fd, self.ino, self.offset = fd, os.fstat(fd).st_ino, 0
        self.foreign_dels = []


class SlabIndex:
    """``key -> Entry`` for one namespace, built from every writer's log.

    ``lock`` guards the index and is shared with the writer that composes it. ``own`` is
    the writer this process owns (its log is appended by this process, not tailed);
    ``on_free(slab, slot)`` is called when a DEL read from a log frees one of its slots.

    Log-derived state. ``entries`` is what the logs say, less the pages this process
    removed on its own judgement without a log record (found unreadable, or evicted by
    this writer for a slot not rewritten yet): those are kept in ``unlogged`` until a log
    record supersedes them, so that :meth:`state` -- what a checkpoint stores -- is
    exactly what a replay of the logs gives, whatever this process found unreadable.
    ``slot_key`` is the inverse of ``entries``.
    """

    def __init__(self, writers_dir: Path, files: SlabFiles) -> None:
        self.writers_dir = writers_dir
        self.directory = writers_dir.parent
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
        self.unlogged: dict[str, Entry] = {}
        self.unlogged_at: dict[tuple[int, int, int], str] = {}
        self.loaded = False  # the checkpoint was looked for
        self.applied = 0  # log records applied since the last checkpoint written or loaded
        self.replayed = 0  # log records this process read from logs (not its own appends)
        self.checkpoint_pages = -1  # pages the loaded checkpoint held (-1: none loaded)
        self._saver: threading.Thread | None = None  # a background checkpoint write

    # ---- following the logs -------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up records appended by every writer (new writers included). Caller holds
        ``lock``."""
        if not self.loaded:
            self.loaded = True
            self.load_checkpoint()
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

    def forget_writer(self, *writers: int) -> None:
        """Drop every entry of ``writers`` (their logs are about to be read again)."""
        gone = set(writers)
        for key, entry in list(self.entries.items()):
            if entry.writer in gone:
                del self.entries[key]
                self.slot_key.pop((entry.writer, entry.slab, entry.slot), None)
        self.forget_unlogged(*writers)

    def forget_unlogged(self, *writers: int) -> None:
        """Drop the :attr:`unlogged` pages of ``writers`` (their logs no longer hold them,
        or are about to be read again)."""
        for key, entry in list(self.unlogged.items()):
            if entry.writer in writers:
                del self.unlogged[key]
                self.unlogged_at.pop((entry.writer, entry.slab, entry.slot), None)

    def read_tail(self, writer: int, tail: LogTail, size: int) -> None:
        """Apply ``writer``'s records from ``tail.offset`` up to ``size``; DELs it issued
        for other writers' slots are also kept in ``tail.foreign_dels``."""
        data = os.pread(tail.fd, size - tail.offset, tail.offset)
        with checkpoint.no_gc():
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
                if entry.writer != writer:
                    tail.foreign_dels.append((key, entry))
            elif kind == GEN:
                tail.max_gen = max(tail.max_gen, entry.gen)
        tail.offset += used
        self.applied += len(records)
        self.replayed += len(records)

    def apply_put(self, key: str, entry: Entry) -> None:
        """``key`` is now in ``entry``'s slot (superseding what that slot held, and the
        key's page elsewhere).

        A PUT whose exact page a DEL read earlier removed (the DEL came from another
        writer's log, read first) is not indexed, but still supersedes what it superseded
        when written: the slot's older page, and an older page of the key by the same
        writer. So the index does not depend on the order the logs are read in (for keys
        stored by one writer; two writers storing one key at once leave either copy, with
        the same bytes)."""
        where = (entry.writer, entry.slab, entry.slot)
        entries, slot_key = self.entries, self.slot_key
        blocked = self.deleted.get(where, 0) >= entry.gen
        if self.unlogged:  # the logs' view: this PUT supersedes the key's and the slot's page
            old = self.unlogged.get(key)
            if old is not None and (not blocked or (old.writer == entry.writer and old.gen < entry.gen)):
                self._unlog(key)
            self._unlog(self.unlogged_at.get(where), where)
        old_key = slot_key.get(where)
        if old_key is not None:
            old = entries.get(old_key)
            if old is not None and (old.writer, old.slab, old.slot) == where:
                del entries[old_key]
            if blocked:
                del slot_key[where]
        previous = entries.get(key)
        if blocked:
            if previous is not None and previous.writer == entry.writer and previous.gen < entry.gen:
                del entries[key]
                slot_key.pop((previous.writer, previous.slab, previous.slot), None)
            return
        if previous is not None:
            slot_key.pop((previous.writer, previous.slab, previous.slot), None)
        entries[key] = entry
        slot_key[where] = key

    def apply_own_puts(self, keys: Sequence[str], entries: Sequence[Entry]) -> None:
        """:meth:`apply_put` of each ``keys[j]``/``entries[j]``, entries this process just
        wrote into its own reserved slots: the common case (a new key in a slot no key
        holds) costs two dict stores, the others take :meth:`apply_put`."""
        index, slot_key, deleted, apply = self.entries, self.slot_key, self.deleted, self.apply_put
        unlogged, unlogged_at = self.unlogged, self.unlogged_at
        for key, entry in zip(keys, entries):
            where = entry[:3]
            if (key in index or where in slot_key or where in deleted or key in unlogged
                    or where in unlogged_at):
                apply(key, entry)
            else:
                index[key] = entry
                slot_key[where] = key

    def apply_del(self, key: str, entry: Entry) -> None:
        """The exact page ``entry`` of ``key`` is gone (a newer page of the slot stays)."""
        where = (entry.writer, entry.slab, entry.slot)
        if self.deleted.get(where, 0) < entry.gen:
            self.deleted[where] = entry.gen
        if self.unlogged:
            old = self.unlogged.get(key)
            if old is not None and old[:4] == entry[:4]:
                self._unlog(key)
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

    def _unlog(self, key: str | None, where: tuple[int, int, int] | None = None) -> None:
        """Remove ``key`` from :attr:`unlogged` (a log record superseded it); only if its
        page is in slot ``where`` when given."""
        if key is None:
            return
        entry = self.unlogged.get(key)
        if entry is None:
            return
        if where is not None and (entry.writer, entry.slab, entry.slot) != where:
            return
        del self.unlogged[key]
        self.unlogged_at.pop((entry.writer, entry.slab, entry.slot), None)

    def remove_unlogged(self, key: str, entry: Entry) -> None:
        """Take ``key`` (mapped to ``entry`` now) out of this process's view without a log
        record: the logs still hold it (see :attr:`unlogged`)."""
        where = (entry.writer, entry.slab, entry.slot)
        del self.entries[key]
        self.slot_key.pop(where, None)
        self.unlogged[key] = entry
        self.unlogged_at[where] = key

    def drop(self, key: str, entry: Entry) -> bool:
        """Forget ``key`` if it still maps to ``entry`` (found unreadable); True if it did."""
        if self.entries.get(key) != entry:
            return False
        self.remove_unlogged(key, entry)
        if entry.writer != self.own:
            if len(self.dropped) >= MAX_DROPPED:
                self.dropped.clear()
            self.dropped[key] = entry
        return True

    # ---- checkpoint ---------------------------------------------------------------------
    def load_checkpoint(self) -> None:
        """Start from the namespace's checkpoint if there is a usable one: its entries,
        and each log's position; a log that no longer matches its mark (compacted, set
        aside, gone) loses the checkpoint's entries and is read again from its start.
        Called once, before any log is read. Caller holds ``lock``."""
        state = checkpoint.read(self.directory)
        if state is None:
            return
        with checkpoint.no_gc():
            self.entries = state.entries
            self.slot_key = dict(zip(map(_where, state.entries.values()), state.entries))
        self.deleted = state.deleted
        stale = []
        for mark in state.marks:
            name = writer_name(mark.writer)
            tail = None
            try:
                if is_real_dir(self.writers_dir / name):
                    tail = LogTail(self.writers_dir / name / "index.log")
            except OSError:
                pass
            if tail is None:
                stale.append(mark.writer)  # gone, or not a writer directory: found by the scan
                continue
            self.tails[mark.writer] = tail
            size = os.fstat(tail.fd).st_size
            if (tail.ino != mark.ino or size < mark.offset
                    or checkpoint.log_crcs(tail.fd, mark.offset) != (mark.head, mark.anchor)):
                stale.append(mark.writer)  # read from its start by the refresh
                continue
            tail.offset, tail.max_gen, tail.foreign_dels = mark.offset, mark.max_gen, mark.foreign_dels
        self.checkpoint_pages = len(self.entries)
        if stale:
            self.forget_writer(*stale)
        self.applied = 0

    def state(self, copy: bool = False) -> checkpoint.IndexState:
        """The log-derived state of this index now (see the class docstring), what a
        checkpoint holds. Caller holds ``lock``. Without ``copy`` it shares the live
        dicts (encode it before releasing ``lock``); with ``copy`` it is a snapshot that
        may be encoded on another thread (dicts copied: ~50 ns a page, the entries and
        keys themselves are immutable and shared)."""
        if self.unlogged:
            entries = {**self.entries, **self.unlogged}
        else:
            entries = dict(self.entries) if copy else self.entries
        marks = []
        for writer, tail in sorted(self.tails.items()):
            head, anchor = checkpoint.log_crcs(tail.fd, tail.offset)
            dels = list(tail.foreign_dels) if copy else tail.foreign_dels
            marks.append(checkpoint.LogMark(writer, tail.ino, tail.offset, tail.max_gen, head,
                                            anchor, dels))
        return checkpoint.IndexState(entries, dict(self.deleted) if copy else self.deleted, marks)

    def checkpoint_due(self) -> bool:
        """Enough records were applied since the last checkpoint to write a new one:
        :data:`CHECKPOINT_MIN_RECORDS` and a :data:`CHECKPOINT_FRACTION` of the pages."""
        return self.applied >= max(CHECKPOINT_MIN_RECORDS, len(self.entries) // CHECKPOINT_FRACTION)

    def save_checkpoint(self) -> bool:
        """Write the namespace's checkpoint from :meth:`state` now (after a background
        save still running, so that the newest state lands last); False (logged) when it
        could not be written -- the logs stay the source, nothing is lost. Caller holds
        ``lock``."""
        self.wait_checkpoint()
        try:
            written = checkpoint.write(self.directory, self.state())
        except OSError as exc:
            log.warning("%s: index checkpoint not written (%s)", self.directory, exc)
            return False
        self.applied = 0
        return written

    def save_checkpoint_later(self) -> None:
        """Snapshot the state now (caller holds ``lock``; the copy is the only cost under
        it) and encode and write it on a background thread, so that serving threads are
        not held for the seconds a big index takes to write. One at a time: while one is
        running this does nothing (the checkpoint stays due)."""
        if self._saver is not None and self._saver.is_alive():
            return
        state = self.state(copy=True)
        self.applied = 0
        self._saver = threading.Thread(target=self._write_state, args=(state,),
                                       name="hicache-index-checkpoint", daemon=True)
        self._saver.start()

    def _write_state(self, state: checkpoint.IndexState) -> None:
        try:
            checkpoint.write(self.directory, state)
        except OSError as exc:
            log.warning("%s: index checkpoint not written (%s)", self.directory, exc)

    def wait_checkpoint(self, timeout: float | None = None) -> None:
        """Wait for a background checkpoint write to finish (at most ``timeout`` s)."""
        saver = self._saver
        if saver is not None:
            saver.join(timeout)
