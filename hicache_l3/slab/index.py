"""The index every process of a namespace runs: ``digest(key) -> Entry`` in a page table,
fed by every writer's ``index.log`` on top of the namespace's checkpoint. A PUT supersedes
what its slot held; a DEL names the exact page it removes; logs are read in any order.
"""

from __future__ import annotations

import array
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from pathlib import Path
from typing import NamedTuple

from hicache_l3.slab.evict import take_run
from hicache_l3.slab.files import SlabFiles
from hicache_l3.slab.format import PUT, RECORD, Entry, Geometry, Located, decode_records
from hicache_l3.slab.index_checkpoint import IndexCheckpoints
from hicache_l3.slab.log_follow import LogFollower, LogTail
from hicache_l3.slab.plan import GetPlan, plan_get
from hicache_l3.slab.table import (
    PageTable,
    digest,
    digests,
    entry_values,
    joined,
    live_put_spans,
    new_table,
    split_snapshot,
)

log = logging.getLogger("hicache_l3.slab")
_new_located = functools.partial(tuple.__new__, Located)  # no Python-level __new__ per page
_WHERE = itemgetter(0, 1, 2)  # an entry's slot: (writer, slab, slot)
MAX_DROPPED = 1 << 16


class Evicted(NamedTuple):
    """Own pages one eviction took out of the table without a log record, kept flat
    (digests concatenated, six values per entry) until a commit rewrites exactly their slots
    or :attr:`SlabIndex.unlogged` takes them in."""

    ds: bytes  # their digests, concatenated
    values: array.array[int]  # their entries, six values each (writer, slab, slot first)


