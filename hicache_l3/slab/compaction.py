"""A writer's log compaction: the live records written to a temporary file, renamed over
``index.log``. The live PUTs are judged either off the store's lock against a fork of the
C table (:meth:`LogCompaction.build`, in three steps: start, build, finish) or by the
caller under the lock (:meth:`LogCompaction.write`).
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


@dataclass
class LogCompaction:
    """One compaction of writer ``writer``'s log: what step 1 noted, then the temporary
    file holding the live PUTs of the log's first ``upto`` bytes."""

    writer: int
    path: Path  # the log
    ino: int  # the log's inode at step 1: another compaction since replaced it
    upto: int  # the log's bytes judged (the rest is copied as it is)
    dels: int  # how many of the tail's foreign DELs the first upto bytes hold
    own: int  # own pages in the table at step 1: the live PUTs a whole log holds
    fork: TableImage | None
    fd: int  # a descriptor of the log (a dup: closed by this object)
    forget: dict[bytes, Entry]  # own pages unlogged at step 1
    tmp: Path = field(init=False)
    tmp_fd: int = -1  # the temporary file, open once it holds the live PUTs
    size: int = 0  # the bytes written there
    copied: int = 0  # the log's bytes up to here are in it (judged, or copied as they are)

    def __post_init__(self) -> None:
        self.tmp = self.path.with_name(f"index.log.compact-{os.getpid()}")

    @classmethod
    def start(cls, table: object, writer: int, path: Path, ino: int, upto: int, dels: int,
              own: int, log_fd: int, forget: dict[bytes, Entry], fork: bool = True) -> LogCompaction | None:
        """Step 1 (caller holds the store's lock): a compaction of the first ``upto`` bytes
        of the log open on ``log_fd``, against a fork of ``table`` when ``fork``; None where
        the fork cannot be made (not a C table, or no memory)."""
        image = None
        if fork:
            if not isinstance(table, NativePageTable):
                return None
            try:
                image = table.snapshot()
            except MemoryError:
                return None
        return cls(writer, path, ino, upto, dels, own, image, os.dup(log_fd), forget)

    def write(self, records: bytes) -> None:
        """Instead of :meth:`build`: the live PUTs of the first ``upto`` bytes, judged by
        the caller, into the temporary file. :class:`OSError`."""
        fd = open_file(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            if os.write(fd, records) != len(records):
                raise OSError(f"{self.tmp}: short write")
        except BaseException:
            self._discard(fd)
            raise
        self.tmp_fd, self.size, self.copied = fd, len(records), self.upto

    def build(self) -> bool:
        """Step 2 (no lock; the C scan runs without the GIL): write the live PUTs of the
        log's first ``upto`` bytes to the temporary file. False where C could not judge
        them (damage) or not every own page was found: the caller compacts under the lock."""
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
        """Between steps 2 and 3 (no lock): copy the records logged up to ``offset`` (a size
        the log had), so that step 3 copies only what came after. :class:`OSError`."""
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
        file's copy (the log is ``now_offset`` bytes now), ``dels`` and ``gen``, sync when
        ``fsync``, rename over the log; returns the new log's size. A log replaced since
        step 1 raises :class:`FileExistsError`; any :class:`OSError` leaves the log as it
        was and removes the file."""
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
            self._close_log()
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
