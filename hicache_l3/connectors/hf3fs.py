"""The 3FS connector (``hf3fs``, alias ``3fs``): pages in preallocated slab files on a 3FS
mount, shared by every node that mounts it (index: :class:`~hicache_l3.slab.shared.SharedSlabStore`,
up to ``max_writers`` writers of ``capacity_bytes / max_writers`` each). Bytes move by the file
connector's slab I/O, or with ``usrbio`` (``auto`` where ``hf3fs_fuse.io`` imports and root is
on a 3FS mount; ``on`` requires it) through 3FS's USRBIO rings: zero-copy for pages in a
registered :class:`SharedHostBuffer`, through a staging iovec for others. Both paths use the
same on-disk format. A USRBIO write waits for a slot's marker record before submitting its
data, a read for its data before its marker record, so the torn-slot argument
(:mod:`hicache_l3.slab.format`) holds; a batch's ring rounds overlap (:class:`UsrbioTransport`),
and a round that times out abandons its ring.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import dataclasses
import datetime
import errno
import functools
import importlib
import mmap
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from multiprocessing import shared_memory
from typing import Any, Literal

from hicache_l3.common.config import setting
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, Reason
from hicache_l3.common.integrity import key_fingerprint, page_checksum
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import MemoryRegion
from hicache_l3.common.pages import Page
from hicache_l3.connectors.file import FileConfig, FileConnector
from hicache_l3.slab.format import RECORD_BYTES, encode_marker
from hicache_l3.slab.io import OK, ReadBatch, SlotTransport, WriteBatch, verify
from hicache_l3.slab.shared import SharedSlabStore
from hicache_l3.slab.store import SlabStore


@dataclasses.dataclass
class Hf3fsConfig(FileConfig):
    """Settings of the 3FS connector (``HICACHE_L3_HF3FS_<FIELD>`` in the environment).

    ``root`` is a directory on the 3FS mount (any directory in POSIX-mount mode);
    ``capacity_bytes`` is the namespace's total there, shared by ``max_writers``.
    """

    max_writers: int = setting(8, "writer processes per namespace (each gets capacity/max_writers)")
    lease_s: float = setting(
        60.0, "writer lease: another node adopts a silent writer's slabs after this long; "
        "must exceed the FUSE attribute cache timeout plus 5 s (3FS length reports)",
    )
    rescan_s: float = setting(2.0, "how often to rescan for writers that other nodes added")
    node_id: str = setting("", "this node's identity (default: host name, boot id, PID namespace)")
    node_locks: bool = setting(True, "also flock writer directories (per node on FUSE)")
    usrbio: Literal["auto", "on", "off"] = setting("auto", "use 3FS USRBIO rings when available")
    usrbio_module: str = setting("hf3fs_fuse.io", "module providing the USRBIO API")
    usrbio_entries: int = setting(128, "USRBIO ring entries (I/Os in flight at once)")
    usrbio_staging_bytes: int = setting(
        64 << 20, "shared memory per direction for pages outside registered shared memory",
        size=True,
    )
    usrbio_timeout_s: float = setting(30.0, "bound on one USRBIO ring wait")

    def validate(self) -> None:
        """Check values that types alone cannot."""
        if not self.root or "://" in self.root:
            raise ConfigError(
                "hf3fs connector: set root to a directory on the 3FS mount "
                f"(e.g. root=/3fs/stage/hicache), got {self.root!r}"
            )
        super().validate()
        if self.max_writers < 1:
            raise ConfigError(f"hf3fs: max_writers must be >= 1, got {self.max_writers}")
        if self.lease_s <= 0 or self.rescan_s < 0:
            raise ConfigError(f"hf3fs: lease_s must be > 0 and rescan_s >= 0, got "
                              f"{self.lease_s}, {self.rescan_s}")
        if self.usrbio_entries < 4:
            raise ConfigError(f"hf3fs: usrbio_entries must be >= 4, got {self.usrbio_entries}")
        if self.usrbio_timeout_s <= 0:
            raise ConfigError(f"hf3fs: usrbio_timeout_s must be > 0, got {self.usrbio_timeout_s}")


class SharedHostBuffer(MemoryRegion):
    """Host memory in POSIX shared memory (``/dev/shm``): registered with an hf3fs
    connector in USRBIO mode, its pages move zero-copy. Freed by :meth:`close` or GC."""

    def __init__(self, size: int, name: str = "") -> None:
        shm = shared_memory.SharedMemory(create=True, size=(size + mmap.PAGESIZE - 1)
                                         // mmap.PAGESIZE * mmap.PAGESIZE)
        super().__init__(_shm_address(shm), size, owner=shm, pinned=False, name=name)
        object.__setattr__(self, "_finalizer", weakref.finalize(self, _free_shm, shm))

    def close(self) -> None:
        """Unmap and unlink the shared memory (no page in it may be in use)."""
        self._finalizer()  # type: ignore[attr-defined]


def _shm_address(shm: shared_memory.SharedMemory) -> int:
    """The address where ``shm`` is mapped in this process."""
    assert shm.buf is not None
    return ctypes.addressof(ctypes.c_char.from_buffer(shm.buf))


def _free_shm(shm: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()
    with contextlib.suppress(BufferError):
        shm.close()


class _Scratch:
    """One direction's staging iovec: marker records, then staged page copies."""

    def __init__(self, io: Any, mount: str, entries: int, staging: int) -> None:
        self.markers = RECORD_BYTES * entries
        size = self.markers + staging
        self.shm = shared_memory.SharedMemory(create=True, size=size)
        try:
            self.iov = io.make_iovec(self.shm, mount)
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()  # mapped by us and by the daemon: the name is not needed
        assert self.shm.buf is not None
        self.view: memoryview = self.shm.buf
        self.staging = staging

    def free(self) -> None:
        """Drop the iovec and the shared memory."""
        self.iov = None
        _free_shm(self.shm)


