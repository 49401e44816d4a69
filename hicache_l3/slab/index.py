"""The index reader every process of a namespace runs: it tails every writer's
``index.log`` and keeps ``digest(key) -> Entry`` in a :mod:`~hicache_l3.slab.table` page
table (C open addressing when built: no Python object per page).

Readers tail every writer's log (one ``stat`` per writer per call, one ``stat`` of
``writers/`` to notice new writers), so ``exists`` sees other processes' pages on the next
call. A PUT record for a slot supersedes whatever that slot held; a DEL record names the
exact (writer, slab, slot, generation) it removes, so a stale DEL can never remove a newer
page. Logs are read in any order: a DEL read before the PUT it removes still wins.

Opening. The first refresh loads the namespace's checkpoint (:mod:`hicache_l3.slab.checkpoint`)
when there is a usable one and then reads each log only from the offset the checkpoint
recorded for it, so opening costs the checkpoint's load plus the records written since.
With the C table the checkpoint's pages are a table image that the table maps read-only
and shared as its base (one copy per node in the page cache, whatever the number of
processes): this process's own arrays (the delta) then hold only what changed since.
When the delta grows past a :data:`CHECKPOINT_FRACTION` of the pages and a newer
checkpoint exists (this process's or another's), the table is rebased onto it
(:meth:`~hicache_l3.slab.table.NativePageTable.rebase`: the pages do not change, only
where they are held), so that the private part stays small.

What the index relies on from the filesystem: ``stat``/``fstat`` sizes and directory
mtime that reflect other local processes' writes (multi-node use rescans instead: see
:mod:`hicache_l3.slab.shared`).
"""

from __future__ import annotations

import array
import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path
from typing import Literal, NamedTuple

from hicache_l3.slab import checkpoint
from hicache_l3.slab.changes import ChangeFile
from hicache_l3.slab.evict import take_run
from hicache_l3.slab.files import SlabFiles, is_real_dir, open_file, parse_writer_name, writer_name
from hicache_l3.slab.format import DEL, GEN, PUT, RECORD, Entry, Geometry, Located, decode_records
from hicache_l3.slab.plan import GetPlan, plan_get
from hicache_l3.slab.table import (
    DIGEST_BYTES,
    DIGEST_SEED,
    JournalPart,
    NativePageTable,
    PageTable,
    TableImage,
    digest,
    digests,
    joined,
    live_put_spans,
    native_library,
    new_table,
    split_snapshot,
    xxh3_128,
)

log = logging.getLogger("hicache_l3.slab")
_new_located = functools.partial(tuple.__new__, Located)  # no Python-level __new__ per page
_WHERE = itemgetter(0, 1, 2)  # an entry's slot: (writer, slab, slot)
MAX_DROPPED = 1 << 16
CHECKPOINT_MIN_RECORDS = 1 << 13  # records applied since the last checkpoint before a new one
CHECKPOINT_FRACTION = 32  # ... and at least 1/this of the indexed pages (the delta's bound)
TAIL_CHUNK = 1 << 20  # bytes of a log decoded at a time
CHECKPOINT_DUTY = 9.0  # the next checkpoint waits this many times the last one's duration
REBASE_CHECK_S = 1.0  # a big delta looks for a newer checkpoint at most this often
# a journal catch-up replays at most this many records under the lock; a longer one is
# applied off it first, in parts (~1 us a record at 10^7 pages)
JOURNAL_ON_LOCK = 4096


