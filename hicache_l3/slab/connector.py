"""The slab connector helper: set / get / exists / delete / clear written once for every
connector keeping pages in the slab store (file, nixl file mode, hf3fs). The connectors
differ in their settings, their store and their :attr:`SlabConnector.transport`. A page
that fails its checks is a miss and is dropped from the index (on a store shared across
nodes, only after it has failed for :data:`SUSPECT_S` seconds).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, cast

from hicache_l3.common.compression import PageCodec
from hicache_l3.common.connector import Capabilities
from hicache_l3.common.errors import ConfigError, Reason
from hicache_l3.common.filesystems import Mount, mount_of
from hicache_l3.common.keys import Namespace
from hicache_l3.common.pages import Page
from hicache_l3.common.parallel import BatchPool
from hicache_l3.common.safe_fs import private_root
from hicache_l3.slab.format import Entry, Located, Slot, namespace_dir, read_namespace_file
from hicache_l3.slab.frames import FrameBuffers, frame_align, is_frame_length, read_frames, write_frames
from hicache_l3.slab.fresh import reread
from hicache_l3.slab.io import (
    CHECKSUM,
    FAILED,
    HEADER,
    OK,
    SHORT,
    UNREGISTERED,
    ReadBatch,
    SlotTransport,
    WriteBatch,
    explain,
)
from hicache_l3.slab.plan import SIZE, UNVERIFIED, GetPlan
from hicache_l3.slab.store import SlabStore

_CORRUPT = (SHORT, HEADER, CHECKSUM)

SUSPECT_S = 60.0  # shared across nodes: how long a page may fail its checks before it is dropped
_SUSPECTS_MAX = 1 << 16  # pages tracked at once (beyond: the tracking starts again)
FRESH_THREADS = 8  # re-reads past the page cache in flight at once (each waits on the network)
FRAME_THREADS = 16  # frames read at once (each read waits on the device)
FRAME_BUFFER = 16 << 20  # bytes of frames a get reads per pass (two buffers: one read, one decoded)


class SlabConnector:
    """Mixin placed before :class:`~hicache_l3.common.connector.Connector` in the bases:
    the page hooks, capabilities and stats of a slab-backed connector. The connector sets
    :attr:`transport` and :attr:`checksum_writes`, then calls :meth:`_init_slab_root` after
    ``Connector.__init__``."""

    config: Any  # root, capacity_bytes, multi_node, compression, slab_bytes, fsync
    namespace: Namespace
    page_bytes: int | None
    name: ClassVar[str]
    transport: SlotTransport
    checksum_writes: bool = False  # write an XXH3 of each page into its marker record
    multi_node = False  # other nodes may mount the root
    quarantined_slots = 0  # slots an abandoned transfer may still write: never reused
    metrics: Any
    regions: Any
    mount: Mount
    _log: Any

    if TYPE_CHECKING:
        def _learn_page_bytes(self, nbytes: int) -> int: ...  # Connector's

    def _init_slab_root(self) -> None:
        """Create the ``root`` setting's directory private (0700) or check an existing one;
        ``capacity_bytes`` 0 means half the filesystem's free space; ``multi_node`` (``auto``,
        ``true``, ``false``): whether other nodes may mount it; ``compression``: pages stored
        as frames where shorter. On failure :meth:`_close` releases what was opened."""
        config = self.config
        self._pools: dict[str, BatchPool] = {}
        self._store: SlabStore | None = None
        try:
            self._codec = PageCodec(config.compression, self.namespace.kv_dtype)
            self._frame_buffers = FrameBuffers(FRAME_BUFFER)
            self.root = private_root(config.root, f"{self.name} connector: root")
            if not os.access(self.root, os.W_OK | os.X_OK):
                raise ConfigError(f"{self.name} connector: root {self.root} is not writable")
            self.mount = mount_of(self.root)
            multi_node = config.multi_node
            self.multi_node = self.mount.shared_across_nodes if multi_node == "auto" else multi_node == "true"
            self._check_multi_node(multi_node)
            self._suspects: dict[tuple[str, Entry], float] = {}
            self._suspects_lock = threading.Lock()
            self.capacity_bytes = config.capacity_bytes or shutil.disk_usage(self.root).free // 2
            self._store_lock = threading.Lock()
            if self.page_bytes is None:
                self.page_bytes = read_namespace_file(self._ns_dir()).get("slot_bytes")
            if self.page_bytes is not None:
                self._open_store(self.page_bytes)
        except BaseException:
            self._close()
            raise

    def _check_multi_node(self, setting: str) -> None:
        """Refuse unchecked pages on a store other nodes share; warn when the user says no
        other node mounts a filesystem that others could."""
        if self.checksum_writes:
            return
        where = f"{self.root} ({self.mount.fstype}, mounted at {self.mount.point})"
        if self.multi_node:
            raise ConfigError(
                f"{self.name} connector: checksum=none on a root other nodes may mount: {where}, "
                f"multi_node={setting}. Each node caches the slab files on its own, so a page "
                "another node rewrote can read back as this node's cached old bytes under the new "
                "marker; only a checksum tells them apart. Keep checksum=xxh3 (the default), or "
                "set multi_node=false if no other node ever mounts this root")
        if self.mount.shared_across_nodes:
            self._log.warning(
                "unchecked", "%s: checksum=none and multi_node=false on %s: pages are not checked "
                "end to end (a bit flipped at rest reads back as the page), and if another node "
                "ever writes this store, this node's page cache can return old bytes as a new page",
                self.name, where)

    def _ns_dir(self) -> Path:
        return namespace_dir(self.root, self.namespace)

    def _make_store(self, slot_bytes: int) -> SlabStore:
        """This connector's store of ``slot_bytes`` pages (override for another kind)."""
        config = self.config
        return SlabStore(self.root, self.namespace, slot_bytes, capacity_bytes=self.capacity_bytes,
                         slab_bytes=config.slab_bytes, fsync=config.fsync)

    @property
    def capabilities(self) -> Capabilities:
        """Persistent, shared across processes, evicting, compressing; detects corruption
        where pages carry checksums."""
        return Capabilities(persistent=True, shared_across_processes=True,
                            detects_corruption=self.checksum_writes, evicts=True, compresses=True)

    def _store_opened(self, store: SlabStore) -> None:
        """Called once the store is made, before any page moves (override to choose by
        the page size)."""

    def _open_store(self, slot_bytes: int) -> SlabStore:
        with self._store_lock:
            if self._store is None:
                self._store = self._make_store(slot_bytes)
                self._store_opened(self._store)
            return self._store

    def _existing_store(self) -> SlabStore | None:
        """The store, opened now if another process created the namespace meanwhile."""
        if self._store is None:
            slot_bytes = read_namespace_file(self._ns_dir()).get("slot_bytes")
            if slot_bytes is None and self.page_bytes is not None and (
                    self._ns_dir() / "writers").is_dir():
                slot_bytes = self.page_bytes  # namespace.json lost or damaged: opening rebuilds it
            if slot_bytes is None or self.page_bytes not in (None, slot_bytes):
                return None
            self._learn_page_bytes(slot_bytes)
            return self._open_store(slot_bytes)
        return self._store

    def _store_for_io(self) -> SlabStore:
        """The store for a transfer (the base class has learned the page size by now)."""
        store = self._store
        if store is None:
            assert self.page_bytes is not None
            store = self._open_store(self.page_bytes)
        return store

    # ---- the page hooks -----------------------------------------------------------------
    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        store = self._store_for_io()
        reasons = [Reason.OK] * len(keys)
        todo, slots, full, ds = store.reserve_new(keys)
        for i in full:
            reasons[i] = Reason.NO_SPACE
        if todo and self._codec.enabled:
            todo, slots, ds = self._set_frames(store, keys, pages, reasons, todo, slots, ds)
        if not todo:
            return reasons
        everything = len(todo) == len(keys)  # (todo: increasing indices, so then all of them)
        batch = WriteBatch(keys if everything else [keys[i] for i in todo],
                           pages if everything else [pages[i] for i in todo], slots,
                           store.geometry, self.checksum_writes)
        held = batch.held
        try:
            self.transport.write(store, batch)
        except BaseException:  # interrupted: give back every slot no transfer may still write
            self.quarantined_slots += len(held)
            store.abort([s for j, s in enumerate(slots) if j not in held])
            raise
        status = batch.status
        if status.count(OK) == len(todo):
            store.commit(batch.keys, slots, batch.checksums, ds)
            return reasons
        done, failed = [], []
        for j, i in enumerate(todo):
            code = status[j]
            if code == OK:
                done.append(j)
                continue
            reasons[i] = self._write_failed(keys[i], code, batch.reasons.get(j, Reason.ENGINE_ERROR))
            if j in held:
                self.quarantined_slots += 1
            else:
                failed.append(slots[j])
        store.commit([batch.keys[j] for j in done], [slots[j] for j in done],
                     [batch.checksums[j] for j in done], [ds[j] for j in done])
        store.abort(failed)
        return reasons

    def _set_frames(self, store: SlabStore, keys: list[str], pages: list[Page], reasons: list[Reason],
                    todo: list[int], slots: Sequence[Slot], ds: Sequence[bytes],
                    ) -> tuple[list[int], Sequence[Slot], Sequence[bytes]]:
        """Store as frames (:mod:`hicache_l3.slab.frames`) the pages of ``todo`` that
        compress, each encoded and written on the codec threads; the rest (``todo``,
        ``slots`` and ``ds`` narrowed to them) is for the transport. A page outside
        registered memory is UNREGISTERED here."""
        geometry, checksum, codec = store.geometry, self.checksum_writes, self._codec
        align, views_of = frame_align(geometry.slot_bytes), self.regions.views

        def encode(lo: int, hi: int) -> list[tuple[int | None, int, int]]:
            """Per page: the frame write's status (UNREGISTERED outside registered memory),
            its length and checksum; None: stored whole (no shorter frame)."""
            out: list[tuple[int | None, int, int]] = []
            for j in range(lo, hi):
                views = views_of(pages[todo[j]])
                frame = None if views is None else codec.encode(views, align)
                if frame is None:
                    out.append((None if views is not None else UNREGISTERED, 0, 0))
                    continue
                status, sums = write_frames(geometry, [keys[todo[j]]], [frame], [slots[j]], checksum)
                out.append((status[0], len(frame), sums[0]))
            return out

        try:
            done = [f for share in self._pool("codec").map(encode, len(todo)) for f in share]
        except BaseException:  # interrupted: no share runs any more, nothing was committed
            store.abort(slots)
            raise
        ok = [j for j, (code, _, _) in enumerate(done) if code == OK]
        if not ok and all(code is None for code, _, _ in done):
            return todo, slots, ds
        store.commit([keys[todo[j]] for j in ok], [slots[j] for j in ok], [done[j][2] for j in ok],
                     [ds[j] for j in ok], lengths=[done[j][1] for j in ok])
        failed = []
        for j, (code, _, _) in enumerate(done):
            if code is not None and code != OK:
                failed.append(slots[j])
                reasons[todo[j]] = self._write_failed(keys[todo[j]], code)
        store.abort(failed)
        self.metrics.count("frames_written", len(ok))
        self.metrics.count("frame_bytes_written", sum(done[j][1] for j in ok))
        rest = [j for j, (code, _, _) in enumerate(done) if code is None]
        return [todo[j] for j in rest], [slots[j] for j in rest], [ds[j] for j in rest]

    def _pool(self, use: str) -> BatchPool:
        """Threads made on first use: ``frames`` read frames (each waits on the device),
        ``codec`` encode and decode them (one per core), ``fresh`` read pages again past the
        page cache (each waits on the network; only a store that ever re-reads has them)."""
        with self._suspects_lock:
            pool = self._pools.get(use)
            if pool is None:
                if use == "fresh":
                    pool = BatchPool(FRESH_THREADS, "hicache-fresh")
                else:
                    threads = FRAME_THREADS if use == "frames" else len(os.sched_getaffinity(0))
                    pool = BatchPool(threads, f"hicache-{use}", min_share=1)
                self._pools[use] = pool
            return pool

    def _write_failed(self, key: str, code: int, failed: Reason = Reason.ENGINE_ERROR) -> Reason:
        """The Reason of ``key``'s page whose write ended in status ``code`` (``failed``:
        the transport's Reason of a FAILED one), logged."""
        self._log.warning("set-io", "%s: write of %s failed: %s", self.name, key,
                          failed.value if code == FAILED else explain(code))
        if code == -errno.ENOSPC:
            return Reason.NO_SPACE
        if code == UNREGISTERED:
            return Reason.UNREGISTERED
        return failed if code == FAILED else Reason.ENGINE_ERROR

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        store = self._existing_store()
        if store is None:
            return [Reason.MISS] * len(keys)
        if self.transport.reads_plans:
            plan = store.plan_get(keys, self.checksum_writes, self.transport.plans_direct)
            if plan is not None:
                return self._get_planned(store, keys, pages, plan)
        return self._get_located(store, keys, pages)

    def _get_planned(self, store: SlabStore, keys: list[str], pages: list[Page],
                     plan: GetPlan) -> list[Reason]:
        """:meth:`_get` from a :class:`~hicache_l3.slab.plan.GetPlan`: the same Reasons,
        invalidations and touches as :meth:`_get_located`."""
        n, count = len(keys), plan.count
        reasons: list[Reason] | None = None
        if count != n:  # misses, frames, size mismatches, unverified pages: settled before the read
            reasons = [Reason.MISS] * n
            frames: list[tuple[int, Entry]] = []
            for i, code in enumerate(plan.code):
                if code in (SIZE, UNVERIFIED):
                    self._sort_unread(store, keys[i], plan.entry(i), i, reasons, frames)
            if frames:
                self._get_frames(store, keys, pages, reasons, frames)
            if not count:
                return reasons
        failed: dict[int, Reason] = {}  # the Reason of a page left FAILED (a NIXL timeout)
        status = self.transport.read_plan(plan, pages if count == n else [pages[i] for i in plan.where],
                                          failed)
        if status.count(OK) == count:
            store.touch_columns(*plan.own_columns(store.me))
            if reasons is None:  # the common batch: every key read and verified
                return [Reason.OK] * n
            for i in plan.where:
                reasons[i] = Reason.OK
            return reasons
        if reasons is None:
            reasons = [Reason.MISS] * n
        self._settle_reads(store, keys, pages, reasons, ((i, plan.entry(i)) for i in plan.where), status,
                           failed)
        return reasons

    def _get_located(self, store: SlabStore, keys: list[str], pages: list[Page]) -> list[Reason]:
        """:meth:`_get` through :meth:`SlabStore.lookup` and a :class:`ReadBatch` (transports
        that do not read plans)."""
        found = store.lookup(keys)
        reasons = [Reason.MISS] * len(keys)
        nbytes = store.geometry.slot_bytes  # == page_bytes: the base class checked every page
        verified_only = self.checksum_writes  # detects_corruption: True only for checked pages
        work: list[int] = []
        located: list[Located] = []
        frames: list[tuple[int, Entry]] = []
        if None not in found:  # the common batch: every key found, checked in C-speed passes
            every = cast("list[Located]", found)
            entries = [loc[1] for loc in every]
            if {e[4] for e in entries} == {nbytes} and (not verified_only or all(e[5] for e in entries)):
                work, located = list(range(len(keys))), every
        for i, loc in enumerate(found if not work else ()):
            if loc is None:
                continue
            if loc.entry.length == nbytes and (not verified_only or loc.entry.checksum):
                work.append(i)
                located.append(loc)
            else:
                self._sort_unread(store, keys[i], loc.entry, i, reasons, frames)
        if frames:
            self._get_frames(store, keys, pages, reasons, frames)
        if not work:
            return reasons
        everything = len(work) == len(keys)
        batch = ReadBatch(keys if everything else [keys[i] for i in work],
                          pages if everything else [pages[i] for i in work], located, store.geometry)
        self.transport.read(store, batch)
        status, me = batch.status, store.me
        if everything and status.count(OK) == len(keys):  # the common batch: all read and verified
            store.touch([(e[1], e[2]) for _, e in located if e[0] == me])
            return [Reason.OK] * len(keys)
        self._settle_reads(store, keys, pages, reasons, ((i, loc.entry) for i, loc in zip(work, located)),
                           status, batch.reasons)
        return reasons

    def _sort_unread(self, store: SlabStore, key: str, entry: Entry, i: int, reasons: list[Reason],
                     frames: list[tuple[int, Entry]]) -> None:
        """Key ``i``, not a checked whole slot: a size mismatch, unverified (under checksums,
        stored without one: dropped from this process's index so that a later set stores it
        again, checksummed) or a frame to read (appended to ``frames``)."""
        slot_bytes = store.geometry.slot_bytes
        if entry.length != slot_bytes and not is_frame_length(entry.length, slot_bytes):
            reasons[i] = Reason.SIZE_MISMATCH
        elif self.checksum_writes and not entry.checksum:
            reasons[i] = Reason.UNVERIFIED
            store.invalidate(key, entry)
        else:
            frames.append((i, entry))

    def _get_frames(self, store: SlabStore, keys: list[str], pages: list[Page], reasons: list[Reason],
                    frames: list[tuple[int, Entry]]) -> None:
        """Read, check and decode the frames ``(key index, entry)`` into their pages; their
        Reasons as :meth:`_settle_reads` gives them."""
        fkeys = [keys[i] for i, _ in frames]
        entries = [e for _, e in frames]
        views = [self.regions.views(pages[i]) for i, _ in frames]
        status = read_frames(store.geometry, store.fd, fkeys, entries, views, self.multi_node,
                             self._pool("frames"), self._pool("codec"), self._frame_buffers)
        self.metrics.count("frames_read", status.count(OK))
        self._settle_reads(store, keys, pages, reasons, frames, status, {}, reread=False)

    def _settle_reads(self, store: SlabStore, keys: list[str], pages: list[Page], reasons: list[Reason],
                      read: Iterable[tuple[int, Entry]], status: Sequence[int],
                      failed: dict[int, Reason], reread: bool = True) -> None:
        """The Reason of each page read (``read``: the key's index and its entry, in the order
        of ``status``): OK (own pages touched), corrupt (the key dropped from the index, see
        :meth:`_still_suspect`), unregistered, the transport's Reason of a page left FAILED
        (``failed``), engine_error otherwise (logged). ``reread``: pages that failed their
        checks are read again past the page cache first where :attr:`multi_node`."""
        read = list(read)
        again: dict[int, int] = {}
        if self.multi_node and reread:
            again = self._read_fresh(store, keys, pages, read, status)
        hits, me = [], store.me
        for j, (i, entry) in enumerate(read):
            code = again.get(j, status[j])
            if code == OK:
                reasons[i] = Reason.OK
                if entry.writer == me:
                    hits.append((entry.slab, entry.slot))
                if self._suspects:
                    with self._suspects_lock:
                        self._suspects.pop((keys[i], entry), None)
            elif code in _CORRUPT:
                reasons[i] = Reason.CORRUPT
                if not self._still_suspect(keys[i], entry):
                    store.invalidate(keys[i], entry)
            elif code == UNREGISTERED:
                reasons[i] = Reason.UNREGISTERED
            else:
                reasons[i] = failed.get(j, Reason.ENGINE_ERROR) if code == FAILED else Reason.ENGINE_ERROR
                self._log.warning("get-io", "%s: read of %s failed: %s", self.name, keys[i],
                                  reasons[i].value if code == FAILED else explain(code))
        store.touch(hits)

    def _read_fresh(self, store: SlabStore, keys: list[str], pages: list[Page],
                    read: list[tuple[int, Entry]], status: Sequence[int]) -> dict[int, int]:
        """The pages of ``read`` whose checks failed, read again past this node's page cache
        (:func:`~hicache_l3.slab.fresh.reread`): their new status by position."""
        failed = [j for j, code in enumerate(status) if code in _CORRUPT]
        if not failed:
            return {}
        entries = [read[j][1] for j in failed]
        fkeys, fpages = [keys[read[j][0]] for j in failed], [pages[read[j][0]] for j in failed]
        shares = self._pool("fresh").map(
            lambda lo, hi: reread(store.geometry, store.fd, self.regions.views, fkeys[lo:hi], fpages[lo:hi],
                                  entries[lo:hi]), len(failed))
        codes = [code for share in shares for code in share]
        self.metrics.count("fresh_rereads", len(failed))
        self.metrics.count("fresh_reread_hits", codes.count(OK))
        return dict(zip(failed, codes))

    def _still_suspect(self, key: str, entry: Entry) -> bool:
        """Whether a page that failed its checks (read again past the page cache) stays in
        the index: on a store shared across nodes, until it has failed for :data:`SUSPECT_S`."""
        if not self.multi_node:
            return False
        now = time.monotonic()
        with self._suspects_lock:
            if len(self._suspects) >= _SUSPECTS_MAX:
                self._suspects.clear()
            first = self._suspects.setdefault((key, entry), now)
            if now - first < SUSPECT_S:
                return True
            del self._suspects[(key, entry)]
            return False

    def _exists(self, keys: list[str]) -> list[Reason]:
        store = self._existing_store()
        return _hits(keys, None if store is None else store.contains(keys))

    def _delete(self, keys: list[str]) -> list[Reason]:
        store = self._existing_store()
        return _hits(keys, None if store is None else store.delete(keys))

    def _clear(self) -> None:
        store = self._existing_store()
        if store is not None:
            store.clear()

    def _close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
        self.transport.close()
        if self._store is not None:
            self._store.close()

    def _engine_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"root": str(self.root), "capacity_bytes": self.capacity_bytes,
                               "io_path": self.transport.name,
                               "quarantined_slots": self.quarantined_slots, **self.transport.stats()}
        if self._store is not None:
            out.update(self._store.stats())
        return out


def _hits(keys: list[str], hits: Sequence[bool] | None) -> list[Reason]:
    """OK for each key found, MISS for the others (all of them without a store)."""
    return [Reason.MISS] * len(keys) if hits is None else [Reason.OK if hit else Reason.MISS for hit in hits]
