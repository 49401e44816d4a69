"""The slab store's writer: this process's own slots (allocation, recency, eviction,
reserve / commit / abort, delete, log compaction), composed with the index reader.
A record is appended to the writer's ``index.log`` only after its page's bytes are written.
"""

from __future__ import annotations

import array
import contextlib
import errno
import functools
import logging
import os
import stat
import threading
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import Any, NamedTuple

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.slab import ownership
from hicache_l3.slab.changes import ChangeFile
from hicache_l3.slab.clock import Clock, Clocks, iota, is_run, slab_spans
from hicache_l3.slab.compaction import LogCompaction
from hicache_l3.slab.files import SlabFiles, make_dir, open_file, writer_name
from hicache_l3.slab.format import (
    DEL,
    GEN,
    PUT,
    RECORD,
    Entry,
    Located,
    Slot,
    encode_record,
    namespace_dir,
    write_namespace_file,
)
from hicache_l3.slab.index import SlabIndex
from hicache_l3.slab.log_follow import LogTail
from hicache_l3.slab.plan import GetPlan
from hicache_l3.slab.records import encode_put_values, key_digests
from hicache_l3.slab.slots import SlotColumns
from hicache_l3.slab.table import Digests, digest, digests, live_put_spans

log = logging.getLogger("hicache_l3.slab")
_new_slot = functools.partial(tuple.__new__, Slot)
_FIRST, _SECOND = itemgetter(0), itemgetter(1)  # of a (slab, slot) pair

PREALLOCATE_CHUNK = 32 << 20  # slab space is reserved as slots are first used: doubling, this at most
SPLIT_MIN_BYTES = 32 << 20  # slabs this big (and SPLIT_MIN_SLOTS slots) or more: two clocks
SPLIT_MIN_SLOTS = 64
COMPACT_MIN_BYTES = 4 << 20  # a writer's log is rewritten once larger than this and 3x its live part


