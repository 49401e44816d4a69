"""The index's checkpoints: loading the namespace's checkpoint at open, writing new ones
(now, or snapshotted under the lock and written on a thread), and rebasing the C table
onto the newest one so that its private delta stays small.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal, Protocol

from hicache_l3.slab import checkpoint
from hicache_l3.slab.files import is_real_dir, writer_name
from hicache_l3.slab.format import Entry
from hicache_l3.slab.log_follow import LogFollower, LogTail
from hicache_l3.slab.table import (
    DIGEST_BYTES,
    JournalPart,
    NativePageTable,
    PageTable,
    TableImage,
    native_library,
    new_table,
    split_snapshot,
)

log = logging.getLogger("hicache_l3.slab")
CHECKPOINT_MIN_RECORDS = 1 << 13  # records applied since the last checkpoint before a new one
CHECKPOINT_FRACTION = 32  # ... and at least 1/this of the indexed pages (the delta's bound)
CHECKPOINT_DUTY = 9.0  # the next checkpoint waits this many times the last one's duration
REBASE_CHECK_S = 1.0  # a big delta looks for a newer checkpoint at most this often
JOURNAL_ON_LOCK = 4096  # a longer journal catch-up is applied off the lock first


class CheckpointedIndex(Protocol):
    """What the checkpoints read and replace of the index (:class:`~hicache_l3.slab.index.SlabIndex`)."""

    table: PageTable
    deleted: dict[tuple[int, int, int], int]
    logs: LogFollower
    own: int | None
    applied: int
    directory: Path
    capacity: int | None

    @property
    def unlogged(self) -> dict[bytes, Entry]: ...
    def forget_writer(self, *writers: int) -> None: ...


class IndexCheckpoints:
    """The checkpoints of one index. Caller holds the index's lock unless a method says
    otherwise; at most one background job (write, rebase, journal catch-up) runs at a time,
    and the next :meth:`maintain` adopts what it made."""

    def __init__(self, index: CheckpointedIndex) -> None:
        self.index = index
        self.directory = index.directory
        self.capacity = index.capacity
        self.loaded = False  # the checkpoint was looked for
        self.pages = -1  # pages the loaded checkpoint held (-1: none loaded)
        self._saver: threading.Thread | None = None  # a background checkpoint write
        self.base_id: tuple[int, int] | None = None  # (inode, mtime) of the checkpoint mapped as base
        self.rebases = 0
        self._rebase_checked = 0.0
        self._rebase_due = False  # a checkpoint was written: rebase on it
        self._next_checkpoint = 0.0  # (monotonic) not due before: see due
        # left by a background job: the table replacing the live one (and its base's file
        # id), False (none: stop the journal), None (nothing)
        self._pending_base: tuple[NativePageTable, tuple[int, int]] | Literal[False] | None = None

    def maintain(self) -> None:
        """After the logs were read: adopt what a background job made, and keep the private
        delta small (a new checkpoint, or a rebase onto a newer one)."""
        if self._pending_base is not None:
            self._adopt_base(defer=True)
        if self._rebase_due:
            self.rebase_on_newer()
        elif self.delta_big():
            if self.index.own is not None and self.due():
                self.save_later()
            else:
                self.rebase_later()

    def load(self) -> None:
        """Start from the namespace's checkpoint if there is a usable one; a log that no
        longer matches its mark loses the checkpoint's entries and is read again from its start.
        Called once, before any log is read. Caller holds the lock."""
        state = checkpoint.read(self.directory)
        if state is None:
            return
        table = new_table(self.capacity)
        try:
            n = self._load_pages(table, state)
        except (ValueError, MemoryError) as exc:
            log.warning("%s: index checkpoint ignored, the logs are replayed (%s)", self.directory, exc)
            return
        if len(table) != n:  # two pages of one key or of one slot: not a replay's state
            log.warning("%s: index checkpoint ignored, the logs are replayed (%d of its %d pages "
                        "collide)", self.directory, n - len(table), n)
            self.base_id = None
            return
        self.index.table = table
        self.index.deleted = state.deleted
        stale, logs = [], self.index.logs
        for mark in state.marks:
            wdir = logs.writers_dir / writer_name(mark.writer)
            tail = None
            with contextlib.suppress(OSError):
                if is_real_dir(wdir):
                    tail = LogTail(wdir / "index.log")
            if tail is None:
                stale.append(mark.writer)  # gone, or not a writer directory: found by the scan
                continue
            logs.tails[mark.writer] = tail
            size = os.fstat(tail.fd).st_size
            if (tail.ino != mark.ino or size < mark.offset
                    or checkpoint.log_crcs(tail.fd, mark.offset) != (mark.head, mark.anchor)):
                stale.append(mark.writer)  # read from its start by the refresh
                continue
            tail.offset, tail.max_gen, tail.foreign_dels = mark.offset, mark.max_gen, mark.foreign_dels
        self.pages = len(self.index.table)
        if stale:
            self.index.forget_writer(*stale)
        self.index.applied = 0

    def _load_pages(self, table: PageTable, state: checkpoint.IndexState) -> int:
        """Put a checkpoint's pages in the empty ``table`` (image mapped as the base, or
        pages loaded); how many pages. ValueError / MemoryError when they do not load."""
        image = state.image
        if image is None:
            n = len(state.digests) // DIGEST_BYTES
            table.reserve(n)  # sized for its pages at once (load 0.8), not by 1.5x steps
            table.load(state.digests, state.values)
            return n
        try:
            if isinstance(table, NativePageTable):
                table.attach(image.fd, image.offset, image.length)
                self.base_id = _file_id(image.fd)
                return image.pages
            mapped = NativePageTable(native_library())  # a reference table: the image's pages loaded
            mapped.attach(image.fd, image.offset, image.length)
            table.reserve(image.pages)
            table.load(*mapped.export())
            return image.pages
        finally:
            image.close()

    def memory(self) -> dict[str, int]:
        """The table's memory: ``index_private_bytes``, ``index_shared_bytes``,
        ``index_delta_pages`` and ``index_rebases``."""
        table = self.index.table
        shared = table.shared_nbytes if isinstance(table, NativePageTable) else 0
        delta = table.delta_len if isinstance(table, NativePageTable) else len(table)
        return {"index_private_bytes": table.nbytes, "index_shared_bytes": shared,
                "index_delta_pages": delta, "index_rebases": self.rebases}

    def delta_big(self) -> bool:
        """The table's private delta holds more than a :data:`CHECKPOINT_FRACTION` of the
        pages (and at least :data:`CHECKPOINT_MIN_RECORDS`): worth a rebase."""
        table = self.index.table
        return (isinstance(table, NativePageTable)
                and table.delta_len >= max(CHECKPOINT_MIN_RECORDS, len(table) // CHECKPOINT_FRACTION))

    def rebase_later(self) -> None:
        """Rebase the table onto the namespace's checkpoint when it is another than the
        mapped base (looked for at most every :data:`REBASE_CHECK_S`), on a forked copy off the
        lock, adopted by a later refresh. Caller holds ``lock``; nothing while a job runs."""
        now = time.monotonic()
        table = self.index.table
        if (now - self._rebase_checked < REBASE_CHECK_S or not isinstance(table, NativePageTable)
                or self.busy()):
            return
        self._rebase_checked = now
        if not self._newer_checkpoint():
            return
        try:
            copy = table.snapshot()
            table.journal_start()
        except MemoryError:
            return
        self._saver = threading.Thread(target=self._rebase_off_lock, args=(copy,),
                                       name="hicache-index-rebase", daemon=True)
        self._saver.start()

    def _newer_checkpoint(self) -> bool:
        """The namespace's checkpoint is another file than the mapped base."""
        try:
            st = os.stat(self.directory / checkpoint.CHECKPOINT_FILE, follow_symlinks=False)
        except OSError:
            return False
        return (st.st_ino, st.st_mtime_ns) != self.base_id

    def _rebase_off_lock(self, copy: TableImage) -> None:
        """The rebase thread of :meth:`rebase_later`: ``copy`` (the table's snapshot) is
        rebased on the checkpoint without the GIL."""
        new: tuple[NativePageTable, tuple[int, int]] | None = None
        try:
            base_id = self._rebase_on_checkpoint(copy.rebase)
            if base_id is not None:
                new = copy.table, base_id
        finally:
            self._pending_base = new if new is not None else False

    def _rebase_on_checkpoint(self, rebase: Callable[[int, int, int], None]) -> tuple[int, int] | None:
        """``rebase(fd, offset, length)`` onto the image of the namespace's checkpoint: the
        image file's id, or None (no image; refused, logged)."""
        state = checkpoint.read(self.directory)
        if state is None or state.image is None:
            return None
        image = state.image
        try:
            rebase(image.fd, image.offset, image.length)
            return _file_id(image.fd)
        except (ValueError, MemoryError) as exc:
            log.warning("%s: index not rebased on its checkpoint (%s)", self.directory, exc)
            return None
        finally:
            image.close()

    def rebase_on_newer(self) -> bool:
        """Rebase the table onto the namespace's checkpoint now when it is another than the
        mapped base; counts as a checkpoint written. Caller holds the lock. Whether it rebased."""
        self._rebase_checked, self._rebase_due = time.monotonic(), False
        table = self.index.table
        if not isinstance(table, NativePageTable) or not self._newer_checkpoint():
            return False
        base_id = self._rebase_on_checkpoint(table.rebase)
        if base_id is None:
            return False
        self.base_id = base_id
        self.rebases += 1
        self.index.applied = 0
        return True

    def state(self, copy: bool = False) -> checkpoint.IndexState:
        """The log-derived state of the index now, what a checkpoint holds. Without ``copy``
        it shares the live dicts (encode it before releasing the lock); with ``copy`` it is a
        snapshot that may be encoded on another thread."""
        index = self.index
        table, unlogged, flat = index.table, index.unlogged, None
        if isinstance(table, NativePageTable):
            ds, values = b"".join(unlogged), array.array("Q")
            for entry in unlogged.values():
                values.extend(entry)
            with contextlib.suppress(MemoryError):
                flat = table.snapshot(ds, values)
        if flat is not None:
            ds, values = b"", array.array("Q")
        else:
            ds, values = table.export()
            if unlogged:  # pages the logs still hold (see SlabIndex)
                ds, values = _with_unlogged(table, ds, values, unlogged)
        marks = []
        for writer, tail in sorted(index.logs.tails.items()):
            head, anchor = checkpoint.log_crcs(tail.fd, tail.offset)
            dels = list(tail.foreign_dels) if copy else tail.foreign_dels
            marks.append(checkpoint.LogMark(writer, tail.ino, tail.offset, tail.max_gen, head,
                                            anchor, dels))
        return checkpoint.IndexState(ds, values, dict(index.deleted) if copy else index.deleted, marks,
                                     table=flat)

    def due(self) -> bool:
        """Enough records were applied since the last checkpoint to write a new one
        (:data:`CHECKPOINT_MIN_RECORDS`, :data:`CHECKPOINT_FRACTION` of the pages, and
        :data:`CHECKPOINT_DUTY` times the last write's duration since it ended)."""
        index = self.index
        return (index.applied >= max(CHECKPOINT_MIN_RECORDS, len(index.table) // CHECKPOINT_FRACTION)
                and time.monotonic() >= self._next_checkpoint)

    def save(self) -> bool:
        """Write the namespace's checkpoint now (after a background save still running);
        False (logged) when it could not be written. Caller holds ``lock``."""
        self.wait()
        self._adopt_base()
        started = time.monotonic()
        try:
            written = checkpoint.write(self.directory, self.state(), self.capacity)
        except OSError as exc:
            log.warning("%s: index checkpoint not written (%s)", self.directory, exc)
            return False
        ended = time.monotonic()
        self._next_checkpoint = ended + CHECKPOINT_DUTY * (ended - started)
        self.index.applied = 0
        self._rebase_due = written  # (by the next refresh, if this process goes on)
        return written

    def save_later(self) -> None:
        """Snapshot the state now (caller holds ``lock``) and write it on a background
        thread; nothing while one is running."""
        if self._saver is not None and self._saver.is_alive():
            return
        self._adopt_base(defer=True)  # (what a previous one left, before the journal starts again)
        if self.busy():
            return  # (a long catch-up goes on off the lock first; the checkpoint stays due)
        state = self.state(copy=True)
        self.index.applied = 0
        fixups = None
        table = self.index.table
        if isinstance(table, NativePageTable):
            # the table moves onto this checkpoint once written: its changes since this
            # snapshot are journaled, and the image differs from the table by the unlogged pages
            with contextlib.suppress(MemoryError):
                table.journal_start()
                fixups = list(zip(self.index.unlogged, table.get_many(list(self.index.unlogged))))
        self._saver = threading.Thread(target=self._write_state, args=(state, fixups),
                                       name="hicache-index-checkpoint", daemon=True)
        self._saver.start()

    def _write_state(self, state: checkpoint.IndexState,
                     fixups: list[tuple[bytes, Entry | None]] | None) -> None:
        """The saver thread: write ``state``, then build (off the lock) the table the live
        one becomes, for the next :meth:`maintain` to adopt."""
        written: list[checkpoint.ImageRef] = []
        new: tuple[NativePageTable, tuple[int, int]] | None = None
        started = time.monotonic()
        try:
            checkpoint.write(self.directory, state, self.capacity, written)
            if written and fixups is not None:
                new = self._table_on(written[0], fixups)
        except OSError as exc:
            log.warning("%s: index checkpoint not written (%s)", self.directory, exc)
        finally:
            for image in written:
                image.close()
            self._pending_base = new if new is not None else (None if fixups is None else False)
            ended = time.monotonic()
            self._next_checkpoint = ended + CHECKPOINT_DUTY * (ended - started)

    def _table_on(self, image: checkpoint.ImageRef, fixups: list[tuple[bytes, Entry | None]]
                  ) -> tuple[NativePageTable, tuple[int, int]] | None:
        """A table over ``image`` as base holding what the live table held at the snapshot
        (``fixups``: the table's page of each unlogged digest, or None), and the image's file id;
        None when it cannot be made."""
        table = NativePageTable(native_library())
        if self.capacity:
            with contextlib.suppress(ValueError):
                table.expect(self.capacity)
        try:
            table.attach_unshared(image.fd, image.offset, image.length)
            for d, entry in fixups:
                if entry is None:
                    table.pop(d)
                else:
                    table.put(d, entry)
        except (ValueError, MemoryError) as exc:
            log.warning("%s: index not moved onto its checkpoint (%s)", self.directory, exc)
            return None
        return table, _file_id(image.fd)

    def _adopt_base(self, defer: bool = False) -> None:
        """Adopt the table a finished background job made, caught up with the live table's
        journal (caller holds ``lock``). With ``defer``, a journal longer than
        :data:`JOURNAL_ON_LOCK` records is applied on a thread first and a later call adopts.
        Without a table the journal stops."""
        pending, self._pending_base = self._pending_base, None
        if pending is None:
            return
        table = self.index.table
        if not isinstance(table, NativePageTable):
            return
        if pending is False:
            table.journal_stop()
            return
        new, base_id = pending
        if defer and table.journal_len > JOURNAL_ON_LOCK:
            try:
                part = table.journal_take()
            except ValueError:  # (a lost record: no catch-up is possible, the journal stopped)
                log.warning("%s: index not moved onto its checkpoint (its journal lost a record)",
                            self.directory)
                return
            except MemoryError:
                pass  # (caught up under the lock below)
            else:
                self._saver = threading.Thread(target=self._catch_up_off_lock, args=(new, base_id, part),
                                               name="hicache-index-catch-up", daemon=True)
                self._saver.start()
                return
        try:
            new.catch_up(table)
        except (ValueError, MemoryError) as exc:
            log.warning("%s: index not moved onto its checkpoint (%s)", self.directory, exc)
            table.journal_stop()
            return
        self.index.table, self.base_id = new, base_id
        self.rebases += 1
        # the old table is freed on a thread of its own, not under the lock
        reaper = threading.Thread(target=_drop, args=(table,), name="hicache-index-free", daemon=True)
        del table  # (the thread's arguments hold the last reference)
        reaper.start()

    def _catch_up_off_lock(self, new: NativePageTable, base_id: tuple[int, int], part: JournalPart) -> None:
        """The thread of a deferred :meth:`_adopt_base`: ``part`` applied to ``new`` off
        the lock and the GIL."""
        done = False
        try:
            part.apply(new)
            done = True
        except MemoryError as exc:
            log.warning("%s: index not moved onto its checkpoint (%s)", self.directory, exc)
        finally:
            self._pending_base = (new, base_id) if done else False

    def busy(self) -> bool:
        """A checkpoint write, rebase or journal catch-up runs off the lock, or has ended and
        waits for the next :meth:`maintain` to adopt it (a hint: read without the lock)."""
        return self._pending_base is not None or (self._saver is not None and self._saver.is_alive())

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background checkpoint write to finish (at most ``timeout`` s)."""
        saver = self._saver
        if saver is not None:
            saver.join(timeout)



def _drop(table: object) -> None:
    """Nothing: the thread that runs it releases ``table`` (its arguments) when it ends."""


def _file_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_ino, st.st_mtime_ns


def _with_unlogged(table: PageTable, ds: bytes, values: array.array[int],
                   unlogged: dict[bytes, Entry]) -> tuple[bytes, array.array[int]]:
    """An export of ``table`` (``ds``, ``values``) with the ``unlogged`` pages added, each
    replacing the table's page of its digest if it has one."""
    extra = list(unlogged.items())
    if any(table.contains_many([d for d, _ in extra])):
        merged = dict(zip(*split_snapshot(ds, values)))
        merged.update(extra)
        extra, ds, values = list(merged.items()), b"", array.array("Q")
    values = array.array("Q", values)
    for _, e in extra:
        values.extend(e)
    return ds + b"".join(d for d, _ in extra), values