class _Usrbio:
    """The USRBIO rings of one connector: fd registration, ring rounds, staging memory.

    One ring and one staging area per direction, each used by one batch at a time.
    """

    def __init__(self, io: Any, mount: str, entries: int, staging: int, timeout_s: float) -> None:
        self.io = io
        self.mount = mount
        self.entries = entries
        self.staging = staging
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.locks = {True: threading.Lock(), False: threading.Lock()}
        self._rings: dict[bool, Any] = {}
        self._scratch: dict[bool, _Scratch] = {}
        self._fds: set[int] = set()
        self._fd_lock = threading.Lock()
        self._helper: ThreadPoolExecutor | None = None

    def register_fd(self, fd: int) -> None:
        """Register a slab fd once (3FS refuses a second registration)."""
        if fd in self._fds:
            return
        with self._fd_lock:
            if fd not in self._fds:
                self.io.register_fd(fd)
                self._fds.add(fd)

    def scratch(self, read: bool, page_bytes: int) -> _Scratch:
        """This direction's staging iovec, room for at least one staged page (caller
        holds ``locks[read]``)."""
        self.staging = max(self.staging, page_bytes)
        s = self._scratch.get(read)
        if s is not None and s.staging < self.staging:
            self._abandon(read)
            s = None
        if s is None:
            s = self._scratch[read] = _Scratch(self.io, self.mount, self.entries, self.staging)
        return s

    def run(self, read: bool, ios: list[tuple[Any, int, int]],
            meanwhile: Callable[[], list[tuple[Any, int, int]]] | None = None) -> list[int]:
        """One ring round: ``ios`` (``(iov slice, fd, offset)`` each) submitted, then
        ``meanwhile()`` run while they are in flight and the I/Os it returns submitted too;
        results per I/O of both, in that order (bytes or ``-errno``). Caller holds
        ``locks[read]``; at most ``entries`` I/Os in all.

        On the main thread the round runs on a helper thread: an interrupt (which only the
        main thread receives) then cannot split prepare/submit/wait, and the round is let
        finish (within the ring timeout) before the interrupt reaches the caller, so no
        submitted I/O writes into the caller's pages after the raise.
        """
        if not ios and meanwhile is None:
            return []
        if threading.current_thread() is not threading.main_thread():
            return self._round(read, ios, meanwhile)
        if self._helper is None:
            self._helper = ThreadPoolExecutor(1, thread_name_prefix="hicache-usrbio")
        helper = self._helper
        try:
            return helper.submit(self._round, read, ios, meanwhile).result()
        except BaseException:
            # Interrupted (possibly inside submit, the round queued or not): the one helper
            # runs its work in order, so once a no-op queued now has run, so has the round.
            barrier = helper.submit(int)
            futures_wait([barrier], timeout=self.timeout.total_seconds() + 1)
            if not barrier.done():
                self._abandon(read)
            raise

    def _round(self, read: bool, ios: list[tuple[Any, int, int]],
               meanwhile: Callable[[], list[tuple[Any, int, int]]] | None) -> list[int]:
        ring = self._rings.get(read)
        if ring is None:
            ring = self._rings[read] = self.io.make_ioring(
                self.mount, self.entries, for_read=read, timeout=1, numa=-1
            )
        ios = list(ios)
        submitted = 0
        try:
            submitted = self._submit(ring, read, ios, 0)
            if meanwhile is not None:
                try:
                    ios += meanwhile()
                except BaseException:  # what is in flight lands before the raise
                    self._land(ring, submitted)
                    raise
                try:
                    submitted = self._submit(ring, read, ios, submitted)
                except OSError:
                    self._land(ring, submitted)
                    raise
            done = ring.wait(min_results=len(ios), timeout=self.timeout) if ios else []
        except OSError:
            self._abandon(read)
            if submitted == 0:
                raise
            # what was submitted may still complete: as a timeout (the slot held), not a failure
            return [-errno.ETIMEDOUT] * submitted + [-errno.EIO] * (len(ios) - submitted)
        except BaseException:  # late completions must not be reaped by a later round
            self._abandon(read)
            raise
        results = [-errno.ETIMEDOUT] * len(ios)
        for cqe in done:
            if 0 <= cqe.userdata < len(ios):
                results[cqe.userdata] = cqe.result
        if len(done) < len(ios):
            self._abandon(read)  # late completions must not reach reused memory
        return results

    @staticmethod
    def _submit(ring: Any, read: bool, ios: list[tuple[Any, int, int]], start: int) -> int:
        """Prepare ``ios[start:]`` (their index the userdata) and submit them; ``len(ios)``."""
        for n in range(start, len(ios)):
            iov, fd, off = ios[n]
            ring.prepare(iov, read, fd, off, n)
        if len(ios) > start:
            ring.submit()
        return len(ios)

    def _land(self, ring: Any, submitted: int) -> None:
        """Wait (within the ring timeout) for ``submitted`` I/Os in flight."""
        if submitted:
            with contextlib.suppress(OSError):
                ring.wait(min_results=submitted, timeout=self.timeout)

    def _abandon(self, read: bool) -> None:
        self._rings.pop(read, None)
        scratch = self._scratch.pop(read, None)
        if scratch is not None:
            scratch.iov = None  # the shared memory stays mapped until its last user is done

    def close(self) -> None:
        """Deregister fds (before they are closed) and free rings and staging memory."""
        if self._helper is not None:
            self._helper.shutdown(wait=True)
        with self._fd_lock:
            for fd in self._fds:
                with contextlib.suppress(OSError):
                    self.io.deregister_fd(fd)
            self._fds.clear()
        self._rings.clear()
        for s in self._scratch.values():
            s.free()
        self._scratch.clear()