def split_min_slots(stride: int) -> int:
    """The fewest slots of ``stride`` bytes a slab must hold for a store to take a batch's
    victims from two slab files (:class:`~hicache_l3.slab.clock.Clocks`)."""
    return max(SPLIT_MIN_SLOTS, -(-SPLIT_MIN_BYTES // stride))


def _highest_slots(slabs: array.array[int], slots: array.array[int],
                   ) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """Per slab of the columns: its highest slot; and the columns as spans ``(slab, length)``."""
    spans = slab_spans(slabs, 4)
    highest: dict[int, int] = {}
    if spans is not None:
        for slab, lo, k in spans:
            part = slots[lo:lo + k]
            highest[slab] = part[-1] if is_run(part, part[0], k) else max(part)
        return highest, [(slab, k) for slab, _, k in spans]
    out: list[tuple[int, int]] = []
    for slab, slot in zip(slabs, slots):
        if slot > highest.get(slab, -1):
            highest[slab] = slot
        if out and out[-1][0] == slab:
            out[-1] = (slab, out[-1][1] + 1)
        else:
            out.append((slab, 1))
    return highest, out


class WritePlan(NamedTuple):
    """What a set must write: the indices of the keys to write, their reserved slots
    (same order), the indices of keys left without a slot because the store is full, and
    the table digests of the keys of ``todo`` (for :meth:`SlabStore.commit`)."""

    todo: list[int]
    slots: Sequence[Slot]  # a SlotColumns on the common batch
    full: list[int]
    digests: Sequence[bytes]


class SlabStore:
    """Slots in slab files plus the shared index, for one namespace under ``root``.

    Thread-safe. The store owns metadata only; the caller moves the bytes with the
    offsets it gets from :meth:`reserve_new` (set) and :meth:`lookup` (get), then calls
    :meth:`commit` / :meth:`abort`, or :meth:`invalidate` on a failed check.

    ``capacity_bytes`` bounds this writer's slabs, counted as
    :attr:`~hicache_l3.slab.format.Geometry.stride` per slot; when full, the least recently
    used own slot is reused. ``fsync`` is ``"none"`` (page cache only), ``"data"`` (slabs
    synced before index records are published) or ``"always"`` (the index log synced too).
    Raises :class:`~hicache_l3.common.errors.ConfigError` on a bad ``fsync``.
    """

    uses_change_file = True  # other processes' changes learnt through slab/changes.py
    _lock_writer = staticmethod(ownership.lock_writer)  # a writer directory's lock (flock)

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        slot_bytes: int,
        *,
        capacity_bytes: int | None = None,
        slab_bytes: int = 256 << 20,
        fsync: str = "none",
    ) -> None:
        if fsync not in ("none", "data", "always"):
            raise ConfigError(f"fsync must be 'none', 'data' or 'always', got {fsync!r}")
        self.namespace = namespace
        self.directory = namespace_dir(root, namespace)
        self.writers_dir = self.directory / "writers"
        self.geometry = write_namespace_file(self.directory, namespace, slot_bytes)
        self.fsync = fsync
        stride = self.geometry.stride
        self.slots_per_slab = max(1, slab_bytes // stride)
        self.max_slots = None if capacity_bytes is None else max(1, capacity_bytes // stride)
        self.split_min_slots = split_min_slots(stride)
        if self.max_slots is not None:  # two slabs at least where each is big enough to split
            half = -(-self.max_slots // 2)
            self.slots_per_slab = min(self.slots_per_slab,
                                      half if half >= self.split_min_slots else self.max_slots)
        self.files = SlabFiles(self.writers_dir, self.geometry.packed)
        self.index = SlabIndex(self.writers_dir, self.files, self._index_capacity())
        self.index.on_free = self._release
        self._lock = self.index.lock
        self._closed = False
        # writer state, created on first write
        self.me: int | None = None
        self._lock_fd = -1
        self._log_fd = -1
        self._clock = self._new_clock(self.slots_per_slab)
        self._free: list[tuple[int, int]] = []
        self._n_slabs = 0
        self._allocated: dict[int, int] = {}  # own slab -> bytes preallocated from its start
        self._next_gen = 1
        self.evictions = 0
        self.compactions = 0
        self._compactor: threading.Thread | None = None  # a background compaction (_compact_later)
        make_dir(self.writers_dir, exist_ok=True)
        if self.uses_change_file:
            self.index.logs.changes = ChangeFile.open(self.writers_dir.parent)

    def _new_clock(self, stride: int) -> Clock | Clocks:
        """Two clocks where slabs hold :attr:`split_min_slots` slots or more and there are two."""
        if stride >= self.split_min_slots and (self.max_slots is None or self.max_slots > stride):
            return Clocks(stride)
        return Clock(stride)

    def _index_capacity(self) -> int | None:
        """Pages the namespace's index table is expected to hold at most; None: unbounded."""
        return self.max_slots

    def _published(self, writer: int) -> None:
        """Tell the other processes (change file) that ``writer`` changed. Caller holds the lock."""
        changes = self.index.logs.changes
        if changes is not None:
            changes.published(writer)

    # ---- reading ------------------------------------------------------------------------
    def refresh(self) -> None:
        """Pick up index records appended by every writer (new writers included)."""
        with self._lock:
            self._check_open()
            self.index.refresh()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: is it in the index (after a refresh)?"""
        self.refresh()
        return self.index.contains(keys)

    def lookup(self, keys: Sequence[str]) -> list[Located | None]:
        """Per key: a descriptor and entry to read the slot from, or None for a miss."""
        self.refresh()
        with self._lock:
            self._check_open()
            return self.index.lookup(keys)

    def plan_get(self, keys: Sequence[str], verified_only: bool, direct: bool = False) -> GetPlan | None:
        """:meth:`lookup` of ``keys`` and the checks before their read, as one
        :class:`~hicache_l3.slab.plan.GetPlan` (with ``direct``, holding the pages' O_DIRECT
        descriptors); None where the table cannot plan."""
        self.refresh()
        with self._lock:
            self._check_open()
            return self.index.plan(keys, self.geometry, verified_only, direct)

    def touch(self, own: Sequence[tuple[int, int]]) -> None:
        """Mark own ``(slab, slot)`` pairs as recently used (LRU order)."""
        if not own:
            return
        with self._lock:
            self._clock.touch(own)

    def touch_columns(self, slabs: Sequence[int], slots: Sequence[int]) -> None:
        """:meth:`touch` of own ``(slabs[j], slots[j])`` (a planned get's columns)."""
        if not len(slots):
            return
        with self._lock:
            self._clock.touch_slots(slabs, slots)

    def invalidate(self, key: str, entry: Entry) -> None:
        """Forget ``key`` if it still maps to ``entry`` (its slot failed a check)."""
        with self._lock:
            self.index.drop(digest(key), entry)

    def fd(self, writer: int, slab: int, direct: bool = False) -> int:
        """A file descriptor on a slab (cached; O_DIRECT when ``direct``)."""
        with self._lock:
            return self.files.get(writer, slab, direct)

    # ---- writing ------------------------------------------------------------------------
    def reserve(self, count: int) -> Sequence[Slot]:
        """Up to ``count`` own slots; fewer when full. Evicts least recently used own pages
        when the capacity is reached (their keys are gone from the index at once)."""
        with self._lock:
            self._check_open()
            me = self._become_writer()
            slabs, slot_nos = self._take_slots(me, count)
            n = len(slot_nos)
            if not n:
                return []
            highest, spans = _highest_slots(slabs, slot_nos)
            fds, usable = {}, {}  # per slab: its fd, and the slots below this bound have space
            for slab, slot in highest.items():
                fds[slab] = fd = self.files.get(me, slab)
                try:
                    self._preallocate(fd, slab, slot)  # space up to the batch's highest slot
                    usable[slab] = slot + 1
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    usable[slab] = self.geometry.slots_in(self._allocated.get(slab, 0))
            gen = self._next_gen
            if all(usable[slab] > slot for slab, slot in highest.items()):  # space for all
                self._next_gen = gen + n
                fd_col = array.array("i")
                for slab, k in spans:
                    fd_col.extend(array.array("i", (fds[slab],)) * k)
                return SlotColumns(fd_col, slabs, slot_nos, array.array("Q", range(gen, gen + n)))
            out, make = [], _new_slot
            for i, (slab, slot) in enumerate(zip(slabs, slot_nos)):
                if slot >= usable[slab]:  # the disk is full: this and the rest get no slot
                    self._free.extend(reversed(list(zip(slabs[i:], slot_nos[i:]))))
                    break
                out.append(make((fds[slab], slab, slot, gen)))
                gen += 1
            self._next_gen = gen
            return out

    def reserve_new(self, keys: Sequence[str]) -> WritePlan:
        """Slots for the keys that are not stored yet (each key once); keys already stored
        need no write. This process becomes a writer first."""
        ready = self._writer_ready()
        ds = key_digests(keys)
        self.refresh()
        with self._lock:
            present = self.index.table.contains_many(ds)
        if not any(present) and (ds.distinct if ds.distinct is not None else len(set(keys)) == len(keys)):
            todo = list(range(len(keys)))
            todo_ds = ds
        else:
            seen: set[str] = set()
            todo = []
            for i, key in enumerate(keys):
                if not present[i] and key not in seen:
                    seen.add(key)
                    todo.append(i)
            todo_ds = Digests(b"".join([ds[i] for i in todo]))
        slots = self.reserve(len(todo)) if ready else []
        k = len(slots)
        return WritePlan(todo[:k], slots, todo[k:], todo_ds if k == len(todo) else todo_ds[:k])

    def _writer_ready(self) -> bool:
        """Own a writer directory (adopting or creating one); False if none can be owned."""
        self._become_writer()
        return True

    def _preallocate(self, fd: int, slab: int, slot: int) -> None:
        """Reserve disk space past ``slot``, a doubling chunk at a time (a full disk: ENOSPC)."""
        end = self.geometry.bytes_for(slot + 1)  # its group's marker table lies before its data
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

    def _take_slots(self, me: int, count: int) -> tuple[array.array[int], array.array[int]]:
        """Up to ``count`` own slots as columns ``(slabs, slots)``: free ones, then a new
        slab while the capacity allows, then evicted ones. Caller holds the lock."""
        slabs, slots = array.array("Q"), array.array("Q")
        free = self._free
        while len(slots) < count:
            if free:
                k = min(count - len(slots), len(free))
                part = free[len(free) - k :]
                part.reverse()  # the order pop() would give
                del free[len(free) - k :]
                slabs.extend(map(_FIRST, part))
                slots.extend(map(_SECOND, part))
            elif self.max_slots is None or self._n_slabs * self.slots_per_slab < self.max_slots:
                self._grow(me)
            elif not self._evict(me, count - len(slots), slabs, slots):
                break
        return slabs, slots

    def _evict(self, me: int, count: int, slabs: array.array[int], slots: array.array[int]) -> int:
        """Evict up to ``count`` own pages, their slots appended to the columns; how many."""
        runs = self._clock.evict_runs(count)
        if not runs:
            return 0
        # no DEL: each slot's next PUT supersedes its page
        self.index.remove_unlogged_runs(me, runs)
        n = 0
        for slab, first, k in runs:
            slabs.extend(array.array("Q", (slab,)) * k)
            slots.extend(iota(first, k))
            n += k
        self.evictions += n
        return n

    def _grow(self, me: int) -> None:
        slab = self._n_slabs
        slots = self.slots_per_slab
        if self.max_slots is not None:
            slots = min(slots, self.max_slots - slab * self.slots_per_slab)
        self.files.create(me, slab, self.geometry.bytes_for(slots))
        self._n_slabs += 1
        self._clock.grow(self._n_slabs)
        self._free.extend(zip(repeat(slab), reversed(range(slots))))  # C-level: no frame per slot

    def commit(self, keys: Sequence[str], slots: Sequence[Slot], checksums: Sequence[int],
               ds: Sequence[bytes] | None = None, lengths: Sequence[int] | None = None) -> None:
        """Publish written pages: ``keys[j]`` is in ``slots[j]`` with ``checksums[j]``
        (0: none) and ``lengths[j]`` bytes (None: every page a whole slot; shorter: a
        frame, :mod:`hicache_l3.slab.frames`). Call only after the bytes are written.
        ``ds``: the keys' digests (:attr:`WritePlan.digests`) or None. :class:`ValueError`
        on mismatched lengths."""
        if not keys:
            return
        me = self.me
        assert me is not None
        length = self.geometry.slot_bytes
        cols = SlotColumns.of(slots)
        if self.fsync != "none":
            for fd in set(cols.fds):
                os.fdatasync(fd)
        if ds is None:
            ds = key_digests(keys)
        n = len(keys)
        if not (len(ds) == len(cols) == len(checksums) == n) or (lengths is not None and len(lengths) != n):
            raise ValueError(f"commit: {n} keys, {len(cols)} slots, {len(checksums)} "
                             f"checksums, {len(ds)} digests")
        slabs, slot_nos, gens = cols.slabs, cols.slots, cols.gens
        # the entries, six values each (a table export's shape), filled a column at a time
        values = array.array("Q", bytes(48 * n))
        values[0::6] = array.array("Q", (me,)) * n
        values[1::6], values[2::6], values[3::6] = slabs, slot_nos, gens
        values[4::6] = array.array("Q", (length,)) * n if lengths is None else array.array("Q", lengths)
        values[5::6] = checksums if isinstance(checksums, array.array) and checksums.typecode == "Q" \
            else array.array("Q", checksums)
        records = encode_put_values(keys, values)
        with self._lock:
            self._check_open()
            if self.index.dropped:
                records = self._supersede(keys, ds) + records
            os.write(self._log_fd, records)
            self._published(me)
            tail = self.index.tails[me]
            tail.offset += len(records)
            tail.max_gen = max(tail.max_gen, max(gens))
            self.index.apply_put_values(ds, values)
            self._clock.add_slots(slabs, slot_nos)  # reserved slots are ABSENT: now own
            self.index.applied += len(keys)
            self._maybe_compact(me)
        if self.fsync == "always":
            os.fdatasync(self._log_fd)

    def _supersede(self, keys: Sequence[str], ds: Sequence[bytes]) -> bytes:
        """DEL records for the unreadable foreign pages ``keys`` replace. Caller holds the lock."""
        dropped, deleted, out = self.index.dropped, self.index.deleted, []
        for key, d in zip(keys, ds):
            old = dropped.pop(d, None)
            if old is not None:
                where = (old.writer, old.slab, old.slot)
                deleted[where] = max(deleted.get(where, 0), old.gen)
                self.index.tails[self.me].foreign_dels.append((key, old))  # type: ignore[index]
                out.append(encode_record(DEL, key, old))
        return b"".join(out)

    def abort(self, slots: Iterable[Slot]) -> None:
        """Give back reserved slots that were not committed."""
        with self._lock:
            for s in slots:
                self._free.append((s.slab, s.slot))

    def _release(self, slab: int, slot: int) -> None:
        if self._clock.discard(slab, slot):
            self._free.append((slab, slot))

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys from the shared index (any writer's); True where a key was there."""
        self.refresh()
        with self._lock:
            me = self._become_writer()
            found, records = [], []
            table, deleted = self.index.table, self.index.deleted
            for key, d in zip(keys, digests(keys)):
                entry = table.pop(d)
                found.append(entry is not None)
                if entry is None:
                    continue
                deleted[(entry.writer, entry.slab, entry.slot)] = entry.gen
                records.append(encode_record(DEL, key, entry))
                if entry.writer == me:
                    self._release(entry.slab, entry.slot)
                else:
                    self.index.tails[me].foreign_dels.append((key, entry))
            if records:
                data = b"".join(records)
                os.write(self._log_fd, data)
                self._published(me)
                self.index.tails[me].offset += len(data)
                self.index.applied += len(records)
                self._maybe_compact(me)
            return found

    def _maybe_compact(self, me: int) -> None:
        """Compact the own log when mostly dead; else a background checkpoint when due."""
        tail = self.index.tails[me]
        live = (len(self._clock) + len(tail.foreign_dels)) * (RECORD.size + 80)
        if tail.offset > COMPACT_MIN_BYTES and tail.offset > 3 * live:
            if not self.compacting() and not self._compact_later(me, tail):
                self._compact_locked()
        elif self.index.checkpoints.due():
            self.index.checkpoints.save_later()

    def compacting(self) -> bool:
        """A background compaction of this writer's log is running."""
        thread = self._compactor
        return thread is not None and thread.is_alive()

    def wait_compaction(self, timeout: float | None = None) -> None:
        """Wait for a background compaction (at most ``timeout`` s); not under the store's lock."""
        thread = self._compactor
        if thread is not None:
            thread.join(timeout)

    def compact(self) -> None:
        """Rewrite this writer's log now, on this thread, with only what is live: a PUT per
        own page, the DELs of other writers' slots no newer PUT superseded, and a GEN
        record; then start an index checkpoint. :class:`OSError` leaves the log as it was."""
        self.wait_compaction()
        with self._lock:
            self._compact_locked()

    def _compact_locked(self) -> None:
        """:meth:`compact`, the whole log judged here; caller holds the lock."""
        me = self.me
        if me is None or self._closed:
            return
        tail = self.index.tails[me]
        job = self._compaction_start(me, tail, fork=False)
        assert job is not None
        try:
            job.write(self._live_puts(me, os.pread(tail.fd, tail.offset, 0)))
        except BaseException:
            job.abandon()
            raise
        self._install(job, tail)

    def _kept_dels(self, dels: Sequence[tuple[str, Entry]]) -> list[tuple[str, Entry]]:
        """The DELs in ``dels`` no newer PUT superseded. Caller holds the lock."""
        table, kept = self.index.table, []
        for key, gone in dels:
            holder = table.at((gone.writer, gone.slab, gone.slot))
            now = table.get(holder) if holder is not None else None
            if now is None or now.gen <= gone.gen:
                kept.append((key, gone))
        return kept

    def _compacted(self, me: int, size: int, dels: list[tuple[str, Entry]],
                   forget: dict[bytes, Entry]) -> None:
        """Go on with the log just renamed into place (``size`` bytes, holding the foreign
        DELs ``dels``): reopen it, drop the unlogged own pages ``forget`` it no longer
        holds, start a checkpoint. Caller holds the lock."""
        tail = self.index.tails[me]
        fd = open_file(tail.path, os.O_RDWR | os.O_APPEND)  # first: a failed open keeps the old fd
        os.close(self._log_fd)
        self._log_fd = fd
        tail.reopen()
        tail.offset = size
        tail.foreign_dels = dels
        tail.max_gen = max(tail.max_gen, self._next_gen - 1)  # its GEN record
        self.index.forget_unlogged_entries(forget)
        self.compactions += 1
        self._published(me)
        self.index.checkpoints.save_later()

    def _compact_later(self, me: int, tail: LogTail) -> bool:
        """Start a background compaction; False where the fork cannot be made. Caller holds the lock."""
        job = self._compaction_start(me, tail)
        if job is None:
            return False
        self._compactor = threading.Thread(target=self._compact_off_lock, args=(job,),
                                           name="hicache-log-compact", daemon=True)
        self._compactor.start()
        return True

    def _compaction_start(self, me: int, tail: LogTail, fork: bool = True) -> LogCompaction | None:
        """Step 1 of a compaction (:meth:`LogCompaction.start`). Caller holds the lock."""
        table = self.index.table
        return LogCompaction.start(table, me, tail.path, tail.ino, tail.offset, len(tail.foreign_dels),
                                   table.count(me), self._log_fd, self.index.unlogged_of(me), fork)

    def _compact_off_lock(self, job: LogCompaction) -> None:
        """The background thread of :meth:`_compact_later`: steps 2 and 3."""
        try:
            built = job.build()
            tail = self.index.tails.get(job.writer)
            if built and tail is not None and tail.ino == job.ino:
                job.catch_up(tail.offset)  # what was logged meanwhile, still off the lock
        except Exception as exc:  # (the thread's end: nothing else would see it)
            job.abandon()
            log.warning("%s: log compaction failed (%s): the log stays as it is", job.path, exc)
            return
        with self._lock:
            self._compaction_finish(job, built)

    def _may_rewrite_log(self) -> bool:
        """This process may still replace its log. Caller holds the lock."""
        return True

    def _compaction_finish(self, job: LogCompaction, built: bool) -> None:
        """Step 3: the new log in place, or nothing where the store closed, changed writer
        or compacted meanwhile; where step 2 could not judge the log (``built`` False),
        :meth:`_compact_locked`. Caller holds the lock."""
        me = job.writer
        tail = self.index.tails.get(me)
        if self._closed or self.me != me or tail is None or tail.ino != job.ino \
                or not self._may_rewrite_log():
            job.abandon()
            return
        if not built or job.tmp_fd < 0:  # (< 0: its catch-up failed)
            job.abandon()
            if not built:
                self._compact_locked()
            return
        try:
            self._install(job, tail)
        except OSError as exc:
            log.warning("%s: log compaction not finished (%s): the log stays as it is", job.path, exc)

    def _install(self, job: LogCompaction, tail: LogTail) -> None:
        """Step 3's end: the DELs still needed and a GEN record appended, the file renamed
        over the log, the store going on with it. Caller holds the lock."""
        kept = self._kept_dels(tail.foreign_dels[: job.dels])
        dels = b"".join([encode_record(DEL, key, gone) for key, gone in kept])
        gen = encode_record(GEN, "", Entry(job.writer, 0, 0, self._next_gen - 1, 0, 0))  # the highest used
        size = job.finish(tail.ino, tail.offset, dels, gen, self.fsync != "none")
        self._compacted(job.writer, size, tail.foreign_dels[job.dels :] + kept, job.forget)  # log order

    def _live_puts(self, me: int, old_log: bytes) -> bytes:
        """The live PUT records of ``old_log`` (this writer's): in C for a log with no
        damage, else decoded here, own pages without a record dropped. Caller holds the lock."""
        table = self.index.table
        own = table.count(me)
        spans = live_put_spans(table, old_log, own)
        if spans is not None and len(spans) == own:
            return b"".join([old_log[start:end] for start, end in spans])
        live = self.index.live_puts(old_log, me)
        if len(live) < own:  # own pages whose PUT the old log lost (damage)
            self._forget_unrecorded({d for d, _, _ in live})
        return b"".join([encode_record(PUT, key, e) for _, key, e in live])

    def _forget_unrecorded(self, recorded: set[bytes]) -> None:
        """Drop own pages whose PUT record the compacted log lacks. Caller holds the lock."""
        lost = [(d, e) for d, e in self.index.table.select(self.me) if d not in recorded]
        for d, e in lost:
            self.index.table.pop(d)
            self._release(e.slab, e.slot)
        log.warning("%s: %d own pages whose index records were lost are dropped at compaction",
                    self.writers_dir, len(lost))

    def clear(self) -> int:
        """Delete every key of this namespace known now; returns how many."""
        self.refresh()
        with self._lock:
            keys = self.index.live_keys()
        return sum(self.delete(keys))

    # ---- owning a writer directory ------------------------------------------------------
    def _become_writer(self) -> int:
        """This process's writer number, adopting or creating a writer directory first."""
        if self.me is not None:
            return self.me
        with self._lock:
            if self.me is not None:
                return self.me
            self.refresh()
            return ownership.own_first(self.writers_dir, self._try_own)

    def _try_own(self, writer: int) -> bool:
        """Adopt writer directory ``writer`` if its lock is free: read its log, set a torn
        tail aside, rebuild the recency and free lists from its entries and slab files."""
        fds = ownership.open_writer(self.writers_dir / writer_name(writer), self._lock_writer)
        if fds is None:
            return False
        self._lock_fd, self._log_fd = fds
        index, logs = self.index, self.index.logs
        tail = logs.tail_of(writer)
        if os.stat(tail.path).st_ino != tail.ino:  # replaced since we last looked
            index.forget_writer(writer)
            tail.reopen()
        size = os.fstat(tail.fd).st_size
        if size > tail.offset:
            logs.read_tail(writer, tail, size)
        if os.fstat(self._log_fd).st_size > tail.offset:
            ownership.set_aside_tail(self._log_fd, tail.path, tail.offset)
        self.me = index.own = self.files.owner = writer
        self._published(writer)  # its log opened (created), a torn tail set aside
        # read-only descriptors cached before: threads may still read through them
        self.files.retire_writer(writer)
        self._next_gen = tail.max_gen + 1
        owned = sorted((e.gen, e.slab, e.slot) for _, e in index.table.select(writer))
        sizes: list[int] = []  # slots of each slab file found
        while True:
            path = self.files.path(writer, self._n_slabs)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                break
            if not stat.S_ISREG(st.st_mode):  # planted: removed from our own directory
                log.warning("%s is not a regular file: removed, the slab is made anew", path)
                os.unlink(path)
                break
            self._n_slabs += 1
            sizes.append(self.geometry.slots_in(st.st_size))
        # pages in slabs that are gone (missing, or a planted link removed) are gone too
        gone = [(d, e) for d, e in index.table.select(writer) if e.slab >= self._n_slabs]
        for d, entry in gone:
            index.drop(d, entry)
        live = [(slab, slot) for _, slab, slot in owned if slab < self._n_slabs]
        # as wide as the widest slab found (an earlier run may have used bigger slabs)
        stride = max([self.slots_per_slab, *sizes, *(slot + 1 for _, slot in live)])
        clock = self._clock = self._new_clock(stride)
        clock.grow(self._n_slabs)
        clock.add(live)
        if live:  # the hand starts past the newest page: the oldest pages go first
            clock.start_past(live)
        for slab, slots in enumerate(sizes):
            self._free.extend((slab, s) for s in reversed(range(slots)) if (slab, s) not in clock)
        return True

    # ---- lifecycle ----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("slab store is closed")

    def stats(self) -> dict[str, Any]:
        """Counts of indexed pages, own slots, free slots and evictions."""
        with self._lock:
            return {
                "indexed_pages": len(self.index.table),
                "writer": self.me,
                "own_pages": len(self._clock),
                "lru_bytes": self._clock.nbytes,
                "free_slots": len(self._free),
                "slabs": self._n_slabs,
                "max_slots": self.max_slots,
                "evictions": self.evictions,
                "log_compactions": self.compactions,
                "writers_seen": len(self.index.tails),
                "index_checkpoint_pages": self.index.checkpoints.pages,
                "index_replayed_records": self.index.replayed,
                **self.index.checkpoints.memory(),
            }

    def close(self) -> None:
        """Write an index checkpoint when due, close every file descriptor and release the
        writer directory (a background compaction ends first). Idempotent."""
        self.wait_compaction()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            index = self.index
            if (self.me is not None and index.applied) or index.checkpoints.due():
                index.checkpoints.save()  # waits for a background one first
            else:
                index.checkpoints.wait()
            fds = [t.fd for t in self.index.tails.values()]
            fds += [fd for fd in (self._log_fd, self._lock_fd) if fd >= 0]
            self.index.tails.clear()
            self.files.close()
            if index.logs.changes is not None:
                index.logs.changes.close()
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
