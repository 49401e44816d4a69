"""Following every writer's ``index.log``: this process's position in each
(:class:`LogTail`) and the reading of what was appended since (:class:`LogFollower`), fed
to the index.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from hicache_l3.slab import checkpoint
from hicache_l3.slab.changes import ChangeFile
from hicache_l3.slab.files import is_real_dir, open_file, parse_writer_name, writer_name
from hicache_l3.slab.format import DEL, GEN, PUT, Entry, decode_records
from hicache_l3.slab.table import DIGEST_SEED, xxh3_128

log = logging.getLogger("hicache_l3.slab")
TAIL_CHUNK = 1 << 20  # bytes of a log decoded at a time


class LogTail:
    """A reader's position in one writer's index log (a new inode: read it again from the
    start), the highest generation the log used, and the DELs it holds for other writers'
    slots."""

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


class RecordSink(Protocol):
    """What the records read are applied to (:class:`~hicache_l3.slab.index.SlabIndex`)."""

    own: int | None  # the writer whose log this process appends (not tailed)
    applied: int  # records applied since the last checkpoint
    replayed: int  # records read from logs

    def apply_puts(self, ds: Sequence[bytes], entries: Sequence[Entry]) -> None: ...
    def apply_del(self, d: bytes, entry: Entry) -> None: ...
    def forget_writer(self, *writers: int) -> None: ...


class LogFollower:
    """Every writer's log under ``writers_dir`` followed: ``tails`` by writer, writer
    directories seen without a log yet (``pending``), entries of ``writers/`` that are not
    writer directories (``ignored``, logged once), and the change file (``changes``) when
    used. Caller holds the index's lock."""

    def __init__(self, writers_dir: Path, sink: RecordSink) -> None:
        self.writers_dir = writers_dir
        self.sink = sink
        self.tails: dict[int, LogTail] = {}
        self.dir_mtime = -1
        self.changes: ChangeFile | None = None
        self.pending: set[int] = set()
        self.ignored: set[str] = set()

    def look(self) -> bool:
        """Read what every other writer appended (new writers included), unless the change
        file says nothing was published; False when ``writers/`` is gone."""
        changes = self.changes
        if changes is not None and changes.unchanged() and not self.pending:
            return True
        return self._look_at_logs()

    def _look_at_logs(self) -> bool:
        """The look :meth:`look` takes at ``writers/`` and every other writer's log."""
        try:
            mtime = os.stat(self.writers_dir).st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime != self.dir_mtime:
            self.dir_mtime = mtime
            for name in os.listdir(self.writers_dir):
                writer = parse_writer_name(name)
                if writer is not None and writer not in self.tails:
                    self._follow(writer, name)
        elif self.pending:  # a log is created inside its directory: writers/ does not change
            for writer in list(self.pending):
                self._follow(writer, writer_name(writer))
        for writer, tail in self.tails.items():
            if writer == self.sink.own:
                continue
            try:
                st = os.stat(tail.path)
            except FileNotFoundError:
                continue
            if st.st_ino != tail.ino:  # the writer compacted its log
                self.sink.forget_writer(writer)
                tail.reopen()
                st = os.fstat(tail.fd)
            if st.st_size > tail.offset:
                self.read_tail(writer, tail, st.st_size)
        return True

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

    def read_tail(self, writer: int, tail: LogTail, size: int) -> None:
        """Apply ``writer``'s records from ``tail.offset`` up to ``size`` (:data:`TAIL_CHUNK`
        bytes at a time); DELs it issued for other writers' slots are kept in
        ``tail.foreign_dels``."""
        while tail.offset < size:
            want = size - tail.offset
            if not self._read_chunk(writer, tail, min(want, TAIL_CHUNK)):
                if want > TAIL_CHUNK:  # no whole record in a chunk: damage longer than it
                    self._read_chunk(writer, tail, want)
                return

    def _read_chunk(self, writer: int, tail: LogTail, length: int) -> int:
        """Apply the whole records of ``length`` bytes of ``writer``'s log at
        ``tail.offset`` (see :meth:`read_tail`); the bytes they took."""
        data = os.pread(tail.fd, length, tail.offset)
        with checkpoint.no_gc():
            records, used, skipped = decode_records(data)
        if skipped:
            log.warning("%s: %d damaged bytes skipped (the records around them are kept)",
                        tail.path, skipped)
        h, seed, sink = xxh3_128, DIGEST_SEED, self.sink
        run_d: list[bytes] = []  # the PUTs since the last DEL, applied together
        run_e: list[Entry] = []
        max_gen = tail.max_gen
        for kind, key, entry in records:
            if kind == PUT:
                run_d.append(h(key.encode(), seed))
                run_e.append(entry)
                if entry.gen > max_gen:
                    max_gen = entry.gen
            elif kind == DEL:
                if run_d:
                    sink.apply_puts(run_d, run_e)
                    run_d, run_e = [], []
                sink.apply_del(h(key.encode(), seed), entry)
                if entry.writer != writer:
                    tail.foreign_dels.append((key, entry))
            elif kind == GEN:
                max_gen = max(max_gen, entry.gen)
        if run_d:
            sink.apply_puts(run_d, run_e)
        tail.max_gen = max_gen
        tail.offset += used
        sink.applied += len(records)
        sink.replayed += len(records)
        return used
