"""A writer's log compaction off the store's lock and off the GIL.

A compaction rewrites the writer's ``index.log`` with only its live records (see
:meth:`~hicache_l3.slab.store.SlabStore.compact`, the reference, which does it all under
the lock). Done that way its cost grows with the log, and stalls the caller and every
thread that needs the lock or the GIL meanwhile.

Here, in three steps:

1. :meth:`LogCompaction.start`, under the lock (the caller's commit): note how far the
   log goes (``upto``), fork the page table (:meth:`NativePageTable.snapshot`: the
   private delta copied, the checkpoint's base shared), note the own pages taken out of
   the table without a record (:attr:`SlabIndex.unlogged`) and the DELs for other
   writers' slots the log holds so far.
2. :meth:`LogCompaction.build`, on a background thread, without the lock: read the log's
   first ``upto`` bytes (they never change: the writer only appends), find the PUTs the
   fork holds and write them to a temporary file in C without the GIL
   (:meth:`TableImage.write_live_puts`).
3. :meth:`LogCompaction.finish`, under the lock: append the records logged since ``upto``
   as they are (most of them copied before, off the lock: :meth:`LogCompaction.catch_up`),
   the DELs of the first ``upto`` bytes still needed and a GEN record, then rename the
   file over the log.

Why that is the same log a compaction under the lock would write, replayed: a PUT of the
first ``upto`` bytes is kept when the table held its page at step 1; every record
appended since is copied after them, so a later PUT of the same key or slot supersedes
it on replay as it did in the table. The older DELs coming after the newer records
changes nothing: a DEL removes one exact page of another writer's slot, whatever comes
before or after it in this log. The own pages taken out of the table without a
record before step 1 are in no kept PUT, so step 3 drops them from
:attr:`~hicache_l3.slab.index.SlabIndex.unlogged`; those taken out since keep their PUT
in the new log, and stay. A sync compaction, a close or another writer identity in
between makes step 3 give up (the temporary file removed); the next commit tries again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from hicache_l3.slab.files import open_file
from hicache_l3.slab.format import Entry
from hicache_l3.slab.table import NativePageTable, TableImage

log = logging.getLogger(__name__)


def temporary_log(path: Path) -> Path:
    """Where this process writes a compacted copy of the log at ``path`` before renaming
    it over the log (a compaction under the lock or off it: one at a time)."""
    return path.with_name(f"index.log.compact-{os.getpid()}")


@dataclass
class LogCompaction:
    """One compaction of writer ``writer``'s log (module docstring): what step 1 noted,
    then the temporary file step 2 wrote."""

    writer: int
    path: Path  # the log
    ino: int  # the log's inode at step 1: a sync compaction since replaced it
    upto: int  # the log's bytes judged against the fork (the rest is copied as it is)
    dels: int  # how many of the tail's foreign DELs the first upto bytes hold
    own: int  # own pages in the table at step 1: the live PUTs a whole log holds
    fork: TableImage | None
    fd: int  # a descriptor of the log, for step 2's read
    forget: dict[bytes, Entry]  # own pages unlogged at step 1
    tmp: Path = field(init=False)
    tmp_fd: int = -1  # the temporary file, open once step 2 wrote the live PUTs
    size: int = 0  # the bytes written there
    copied: int = 0  # the log's bytes up to here are in it (judged, or copied as they are)

    def __post_init__(self) -> None:
        self.tmp = temporary_log(self.path)

    @classmethod
    def start(cls, table: object, writer: int, path: Path, ino: int, upto: int, dels: int,
              own: int, log_fd: int, forget: dict[bytes, Entry]) -> LogCompaction | None:
        """Step 1 (caller holds the store's lock): a compaction of the first ``upto``
        bytes of the log open on ``log_fd`` against a fork of ``table``; None where that
        cannot be done (no C table, or no memory for the fork: compact under the lock)."""
        if not isinstance(table, NativePageTable):
            return None
        try:
            fork = table.snapshot()
        except MemoryError:
            return None
        fd = os.dup(log_fd)
        return cls(writer, path, ino, upto, dels, own, fork, fd, forget)

    def build(self) -> bool:
        """Step 2 (no lock; the C scan runs without the GIL): write the live PUTs of the
        log's first ``upto`` bytes to the temporary file, left open. False where C could
        not judge them (damage, a library without the calls) or not every own page was
        found: step 3 then compacts under the lock."""
        fork, self.fork = self.fork, None
        old = os.pread(self.fd, self.upto, 0)
        if fork is None or len(old) != self.upto:
            return False
        fd = open_file(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            found = fork.write_live_puts(old, self.own, fd)
        except BaseException:
            self._discard(fd)
            raise
        del fork  # freed here, off the lock
        if found is None or found[0] != self.own:
            self._discard(fd)
            self._close_log()
            return False
        self.tmp_fd, self.size, self.copied = fd, found[1], self.upto
        return True

    def catch_up(self, offset: int) -> None:
        """Between steps 2 and 3 (no lock): copy the records logged from where the file
        has them up to ``offset`` (a size the log had: its bytes there are whole and never
        change), so that step 3 copies only what came after. :class:`OSError`."""
        if self.tmp_fd < 0 or offset <= self.copied:
            return
        data = os.pread(self.fd, offset - self.copied, self.copied)
        if len(data) == offset - self.copied and os.write(self.tmp_fd, data) == len(data):
            self.size += len(data)
            self.copied = offset
        else:
            self.abandon()

    def finish(self, now_ino: int, now_offset: int, dels: bytes, gen: bytes, fsync: bool) -> int:
        """Step 3 (caller holds the store's lock): append the records logged since the
        file's copy (the log is ``now_offset`` bytes now), then ``dels`` (the DELs for
        other writers' slots the first ``upto`` bytes held that stay needed) and ``gen``
        (a GEN record), sync it when ``fsync``, and rename it over the log; the new log's
        size. A log replaced since step 1 (``now_ino``: another compaction) raises
        :class:`FileExistsError`, the file removed; any :class:`OSError` leaves the log
        unchanged."""
        fd = self.tmp_fd
        if fd < 0:
            raise FileNotFoundError(f"{self.tmp}: no live records written")
        if now_ino != self.ino or now_offset < self.copied:
            self.abandon()
            raise FileExistsError(f"{self.path}: replaced since the compaction began")
        self.tmp_fd = -1
        try:
            since = os.pread(self.fd, now_offset - self.copied, self.copied)
            if len(since) != now_offset - self.copied:
                raise OSError(f"{self.path}: short read of the records logged since")
            rest = b"".join([since, dels, gen])
            written = os.write(fd, rest)
            if written != len(rest):
                raise OSError(f"{self.tmp}: short write ({written} of {len(rest)} bytes)")
            if fsync:
                os.fdatasync(fd)
        except BaseException:
            self._discard(fd)
            raise
        os.close(fd)
        self._close_log()
        try:
            os.replace(self.tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            raise
        return self.size + len(rest)

    def abandon(self) -> None:
        """Give up: the temporary file closed and removed, the fork dropped."""
        self.fork = None
        self._close_log()
        fd, self.tmp_fd = self.tmp_fd, -1
        if fd >= 0:
            self._discard(fd)

    def _close_log(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def _discard(self, fd: int) -> None:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(self.tmp)