@dataclasses.dataclass
class _Plan:
    """One page's part of a ring round."""

    index: int
    zero_copy: list[Any] | None  # iov slices over the page's segments, or None: staged
    stage: int = 0  # offset of the staged copy in the scratch iovec
    ok: bool = True
    held: bool = False  # an I/O of it timed out: it may still land


class UsrbioTransport(SlotTransport):
    """Slot bytes moved through 3FS USRBIO rings (module docstring), a batch in rounds
    whose data I/Os and marker records fit the ring. One ring wait takes a round's data with
    the next round's marker records (a write) or the previous round's (a read), so ``k``
    rounds wait ``k + 1`` times. Pages inside registered shared memory go zero-copy, others
    staged."""

    name = "3FS USRBIO rings"

    def __init__(self, rings: _Usrbio, regions: Any, metrics: Any, log: Any) -> None:
        self.rings, self.regions, self.metrics, self._log = rings, regions, metrics, log
        self._iov_starts: list[int] = []
        self._iovs: list[tuple[MemoryRegion, Any, int]] = []  # region, iovec, region offset
        self._iov_lock = threading.Lock()

    # ---- memory ---------------------------------------------------------------------
    def register(self, region: MemoryRegion) -> None:
        """Make an iovec over ``region`` when it lies in POSIX shared memory (zero-copy)."""
        if not isinstance(region.owner, shared_memory.SharedMemory):
            return  # pages in it are staged
        shm = region.owner
        iov = self.rings.io.make_iovec(shm, self.rings.mount)
        with self._iov_lock:
            i = bisect.bisect_right(self._iov_starts, region.address)
            self._iov_starts.insert(i, region.address)
            self._iovs.insert(i, (region, iov, region.address - _shm_address(shm)))

    def unregister(self, region: MemoryRegion) -> None:
        """Drop the iovec over ``region``, if any."""
        with self._iov_lock:
            for i, (r, _, _) in enumerate(self._iovs):
                if r is region or (r.address, r.size) == (region.address, region.size):
                    del self._iovs[i]
                    del self._iov_starts[i]
                    return

    def _iov_slices(self, page: Page) -> list[Any] | None:
        """iovec slices over every segment of ``page``, or None if any lies outside an
        iovec (the page is then staged)."""
        starts, iovs = self._iov_starts, self._iovs
        out = []
        for address, length in page:
            i = bisect.bisect_right(starts, address) - 1
            if i < 0:
                return None
            region, iov, shift = iovs[i]
            if address + length > region.end:
                return None
            off = address - region.address + shift
            out.append(iov[off : off + length])
        return out

    def _rounds(self, pages: list[Page], page_bytes: int) -> list[list[_Plan]]:
        """The pages' plans split into rounds whose data I/Os and marker records together
        fit the ring (``entries``), staged bytes within the staging area. A page whose
        segments alone leave no room for its marker record is staged."""
        entries, staging = self.rings.entries, max(self.rings.staging, page_bytes)
        rounds: list[list[_Plan]] = []
        current: list[_Plan] = []
        ios = staged = 0
        for j, page in enumerate(pages):
            p = _Plan(j, self._iov_slices(page))
            if p.zero_copy is not None and len(p.zero_copy) >= entries:
                p.zero_copy = None
            need = len(p.zero_copy) if p.zero_copy is not None else 1
            stage = 0 if p.zero_copy is not None else page_bytes
            if current and (ios + need + len(current) + 1 > entries or staged + stage > staging):
                rounds.append(current)
                current, ios, staged = [], 0, 0
            if stage:
                p.stage = staged
            current.append(p)
            ios += need
            staged += stage
        if current:
            rounds.append(current)
        return rounds

    def _count(self, plans: list[_Plan]) -> None:
        """Count the pages of ``plans`` moved zero-copy and staged."""
        zero = sum(p.zero_copy is not None for p in plans)
        self.metrics.count("usrbio_zero_copy", zero)
        self.metrics.count("usrbio_staged", len(plans) - zero)

    def _run(self, read: bool, ios: list[tuple[Any, int, int, _Plan]],
             meanwhile: Callable[[], list[tuple[Any, int, int, _Plan]]] | None = None) -> None:
        """One ring round of ``(iov slice, fd, offset, plan)`` I/Os, and those ``meanwhile()``
        returns while they are in flight (:meth:`_Usrbio.run`); a page fails when any of its
        I/Os moved fewer bytes than asked, and is held when one timed out (never reaped)."""
        more: list[tuple[Any, int, int, _Plan]] = []

        def then(meanwhile: Callable[[], list[tuple[Any, int, int, _Plan]]]) -> list[tuple[Any, int, int]]:
            more.extend(meanwhile())
            return [io[:3] for io in more]

        results = self.rings.run(read, [io[:3] for io in ios],
                                 functools.partial(then, meanwhile) if meanwhile is not None else None)
        for r, (iov, _, _, p) in zip(results, [*ios, *more]):
            p.held |= r == -errno.ETIMEDOUT
            if r != len(iov):
                if p.ok:
                    self._log.warning("usrbio-io", "hf3fs: USRBIO I/O failed: result %d of %d", r,
                                      len(iov))
                p.ok = False

    def _data_ios(self, plans: list[_Plan], scratch: _Scratch, fds: list[int], data_at: list[int],
                  page_bytes: int, pages: Sequence[Page] | None) -> list[tuple[Any, int, int, _Plan]]:
        """The data I/Os of the pages of ``plans`` still OK: zero-copy, or through their
        ``page_bytes`` in ``scratch``'s staging area (copied there first from ``pages`` when
        given: a write)."""
        ios: list[tuple[Any, int, int, _Plan]] = []
        iov, view, base = scratch.iov, scratch.view, scratch.markers
        for p in plans:
            if not p.ok:
                continue
            fd = fds[p.index]
            self.rings.register_fd(fd)
            if p.zero_copy is not None:
                _zero_copy_ios(ios, p, fd, data_at[p.index])
                continue
            o = pos = base + p.stage
            if pages is None:
                pos += page_bytes
            else:
                for seg in self.regions.views(pages[p.index]) or []:
                    view[pos : pos + len(seg)] = seg
                    pos += len(seg)
            ios.append((iov[o:pos], fd, data_at[p.index], p))
        return ios

    def _markers(self, batch: WriteBatch, plans: list[_Plan], scratch: _Scratch,
                 marker_at: list[int]) -> list[tuple[Any, int, int, _Plan]]:
        """The marker-record writes of the pages of ``plans``, each hashed (when the batch
        checksums) and encoded into ``scratch``'s record area."""
        ios: list[tuple[Any, int, int, _Plan]] = []
        page_bytes = batch.geometry.slot_bytes
        for n, p in enumerate(plans):
            fd, _, _, gen = batch.slots[p.index]
            self.rings.register_fd(fd)
            csum = page_checksum(batch.pages[p.index]) if batch.checksum else 0
            batch.checksums[p.index] = csum
            r = RECORD_BYTES * n
            scratch.view[r : r + RECORD_BYTES] = encode_marker(gen, page_bytes, csum,
                                                               key_fingerprint(batch.keys[p.index]))
            ios.append((scratch.iov[r : r + RECORD_BYTES], fd, marker_at[p.index], p))
        return ios

    # ---- moving slots -----------------------------------------------------------------
    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """Each page's marker record, then its data; a round's data goes with the next
        round's marker records, hashed and encoded while that data is in flight. A page
        whose write timed out is held (:attr:`~hicache_l3.slab.io.WriteBatch.held`): the
        abandoned ring may still write its slot."""
        usrbio, geometry = self.rings, batch.geometry
        page_bytes = geometry.slot_bytes
        pages, slots = batch.pages, batch.slots
        fds = [s[0] for s in slots]
        data_at, marker_at = geometry.offsets(s[2] for s in slots)
        with usrbio.locks[False]:
            rounds = self._rounds(pages, page_bytes)
            scratch = usrbio.scratch(False, page_bytes)
            data: list[tuple[Any, int, int, _Plan]] = []
            previous: list[_Plan] = []
            for k in range(len(rounds) + 1):
                current = rounds[k] if k < len(rounds) else []
                if len(data) + len(current) > usrbio.entries:  # no room for both: the data first
                    self._run(False, data)
                    data = []
                markers = functools.partial(self._markers, batch, current, scratch, marker_at)
                self._run(False, data, markers if current else None)
                self._count([p for p in previous if p.ok])
                for p in previous:
                    if p.ok:
                        batch.status[p.index] = OK
                    else:
                        batch.fail(p.index, Reason.ENGINE_ERROR)
                        if p.held:  # a late write must not land in a reused slot
                            batch.held.add(p.index)
                scratch = usrbio.scratch(False, page_bytes)  # a fresh one if the round failed
                data, previous = self._data_ios(current, scratch, fds, data_at, page_bytes, pages), current

    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """Each page's data, then its marker record; a round's data goes with the previous
        round's marker records, and the round before that is verified meanwhile."""
        usrbio, geometry = self.rings, batch.geometry
        page_bytes = geometry.slot_bytes
        keys, pages, located, status = batch.keys, batch.pages, batch.located, batch.status
        fds = [loc[0] for loc in located]
        data_at, marker_at = geometry.offsets(loc[1][2] for loc in located)
        records: dict[int, memoryview] = {}  # a page's marker record, once read

        def check(plans: list[_Plan]) -> list[tuple[Any, int, int, _Plan]]:
            for p in plans:
                j = p.index
                if p.ok:
                    status[j] = verify(records.pop(j), located[j].entry, keys[j], pages[j])
                else:
                    batch.fail(j, Reason.ENGINE_ERROR)
            return []

        with usrbio.locks[True]:
            rounds = self._rounds(pages, page_bytes)
            scratch = usrbio.scratch(True, page_bytes)
            waiting: list[_Plan] = []  # data read, marker records not yet
            arrived: list[_Plan] = []  # both read, not yet verified
            for k in range(len(rounds) + 1):
                current = rounds[k] if k < len(rounds) else []
                ios = []
                at = RECORD_BYTES * (k % 2) * (usrbio.entries // 2)
                for n, p in enumerate(q for q in waiting if q.ok):
                    r = at + RECORD_BYTES * n
                    records[p.index] = scratch.view[r : r + RECORD_BYTES]
                    ios.append((scratch.iov[r : r + RECORD_BYTES], fds[p.index], marker_at[p.index], p))
                data = self._data_ios(current, scratch, fds, data_at, page_bytes, None)
                if len(ios) + len(data) > usrbio.entries:  # no room for both: the records first
                    self._run(True, ios)
                    ios = []
                self._run(True, ios + data, functools.partial(check, arrived) if arrived else None)
                self._count(current)
                for p in current:  # the staged copies out, before the area is reused
                    if p.ok and p.zero_copy is None:
                        pos = scratch.markers + p.stage
                        for seg in self.regions.views(pages[p.index]) or []:
                            seg[:] = scratch.view[pos : pos + len(seg)]
                            pos += len(seg)
                scratch = usrbio.scratch(True, page_bytes)  # a fresh one if the round failed
                waiting, arrived = current, waiting
            check(arrived)

    def close(self) -> None:
        """Deregister fds (before the store closes them), free rings and iovecs."""
        self.rings.close()
        with self._iov_lock:
            self._iovs.clear()
            self._iov_starts.clear()


class Hf3fsConnector(FileConnector):
    """Pages on a 3FS mount: see the module docstring."""

    name = "hf3fs"
    config_class = Hf3fsConfig
    config: Hf3fsConfig

    def __init__(self, config: Hf3fsConfig, namespace: Namespace) -> None:
        self.usrbio: UsrbioTransport | None = None
        super().__init__(config, namespace)
        try:
            rings = self._open_usrbio(config)
        except BaseException:
            self._close()
            raise
        if rings is not None:
            self.transport.close()  # the POSIX transport's threads are not needed
            self.transport = self.usrbio = UsrbioTransport(rings, self.regions, self.metrics, self._log)

    def _open_usrbio(self, config: Hf3fsConfig) -> _Usrbio | None:
        if config.usrbio == "off":
            return None
        try:
            io = importlib.import_module(config.usrbio_module)
        except ImportError as exc:
            if config.usrbio == "on":
                raise EngineUnavailableError(
                    f"hf3fs: usrbio='on' but {config.usrbio_module} cannot be imported ({exc}); "
                    "install 3FS's hf3fs_py_usrbio or set usrbio='auto'"
                ) from exc
            return None
        mount = io.extract_mount_point(str(self.root))
        if not mount:
            if config.usrbio == "on":
                raise ConfigError(f"hf3fs: usrbio='on' but root {self.root} is not on a 3FS mount")
            return None
        staging = max(config.usrbio_staging_bytes, self.page_bytes or 0)
        return _Usrbio(io, mount, config.usrbio_entries, staging, config.usrbio_timeout_s)

    @property
    def mode(self) -> str:
        """``"usrbio"`` or ``"posix"``: how this connector moves bytes."""
        return "usrbio" if self.usrbio is not None else "posix"

    def _make_store(self, slot_bytes: int) -> SlabStore:
        cfg = self.config
        per_writer = self.capacity_bytes // cfg.max_writers
        store = SharedSlabStore(
            self.root, self.namespace, slot_bytes,
            capacity_bytes=per_writer, slab_bytes=cfg.slab_bytes, fsync=cfg.fsync,
            max_writers=cfg.max_writers, lease_s=cfg.lease_s,
            rescan_s=cfg.rescan_s, node=cfg.node_id, node_locks=cfg.node_locks,
        )
        stride = store.geometry.stride
        if per_writer < stride:
            store.close()
            raise ConfigError(
                f"hf3fs: capacity_bytes={self.capacity_bytes} / max_writers={cfg.max_writers} "
                f"is less than one slot ({stride} bytes for {slot_bytes}-byte pages)"
            )
        return store

    def _store_opened(self, store: SlabStore) -> None:
        if self.usrbio is None:  # (USRBIO moves pages past the page cache anyway)
            super()._store_opened(store)

    def _register(self, region: MemoryRegion) -> None:
        if self.usrbio is not None:
            self.usrbio.register(region)

    def _unregister(self, region: MemoryRegion) -> None:
        if self.usrbio is not None:
            self.usrbio.unregister(region)

    def _engine_stats(self) -> dict[str, Any]:
        return {**super()._engine_stats(), "mode": self.mode}


def _zero_copy_ios(ios: list[tuple[Any, int, int, _Plan]], plan: _Plan, fd: int, offset: int) -> None:
    """Queue one zero-copy page's ring I/Os: its segments in place, from ``offset``."""
    for seg in plan.zero_copy or ():
        ios.append((seg, fd, offset, plan))
        offset += len(seg)