class Evicted(NamedTuple):
    """Own pages one eviction took out of the table without a log record, kept flat (no
    object per page) until a commit rewrites exactly their slots -- then they are settled
    at once -- or anything else needs :attr:`SlabIndex.unlogged`, which takes them in."""

    ds: bytes  # their digests, concatenated
    values: array.array[int]  # their entries, six values each (writer, slab, slot first)


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
    """``digest(key) -> Entry`` for one namespace, built from every writer's log.

    ``lock`` guards the index and is shared with the writer that composes it. ``own`` is
    the writer this process owns (its log is appended by this process, not tailed);
    ``on_free(slab, slot)`` is called when a DEL read from a log frees one of its slots.

    Log-derived state. ``table`` (a :class:`~hicache_l3.slab.table.PageTable`: page
    digest -> entry, and its slot inverse) is what the logs say, less the pages this
    process removed on its own judgement without a log record (found unreadable, or
    evicted by this writer for a slot not rewritten yet): those are kept in ``unlogged``
    (by digest) until a log record supersedes them, so that :meth:`state` -- what a
    checkpoint stores -- is exactly what a replay of the logs gives, whatever this
    process found unreadable. Internals key on digests (:func:`~hicache_l3.slab.table.digest`);
    the keys themselves are only in the logs (and in ``foreign_dels``).

    ``capacity``: how many pages the namespace is expected to hold at most (the writers'
    slots), a hint for the table's growth (:meth:`~hicache_l3.slab.table.PageTable.expect`).
    """

    def __init__(self, writers_dir: Path, files: SlabFiles, capacity: int | None = None) -> None:
        self.writers_dir = writers_dir
        self.directory = writers_dir.parent
        self.files = files
        self.capacity = capacity
        self.lock = threading.RLock()
        self.table: PageTable = new_table(capacity)
        self.deleted: dict[tuple[int, int, int], int] = {}  # slot -> newest generation deleted
        self.tails: dict[int, LogTail] = {}
        self.dir_mtime = -1
        self.changes: ChangeFile | None = None  # the namespace's change file (slab/changes.py), when used
        self.pending: set[int] = set()  # writer directories seen without an index.log yet
        self.ignored: set[str] = set()  # entries of writers/ that are not writer directories
        self.own: int | None = None
        # other writers' pages this process found unreadable, by digest: when it stores one
        # of these keys again it logs a DEL for the old page, so that no reader (whatever
        # order it reads the logs in) keeps preferring the unreadable copy
        self.dropped: dict[bytes, Entry] = {}
        self.on_free: Callable[[int, int], None] = lambda slab, slot: None
        self._unlogged: dict[bytes, Entry] = {}
        self._unlogged_at: dict[tuple[int, int, int], bytes] = {}
        self._evicted: list[Evicted] = []  # unlogged too, not yet in the dicts (flat)
        self.loaded = False  # the checkpoint was looked for
        self.applied = 0  # log records applied since the last checkpoint written or loaded
        self.replayed = 0  # log records this process read from logs (not its own appends)
        self.checkpoint_pages = -1  # pages the loaded checkpoint held (-1: none loaded)
        self._saver: threading.Thread | None = None  # a background checkpoint write
        self.base_id: tuple[int, int] | None = None  # (inode, mtime) of the checkpoint mapped as base
        self.rebases = 0
        self._rebase_checked = 0.0
        self._rebase_due = False  # a checkpoint was written: rebase on it
        self._next_checkpoint = 0.0  # (monotonic) not due before: see checkpoint_due
        # what a background checkpoint write left for the next refresh: the table that
        # replaces the live one (with its base's file id), False (none: stop the journal),
        # None (nothing)
        self._pending_base: tuple[NativePageTable, tuple[int, int]] | Literal[False] | None = None

    # ---- unlogged pages -------------------------------------------------------------------
    @property
    def unlogged(self) -> dict[bytes, Entry]:
        """Pages taken out of the table without a log record, by digest (class
        docstring). Caller holds ``lock``."""
        if self._evicted:
            self._take_in_evicted()
        return self._unlogged

    @property
    def unlogged_at(self) -> dict[tuple[int, int, int], bytes]:
        """The slots of :attr:`unlogged`'s pages -> their digests. Caller holds ``lock``."""
        if self._evicted:
            self._take_in_evicted()
        return self._unlogged_at

    def _take_in_evicted(self) -> None:
        """Move the flat :class:`Evicted` batches into the unlogged dicts."""
        batches, self._evicted = self._evicted, []
        for batch in batches:
            ds, entries = split_snapshot(batch.ds, batch.values)
            self._unlogged.update(zip(ds, entries))
            self._unlogged_at.update(zip(map(_WHERE, entries), ds))

    def remove_unlogged_at(self, wheres: Sequence[tuple[int, int, int]]) -> None:
        """:meth:`remove_unlogged` of the pages in slots ``wheres`` (an eviction): kept as
        one flat :class:`Evicted` batch, which the commit that rewrites exactly these
        slots (the common case) settles as a whole."""
        ds, values = self.table.take_at_many(wheres)
        if ds:
            self._evicted.append(Evicted(ds, values))

    def remove_unlogged_runs(self, writer: int, runs: Sequence[tuple[int, int, int]]) -> None:
        """:meth:`remove_unlogged_at` of the slots of ``runs`` (``(slab, first, count)``:
        slots ``first .. first + count - 1`` of ``writer``'s ``slab``, in order), each run
        taken in one C call (:func:`~hicache_l3.slab.evict.take_run`), kept as one flat
        :class:`Evicted` batch like :meth:`remove_unlogged_at`'s."""
        parts = [take_run(self.table, writer, slab, first, count) for slab, first, count in runs]
        if len(parts) == 1:
            ds, values = parts[0]
        else:
            ds = b"".join(d for d, _ in parts)
            values = array.array("Q")
            for _, v in parts:
                values.extend(v)
        if ds:
            self._evicted.append(Evicted(ds, values))

    def _settle_evicted(self, values: array.array[int]) -> None:
        """PUTs of entries ``values`` (unblocked; six values each) settle an
        :class:`Evicted` batch of exactly their slots, in order: every page of it is
        superseded by the PUT into its slot. Any other batch is taken into the dicts,
        where the per-page rules apply. (Compared as strided array slices: no object per
        page.)"""
        n = len(values)
        slabs, slots = values[1::6], values[2::6]
        for k, batch in enumerate(self._evicted):
            theirs = batch.values
            if (len(theirs) == n and theirs[2::6] == slots and theirs[1::6] == slabs
                    and theirs[0::6] == values[0::6]):
                del self._evicted[k]
                break
        if self._evicted:
            self._take_in_evicted()

    # ---- following the logs -------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up records appended by every writer (new writers included). Caller holds
        ``lock``."""
        if not self.loaded:
            self.loaded = True
            self.load_checkpoint()
        changes = self.changes
        if (changes is None or not changes.unchanged() or self.pending) and not self._look_at_logs():
            return
        if self._pending_base is not None:
            self._adopt_base(defer=True)
        if self._rebase_due:
            self.rebase_on_newer(force=True)
        elif self.delta_big():
            if self.own is not None and self.checkpoint_due():
                self.save_checkpoint_later()  # (a writer that stopped writing, with a big delta)
            else:
                self.rebase_later()

    def _look_at_logs(self) -> bool:
        """The look :meth:`refresh` takes at ``writers/`` and every other writer's log
        (what the change file, :mod:`~hicache_l3.slab.changes`, spares while it says
        nothing was published); False when ``writers/`` is gone."""
        try:
            mtime = os.stat(self.writers_dir).st_mtime_ns
        except FileNotFoundError:
            return False
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
        return True

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
        for writer in set(writers):
            self.table.pop_many([d for d, _ in self.table.select(writer)])
        self.forget_unlogged(*writers)

    def forget_unlogged(self, *writers: int) -> None:
        """Drop the :attr:`unlogged` pages of ``writers`` (their logs no longer hold them,
        or are about to be read again)."""
        for d, entry in list(self.unlogged.items()):
            if entry.writer in writers:
                del self.unlogged[d]
                self.unlogged_at.pop((entry.writer, entry.slab, entry.slot), None)

    def unlogged_of(self, writer: int) -> dict[bytes, Entry]:
        """A copy of the :attr:`unlogged` pages of ``writer``. Caller holds ``lock``."""
        return {d: e for d, e in self.unlogged.items() if e.writer == writer}

    def forget_unlogged_entries(self, entries: dict[bytes, Entry]) -> None:
        """Drop each of ``entries`` from :attr:`unlogged` where it is still there as it was
        (a log compacted from a table without them no longer holds them; pages taken out
        since stay). Caller holds ``lock``."""
        unlogged = self.unlogged
        for d, entry in entries.items():
            if unlogged.get(d) == entry:
                del unlogged[d]
                self.unlogged_at.pop((entry.writer, entry.slab, entry.slot), None)

    def read_tail(self, writer: int, tail: LogTail, size: int) -> None:
        """Apply ``writer``'s records from ``tail.offset`` up to ``size``; DELs it issued
        for other writers' slots are also kept in ``tail.foreign_dels``. Read
        :data:`TAIL_CHUNK` bytes at a time: the records decoded at once are Python
        objects, and the allocator keeps much of their peak (measured: ~250 B a record
        replayed stayed resident, more than the index itself over a shared checkpoint)."""
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
        h, seed = xxh3_128, DIGEST_SEED
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
                    self.apply_puts(run_d, run_e)
                    run_d, run_e = [], []
                self.apply_del(h(key.encode(), seed), entry)
                if entry.writer != writer:
                    tail.foreign_dels.append((key, entry))
            elif kind == GEN:
                max_gen = max(max_gen, entry.gen)
        if run_d:
            self.apply_puts(run_d, run_e)
        tail.max_gen = max_gen
        tail.offset += used
        self.applied += len(records)
        self.replayed += len(records)
        return used

    def apply_put(self, d: bytes, entry: Entry) -> None:
        """The key of digest ``d`` is now in ``entry``'s slot (superseding what that slot
        held, and the key's page elsewhere).

        A PUT whose exact page a DEL read earlier removed (the DEL came from another
        writer's log, read first) is not indexed, but still supersedes what it superseded
        when written: the slot's older page, and an older page of the key by the same
        writer. So the index does not depend on the order the logs are read in (for keys
        stored by one writer; two writers storing one key at once leave either copy, with
        the same bytes)."""
        where = (entry.writer, entry.slab, entry.slot)
        table = self.table
        blocked = self.deleted.get(where, 0) >= entry.gen
        if self.unlogged:
            self._settle_unlogged(d, entry, blocked)
        if not blocked:
            table.put(d, entry)  # supersedes the slot's page and the key's former slot
            return
        old_d = table.at(where)
        if old_d is not None:
            table.pop(old_d)
        previous = table.get(d)
        if previous is not None and previous.writer == entry.writer and previous.gen < entry.gen:
            table.pop(d)

    def _settle_unlogged(self, d: bytes, entry: Entry, blocked: bool) -> None:
        """The logs' view of a PUT: it supersedes the key's and the slot's unlogged page
        (and whatever :attr:`unlogged_at` said of its slot: nothing unlogged is there now)."""
        where = (entry.writer, entry.slab, entry.slot)
        old = self.unlogged.get(d)
        if old is not None and (not blocked or (old.writer == entry.writer and old.gen < entry.gen)):
            self._unlog(d)
        self._unlog(self.unlogged_at.pop(where, None), where)

    def settle_unlogged_many(self, ds: Sequence[bytes], entries: Sequence[Entry]) -> None:
        """:meth:`_settle_unlogged` of each unblocked PUT ``ds[j]``/``entries[j]``, in bulk.

        Settling only removes pages from :attr:`unlogged`, and whether a page goes depends
        on that page and one PUT alone (a PUT into its slot, or of its key), never on the
        other removals: so the order does not matter and one pass per kind gives exactly
        the per-page result. The common batch at capacity rewrites exactly the slots its
        reservation evicted: every slot's unlogged page goes, by C-level map/pop calls."""
        unlogged, unlogged_at = self.unlogged, self.unlogged_at
        wheres: list[tuple[int, int, int]] = list(map(_WHERE, entries))
        pop_at: Callable[[tuple[int, int, int], None], bytes | None] = unlogged_at.pop
        found = list(map(pop_at, wheres, repeat(None)))  # the slots' unlogged pages
        olds = [d for d in found if d is not None]
        if len(olds) != len(found):
            wheres = [w for d, w in zip(found, wheres) if d is not None]
        if olds:
            pop: Callable[[bytes, None], Entry | None] = unlogged.pop
            gone = list(map(pop, olds, repeat(None)))
            if list(map(_WHERE, filter(None, gone))) != wheres:  # rare: a page elsewhere, or none
                for d, e, w in zip(olds, gone, wheres):
                    if e is not None and _WHERE(e) != w:
                        unlogged[d] = e  # not in this slot: the PUT does not supersede it
        if unlogged and not unlogged.keys().isdisjoint(ds):  # the keys' own unlogged pages
            for d in ds:
                self._unlog(d)

    def apply_put_values(self, ds: Sequence[bytes], values: array.array[int]) -> None:
        """:meth:`apply_puts` of a batch shaped as a table export: ``ds[j]`` with the six
        values ``values[6j : 6j + 6]`` (a writer's commit builds no Entry per page). A
        batch with no blocked PUT (the common one) settles its unlogged pages in bulk and
        goes to the table in one call; any other takes the per-page path."""
        if len(values) != 6 * len(ds):
            raise ValueError(f"apply_put_values: {len(ds)} digests for {len(values)} values")
        deleted, blob = self.deleted, joined(ds)
        if deleted and not deleted.keys().isdisjoint(zip(values[0::6], values[1::6], values[2::6])):
            self.apply_puts(ds, split_snapshot(blob, values)[1])
            return
        if self._evicted:
            self._settle_evicted(values)
        if self._unlogged:
            self.settle_unlogged_many(ds, split_snapshot(blob, values)[1])
        self.table.load(blob, values)

    def apply_puts(self, ds: Sequence[bytes], entries: Sequence[Entry]) -> None:
        """:meth:`apply_put` of each ``ds[j]``/``entries[j]`` in order. Unblocked PUTs (no
        DEL mark for their page: then a PUT is exactly ``table.put`` once its unlogged
        pages are settled) go to the table together, in one call per run; a batch with no
        blocked PUT (the common one) settles its unlogged pages in bulk and is one call."""
        deleted = self.deleted
        if not deleted or deleted.keys().isdisjoint(map(_WHERE, entries)):
            if self._evicted:
                try:
                    values = array.array("Q", chain.from_iterable(entries))
                except OverflowError:
                    raise ValueError("page table: an entry is out of range (negative or over "
                                     "64 bits)") from None
                self._settle_evicted(values)
            if self._unlogged:
                self.settle_unlogged_many(ds, entries)
            self.table.put_many(ds, entries)
            return
        run_d: list[bytes] = []
        run_e: list[Entry] = []
        for d, entry in zip(ds, entries):
            if deleted and deleted.get(entry[:3], 0) >= entry.gen:
                if run_d:
                    self.table.put_many(run_d, run_e)
                    run_d, run_e = [], []
                self.apply_put(d, entry)
                continue
            if self.unlogged:
                self._settle_unlogged(d, entry, False)
            run_d.append(d)
            run_e.append(entry)
        if run_d:
            self.table.put_many(run_d, run_e)

    def apply_del(self, d: bytes, entry: Entry) -> None:
        """The exact page ``entry`` of the key of digest ``d`` is gone (a newer page of the
        slot stays)."""
        where = (entry.writer, entry.slab, entry.slot)
        if self.deleted.get(where, 0) < entry.gen:
            self.deleted[where] = entry.gen
        if self.unlogged:
            old = self.unlogged.get(d)
            if old is not None and old[:4] == entry[:4]:
                self._unlog(d)
        current = self.table.get(d)
        if current is None or current[:4] != entry[:4]:
            return
        self.table.pop(d)
        if entry.writer == self.own:
            self.on_free(entry.slab, entry.slot)

    # ---- answering ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Pages indexed now."""
        return len(self.table)

    def entry(self, key: str) -> Entry | None:
        """The entry of ``key`` now, or None."""
        return self.table.get(digest(key))

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: is it indexed now?"""
        return self.table.contains_many(digests(keys))

    def lookup(self, keys: Sequence[str]) -> list[Located | None]:
        """Per key: a descriptor and entry to read it from, or None. A slab that cannot be
        opened (missing, unreadable) drops its keys from the index: they miss, ``exists``
        stops reporting them and a later set stores them again. Caller holds ``lock``."""
        fd, located = self.files.get, _new_located
        fds: dict[tuple[int, int], int] = {}
        out: list[Located | None] = []
        for entry in self.table.get_many(digests(keys)):
            if entry is None:
                out.append(None)
                continue
            slab = entry[:2]  # (writer, slab): a batch's pages share few slabs
            f = fds.get(slab)
            if f is None:
                try:
                    f = fds[slab] = fd(*slab)
                except OSError as exc:
                    self._drop_slab(entry.writer, entry.slab, exc)
                    out.append(None)
                    continue
            out.append(located((f, entry)))
        return out

    def plan(self, keys: Sequence[str], geometry: Geometry, verified_only: bool) -> GetPlan | None:
        """:meth:`lookup` and the checks before a read of ``keys`` in one C call
        (:mod:`hicache_l3.slab.plan`), or None where the C table cannot plan (the caller
        takes :meth:`lookup` then). Same semantics: a slab that cannot be opened drops its
        keys from the index and they miss. Caller holds ``lock``."""
        def open_slab(writer: int, slab: int) -> int | None:
            try:
                return self.files.get(writer, slab)
            except OSError as exc:
                self._drop_slab(writer, slab, exc)
                return None

        return plan_get(self.table, keys, geometry, verified_only, open_slab)

    def _drop_slab(self, writer: int, slab: int, exc: OSError) -> None:
        lost = self.table.select(writer, slab)
        for d, entry in lost:
            self.drop(d, entry)
        log.warning("%s: cannot open (%s): its %d pages dropped from the index",
                    self.files.path(writer, slab), exc.strerror, len(lost))

    def _unlog(self, d: bytes | None, where: tuple[int, int, int] | None = None) -> None:
        """Remove digest ``d`` from :attr:`unlogged` (a log record superseded it); only if
        its page is in slot ``where`` when given."""
        if d is None:
            return
        entry = self.unlogged.get(d)
        if entry is None:
            return
        if where is not None and (entry.writer, entry.slab, entry.slot) != where:
            return
        del self.unlogged[d]
        self.unlogged_at.pop((entry.writer, entry.slab, entry.slot), None)

    def remove_unlogged(self, d: bytes, entry: Entry) -> None:
        """Take digest ``d`` (mapped to ``entry`` now) out of this process's view without a
        log record: the logs still hold it (see :attr:`unlogged`)."""
        self.table.pop(d)
        self.unlogged[d] = entry
        self.unlogged_at[(entry.writer, entry.slab, entry.slot)] = d

    def drop(self, d: bytes, entry: Entry) -> bool:
        """Forget digest ``d`` if it still maps to ``entry`` (found unreadable); True if it
        did."""
        if self.table.get(d) != entry:
            return False
        self.remove_unlogged(d, entry)
        if entry.writer != self.own:
            if len(self.dropped) >= MAX_DROPPED:
                self.dropped.clear()
            self.dropped[d] = entry
        return True

    def live_keys(self) -> list[str]:
        """The keys of every indexed page, read from the logs (the table holds digests):
        the keys of the PUT records, up to where each log was read, whose digest the table
        maps to exactly that page. Caller holds ``lock``."""
        out: list[str] = []
        for tail in self.tails.values():
            if not tail.offset:
                continue
            data = os.pread(tail.fd, tail.offset, 0)
            spans = live_put_spans(self.table, data)  # in C, for a log with no damage
            if spans is not None:
                out += [data[start + RECORD.size : end].decode() for start, end in spans]
                continue
            puts = [(key, entry) for kind, key, entry in decode_records(data)[0] if kind == PUT]
            current = self.table.get_many(digests([key for key, _ in puts]))
            out += [key for (key, entry), now in zip(puts, current)
                    if now is not None and now[:4] == entry[:4]]
        return out

    # ---- checkpoint ---------------------------------------------------------------------
    def load_checkpoint(self) -> None:
        """Start from the namespace's checkpoint if there is a usable one: its entries,
        and each log's position; a log that no longer matches its mark (compacted, set
        aside, gone) loses the checkpoint's entries and is read again from its start.
        Called once, before any log is read. Caller holds ``lock``."""
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
        self.table = table
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
        self.checkpoint_pages = len(self.table)
        if stale:
            self.forget_writer(*stale)
        self.applied = 0

    def _load_pages(self, table: PageTable, state: checkpoint.IndexState) -> int:
        """Put a checkpoint's pages in the empty ``table``: its image mapped as the base
        (version 3, C table), or its pages loaded; how many pages the checkpoint holds.
        ValueError / MemoryError when they do not load."""
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
            lib = native_library()  # a dict table (the reference): the image's pages loaded
            if lib is None:
                raise ValueError("a version-3 checkpoint needs the C page table")
            mapped = NativePageTable(lib)
            mapped.attach(image.fd, image.offset, image.length)
            table.reserve(image.pages)
            table.load(*mapped.export())
            return image.pages
        finally:
            image.close()

    # ---- the shared base -----------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        """The table's memory: ``index_private_bytes`` (this process's arrays),
        ``index_shared_bytes`` (the mapped checkpoint image, one copy per node),
        ``index_delta_pages`` (pages held privately) and ``index_rebases``."""
        table = self.table
        shared = table.shared_nbytes if isinstance(table, NativePageTable) else 0
        delta = table.delta_len if isinstance(table, NativePageTable) else len(table)
        return {"index_private_bytes": table.nbytes, "index_shared_bytes": shared,
                "index_delta_pages": delta, "index_rebases": self.rebases}

    def delta_big(self) -> bool:
        """The table's private delta holds more than a :data:`CHECKPOINT_FRACTION` of the
        pages (and at least :data:`CHECKPOINT_MIN_RECORDS`): worth a rebase."""
        table = self.table
        return (isinstance(table, NativePageTable)
                and table.delta_len >= max(CHECKPOINT_MIN_RECORDS, len(table) // CHECKPOINT_FRACTION))

    def rebase_later(self) -> None:
        """Move the table onto the namespace's checkpoint, when it is another than the
        mapped base (looked for at most every :data:`REBASE_CHECK_S`), mostly off the
        lock: the table is forked (``snapshot``: its delta copied, its base shared) and its changes journaled
        from now; a background thread rebases the copy on the checkpoint; the next
        :meth:`refresh` catches it up with the journal and adopts it. Caller holds
        ``lock``; nothing while a background checkpoint write or rebase runs."""
        now = time.monotonic()
        table = self.table
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
            state = checkpoint.read(self.directory)
            if state is not None and state.image is not None:
                image = state.image
                try:
                    copy.rebase(image.fd, image.offset, image.length)
                    new = copy.table, _file_id(image.fd)
                except (ValueError, MemoryError) as exc:
                    log.warning("%s: index not rebased on its checkpoint (%s)", self.directory, exc)
                finally:
                    image.close()
        finally:
            self._pending_base = new if new is not None else False

    def rebase_on_newer(self, force: bool = False) -> bool:
        """Rebase the table onto the namespace's checkpoint when it is another than the
        mapped base (looked for at most every :data:`REBASE_CHECK_S` unless ``force``):
        the pages stay exactly as they are, the delta keeps only what differs from it.
        A rebase onto a newer checkpoint also counts as a checkpoint written (no process
        writes one right after another's). Caller holds ``lock``. Whether it rebased."""
        now = time.monotonic()
        if not force and now - self._rebase_checked < REBASE_CHECK_S:
            return False
        self._rebase_checked, self._rebase_due = now, False
        table = self.table
        if not isinstance(table, NativePageTable) or not self._newer_checkpoint():
            return False
        state = checkpoint.read(self.directory)
        if state is None or state.image is None:
            return False
        image = state.image
        try:
            table.rebase(image.fd, image.offset, image.length)
            self.base_id = _file_id(image.fd)
        except (ValueError, MemoryError) as exc:
            log.warning("%s: index not rebased on its checkpoint (%s)", self.directory, exc)
            return False
        finally:
            image.close()
        self.rebases += 1
        self.applied = 0
        return True

    def state(self, copy: bool = False) -> checkpoint.IndexState:
        """The log-derived state of this index now (see the class docstring), what a
        checkpoint holds. Caller holds ``lock``. Without ``copy`` it shares the live
        dicts (encode it before releasing ``lock``); with ``copy`` it is a snapshot that
        may be encoded on another thread (the C table is always copied, with the unlogged
        pages put in: ``state.table``, a fork costing here its private delta and not its
        shared base; a dict table is exported, ~10 ns a page; the small dicts are copied)."""
        table, flat = self.table, None
        if isinstance(table, NativePageTable):
            ds, values = b"".join(self.unlogged), array.array("Q")
            for entry in self.unlogged.values():
                values.extend(entry)
            with contextlib.suppress(MemoryError):
                flat = table.snapshot(ds, values)
        if flat is not None:
            ds, values = b"", array.array("Q")
        else:
            ds, values = table.export()
            if self.unlogged:  # pages the logs still hold (see the class docstring)
                ds, values = _with_unlogged(table, ds, values, self.unlogged)
        marks = []
        for writer, tail in sorted(self.tails.items()):
            head, anchor = checkpoint.log_crcs(tail.fd, tail.offset)
            dels = list(tail.foreign_dels) if copy else tail.foreign_dels
            marks.append(checkpoint.LogMark(writer, tail.ino, tail.offset, tail.max_gen, head,
                                            anchor, dels))
        return checkpoint.IndexState(ds, values, dict(self.deleted) if copy else self.deleted, marks,
                                     table=flat)

    def checkpoint_due(self) -> bool:
        """Enough records were applied since the last checkpoint to write a new one:
        :data:`CHECKPOINT_MIN_RECORDS` and a :data:`CHECKPOINT_FRACTION` of the pages,
        and the last one written ended :data:`CHECKPOINT_DUTY` times its own duration ago
        (checkpoints take at most ~1/(1 + that) of the time: a store filled at full
        speed would otherwise write its whole table every 1/32 of its pages)."""
        return (self.applied >= max(CHECKPOINT_MIN_RECORDS, len(self.table) // CHECKPOINT_FRACTION)
                and time.monotonic() >= self._next_checkpoint)

    def save_checkpoint(self) -> bool:
        """Write the namespace's checkpoint from :meth:`state` now (after a background
        save still running, so that the newest state lands last); False (logged) when it
        could not be written -- the logs stay the source, nothing is lost. Caller holds
        ``lock``."""
        self.wait_checkpoint()
        self._adopt_base()
        started = time.monotonic()
        try:
            written = checkpoint.write(self.directory, self.state(), self.capacity)
        except OSError as exc:
            log.warning("%s: index checkpoint not written (%s)", self.directory, exc)
            return False
        ended = time.monotonic()
        self._next_checkpoint = ended + CHECKPOINT_DUTY * (ended - started)
        self.applied = 0
        self._rebase_due = written  # (by the next refresh, if this process goes on)
        return written

    def save_checkpoint_later(self) -> None:
        """Snapshot the state now (caller holds ``lock``; the copy is the only cost under
        it) and encode and write it on a background thread, so that serving threads are
        not held for the seconds a big index takes to write. One at a time: while one is
        running this does nothing (the checkpoint stays due)."""
        if self._saver is not None and self._saver.is_alive():
            return
        self._adopt_base(defer=True)  # (what a previous one left, before the journal starts again)
        if self.busy():
            return  # (a long catch-up goes on off the lock first; the checkpoint stays due)
        state = self.state(copy=True)
        self.applied = 0
        fixups = None
        table = self.table
        if isinstance(table, NativePageTable):
            # the table moves onto this checkpoint once written: its changes since this
            # snapshot are journaled, and the image differs from the table by the unlogged pages
            with contextlib.suppress(MemoryError):
                table.journal_start()
                fixups = list(zip(self.unlogged, table.get_many(list(self.unlogged))))
        self._saver = threading.Thread(target=self._write_state, args=(state, fixups),
                                       name="hicache-index-checkpoint", daemon=True)
        self._saver.start()

    def _write_state(self, state: checkpoint.IndexState,
                     fixups: list[tuple[bytes, Entry | None]] | None) -> None:
        """The saver thread: write ``state``; then, without the lock, the table the live
        one becomes (the written image as its base, ``fixups`` applied: the snapshot's
        table), left for the next :meth:`refresh` to catch up and adopt."""
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
        (the image holds the unlogged pages too: ``fixups`` give the table's page of each
        of their digests, or None), and the image's file id; None when it cannot be made."""
        lib = native_library()
        if lib is None:
            return None
        table = NativePageTable(lib)
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
        """Adopt the table a finished background checkpoint or rebase made (caller holds
        ``lock``): it catches up with the live table's journal (the changes since the
        snapshot) and replaces it. With ``defer``, a journal longer than
        :data:`JOURNAL_ON_LOCK` records is handed to a thread that applies it off the lock
        (the live table journals on), and a later call adopts. Without a table (the write
        failed or was not version 3) the journal stops and the next refresh rebases on
        whatever checkpoint is there."""
        pending, self._pending_base = self._pending_base, None
        if pending is None:
            return
        table = self.table
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
        self.table, self.base_id = new, base_id
        self.rebases += 1
        # the old table is freed by a thread of its own (its base's unmapping: tens of ms
        # at 10^7 pages), not under the lock
        reaper = threading.Thread(target=_drop, args=(table,), name="hicache-index-free", daemon=True)
        del table  # (the thread's arguments hold the last reference)
        reaper.start()

    def _catch_up_off_lock(self, new: NativePageTable, base_id: tuple[int, int], part: JournalPart) -> None:
        """The thread of a deferred :meth:`_adopt_base`: ``part`` (the journal's records so
        far) applied to ``new`` without the lock nor the GIL; the next refresh applies the
        rest and adopts it."""
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
        waits for the next :meth:`refresh` to adopt it (a hint: read without the lock)."""
        return self._pending_base is not None or (self._saver is not None and self._saver.is_alive())

    def wait_checkpoint(self, timeout: float | None = None) -> None:
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