class SlabIndex:
    """``digest(key) -> Entry`` for one namespace, built from every writer's log.

    ``lock`` guards the index (shared with the writer); ``own`` is this process's writer;
    ``on_free(slab, slot)`` is called when a DEL frees one of its slots. ``table`` is what the
    logs say, less the pages this process removed without a log record, kept in
    ``unlogged`` until a record supersedes them (so a checkpoint stores what a replay gives).
    ``capacity``: pages the namespace is expected to hold at most (a growth hint)."""

    def __init__(self, writers_dir: Path, files: SlabFiles, capacity: int | None = None) -> None:
        self.writers_dir = writers_dir
        self.directory = writers_dir.parent
        self.files = files
        self.capacity = capacity
        self.lock = threading.RLock()
        self.table: PageTable = new_table(capacity)
        self.deleted: dict[tuple[int, int, int], int] = {}  # slot -> newest generation deleted
        self.own: int | None = None
        # other writers' pages this process found unreadable, by digest: when it stores one
        # of these keys again it logs a DEL for the old page, so that no reader (whatever
        # order it reads the logs in) keeps preferring the unreadable copy
        self.dropped: dict[bytes, Entry] = {}
        self.on_free: Callable[[int, int], None] = lambda slab, slot: None
        self._unlogged: dict[bytes, Entry] = {}
        self._unlogged_at: dict[tuple[int, int, int], bytes] = {}
        self._evicted: list[Evicted] = []  # unlogged too, not yet in the dicts (flat)
        self.applied = 0  # log records applied since the last checkpoint written or loaded
        self.replayed = 0  # log records this process read from logs (not its own appends)
        self.logs = LogFollower(writers_dir, self)
        self.checkpoints = IndexCheckpoints(self)

    # ---- unlogged pages -------------------------------------------------------------------
    @property
    def unlogged(self) -> dict[bytes, Entry]:
        """Pages taken out of the table without a log record, by digest. Caller holds ``lock``."""
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
        """:meth:`remove_unlogged` of the pages in slots ``wheres`` (an eviction), kept as
        one :class:`Evicted` batch."""
        ds, values = self.table.take_at_many(wheres)
        if ds:
            self._evicted.append(Evicted(ds, values))

    def remove_unlogged_runs(self, writer: int, runs: Sequence[tuple[int, int, int]]) -> None:
        """:meth:`remove_unlogged_at` of the slots of ``runs`` (``(slab, first, count)`` of
        ``writer``), one C call per run."""
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
        """Settle the :class:`Evicted` batch of exactly these slots; take any other in."""
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
        """Pick up every writer's new records (the checkpoint loaded first). Caller holds ``lock``."""
        checkpoints = self.checkpoints
        if not checkpoints.loaded:
            checkpoints.loaded = True
            checkpoints.load()
        if self.logs.look():
            checkpoints.maintain()

    @property
    def tails(self) -> dict[int, LogTail]:
        """Every followed log's tail, by writer (:attr:`LogFollower.tails`)."""
        return self.logs.tails

    def forget_writer(self, *writers: int) -> None:
        """Drop every entry of ``writers``, :attr:`unlogged` ones too (their logs are about
        to be read again)."""
        for writer in set(writers):
            self.table.pop_many([d for d, _ in self.table.select(writer)])
        self.forget_unlogged_entries({d: e for d, e in self.unlogged.items() if e.writer in writers})

    def unlogged_of(self, writer: int) -> dict[bytes, Entry]:
        """A copy of the :attr:`unlogged` pages of ``writer``. Caller holds ``lock``."""
        return {d: e for d, e in self.unlogged.items() if e.writer == writer}

    def forget_unlogged_entries(self, entries: dict[bytes, Entry]) -> None:
        """Drop each of ``entries`` from :attr:`unlogged` where it is still there as it
        was. Caller holds ``lock``."""
        unlogged = self.unlogged
        for d, entry in entries.items():
            if unlogged.get(d) == entry:
                del unlogged[d]
                self.unlogged_at.pop((entry.writer, entry.slab, entry.slot), None)


    def apply_put(self, d: bytes, entry: Entry) -> None:
        """The key of digest ``d`` is now in ``entry``'s slot (superseding what that slot
        held, and the key's page elsewhere). A PUT whose exact page a DEL already removed is not
        indexed but still supersedes what it superseded when written."""
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
        """A PUT supersedes the key's and the slot's unlogged page."""
        where = (entry.writer, entry.slab, entry.slot)
        old = self.unlogged.get(d)
        if old is not None and (not blocked or (old.writer == entry.writer and old.gen < entry.gen)):
            self._unlog(d)
        self._unlog(self.unlogged_at.pop(where, None), where)

    def settle_unlogged_many(self, ds: Sequence[bytes], entries: Sequence[Entry]) -> None:
        """:meth:`_settle_unlogged` of each unblocked PUT ``ds[j]``/``entries[j]``, in bulk
        (order does not matter: each removal depends on one page and one PUT)."""
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
        """:meth:`apply_puts` of ``ds[j]`` with the six values ``values[6j : 6j + 6]``.
        :class:`ValueError` on mismatched lengths."""
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
        """:meth:`apply_put` of each ``ds[j]``/``entries[j]`` in order; unblocked PUTs go to
        the table in one call per run."""
        deleted = self.deleted
        if not deleted or deleted.keys().isdisjoint(map(_WHERE, entries)):
            if self._evicted:
                self._settle_evicted(entry_values(entries))
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
        """The exact page ``entry`` of digest ``d`` is gone (a newer page of the slot stays)."""
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
        opened drops its keys from the index. Caller holds ``lock``."""
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

    def plan(self, keys: Sequence[str], geometry: Geometry, verified_only: bool,
             direct: bool = False) -> GetPlan | None:
        """:meth:`lookup` and the checks before a read of ``keys`` in one C call, or None
        where the table cannot plan; with ``direct``, its pages' O_DIRECT descriptors too.
        Caller holds ``lock``."""
        def open_slab(writer: int, slab: int) -> int | None:
            try:
                return self.files.get(writer, slab)
            except OSError as exc:
                self._drop_slab(writer, slab, exc)
                return None

        def open_direct(writer: int, slab: int) -> int:
            return self.files.get(writer, slab, direct=True)

        return plan_get(self.table, keys, geometry, verified_only, open_slab, open_direct if direct else None)

    def _drop_slab(self, writer: int, slab: int, exc: OSError) -> None:
        lost = self.table.select(writer, slab)
        for d, entry in lost:
            self.drop(d, entry)
        log.warning("%s: cannot open (%s): its %d pages dropped from the index",
                    self.files.path(writer, slab), exc.strerror, len(lost))

    def _unlog(self, d: bytes | None, where: tuple[int, int, int] | None = None) -> None:
        """Remove ``d`` from :attr:`unlogged` (only if its page is in slot ``where``, when given)."""
        if d is None:
            return
        entry = self.unlogged.get(d)
        if entry is not None and (where is None or _WHERE(entry) == where):
            del self.unlogged[d]
            self.unlogged_at.pop(_WHERE(entry), None)

    def remove_unlogged(self, d: bytes, entry: Entry) -> None:
        """Take digest ``d`` (mapped to ``entry``) out of the table without a log record."""
        self.table.pop(d)
        self.unlogged[d] = entry
        self.unlogged_at[(entry.writer, entry.slab, entry.slot)] = d

    def drop(self, d: bytes, entry: Entry) -> bool:
        """Forget ``d`` if it still maps to ``entry`` (found unreadable); True if it did."""
        if self.table.get(d) != entry:
            return False
        self.remove_unlogged(d, entry)
        if entry.writer != self.own:
            if len(self.dropped) >= MAX_DROPPED:
                self.dropped.clear()
            self.dropped[d] = entry
        return True

    def live_keys(self) -> list[str]:
        """The keys of every indexed page, read from the logs' PUT records whose digest the
        table maps to exactly that page. Caller holds ``lock``."""
        out: list[str] = []
        for tail in self.tails.values():
            if not tail.offset:
                continue
            data = os.pread(tail.fd, tail.offset, 0)
            spans = live_put_spans(self.table, data)  # in C, for a log with no damage
            if spans is not None:
                out += [data[start + RECORD.size : end].decode() for start, end in spans]
                continue
            out += [key for _, key, _ in self.live_puts(data)]
        return out

    def live_puts(self, data: bytes, writer: int | None = None) -> list[tuple[bytes, str, Entry]]:
        """The PUT records of ``data`` (of ``writer``'s pages, when given) whose digest the
        table maps to exactly their page, decoded: ``(digest, key, entry)``, each digest
        once. Caller holds ``lock``."""
        puts = [(key, e) for kind, key, e in decode_records(data)[0]
                if kind == PUT and (writer is None or e.writer == writer)]
        ds = digests([key for key, _ in puts])
        live: dict[bytes, tuple[bytes, str, Entry]] = {}
        for (key, e), d, now in zip(puts, ds, self.table.get_many(ds)):
            if now is not None and now[:4] == e[:4] and d not in live:
                live[d] = (d, key, now)
        return list(live.values())
