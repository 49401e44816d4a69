"""The slab store for writers on several machines sharing one filesystem (3FS, NFS):
writer directories owned through epoch-numbered claim files (``claim.E``, ``released.E``)
and leases instead of ``flock``, logs written at explicit offsets, periodic rescans, and
generations (``epoch << 40 | counter``) that never repeat across owners. The protocol:
docs/reliability.md, "Writers on several nodes".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache_l3.common.errors import ConfigError, HiCacheL3Error
from hicache_l3.common.keys import Namespace
from hicache_l3.slab.files import is_real_dir, make_dir, open_file, writer_name
from hicache_l3.slab.format import Slot
from hicache_l3.slab.store import SlabStore

log = logging.getLogger("hicache_l3.slab.shared")

GEN_EPOCH_SHIFT = 40
CLAIM, RELEASED = "claim.", "released."


class WriterUnavailableError(HiCacheL3Error):
    """No writer directory can be owned now (all ``max_writers`` held), or ours was lost."""


def node_identity() -> str:
    """This machine and PID namespace: host name, boot id and the PID namespace inode."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    pidns = ""
    with contextlib.suppress(OSError):
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    return f"{socket.gethostname()}/{boot}/{pidns}"


def process_start(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (None if no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


@dataclasses.dataclass(frozen=True)
class ClaimState:
    """What an observer knows about one writer directory's current claim."""

    epoch: int  # highest claim epoch (0: none)
    free: bool  # may be taken over now
    pending: bool  # held by another node whose lease has not (yet) been seen to expire


def _epochs(wdir: Path, prefix: str) -> list[int]:
    try:
        names = os.listdir(wdir)
    except OSError:  # gone, or not a directory
        return []
    n = len(prefix)
    return [int(name[n:]) for name in names if name.startswith(prefix) and name[n:].isdigit()]


def claim_path(wdir: Path, epoch: int) -> Path:
    """Path of the claim file of ``epoch``."""
    return wdir / f"{CLAIM}{epoch:08d}"


class WriterLease:
    """This process's claim on one writer directory: heartbeats, loss detection, release."""

    def __init__(self, wdir: Path, epoch: int, lease_s: float) -> None:
        self.wdir = wdir
        self.epoch = epoch
        self.lease_s = lease_s
        self.path = claim_path(wdir, epoch)
        self.lost = False
        self.last_ok = time.monotonic()

    def heartbeat(self) -> bool:
        """Refresh the claim's mtime; detect a takeover. True while still owned."""
        if self.lost:
            return False
        if any(e > self.epoch for e in _epochs(self.wdir, CLAIM)):
            self.lost = True
            log.warning("writer directory %s was taken over (epoch > %d): this process "
                        "stops publishing pages into it", self.wdir, self.epoch)
            return False
        try:
            now = time.time_ns()
            os.utime(self.path, ns=(now, now))
        except OSError as exc:
            log.warning("lease heartbeat on %s failed: %s", self.path, exc)
            return self.valid
        self.last_ok = time.monotonic()
        return True

    @property
    def valid(self) -> bool:
        """Owned, and the last successful heartbeat is recent enough to publish."""
        return not self.lost and time.monotonic() - self.last_ok < self.lease_s / 2

    def release(self) -> None:
        """Mark the claim released so that any process, on any node, may adopt at once."""
        if self.lost:
            return
        with contextlib.suppress(OSError):
            fd = open_file(self.wdir / f"{RELEASED}{self.epoch:08d}", os.O_CREAT | os.O_WRONLY)
            os.close(fd)


class LeaseBook:
    """Claims as seen by this process: decides which writer directories are free."""

    def __init__(self, node: str, lease_s: float) -> None:
        self.node = node
        self.lease_s = lease_s
        self._seen: dict[Path, tuple[int, int, float]] = {}  # wdir -> (epoch, mtime, since)

    def observe(self, wdir: Path) -> ClaimState:
        """The current claim of ``wdir`` and whether it may be taken over now."""
        epochs = _epochs(wdir, CLAIM)
        if not epochs:
            return ClaimState(0, True, False)
        epoch = max(epochs)
        if epoch in _epochs(wdir, RELEASED):
            return ClaimState(epoch, True, False)
        path = claim_path(wdir, epoch)
        try:
            body = json.loads(path.read_text())
            mtime = os.stat(path).st_mtime_ns
        except (OSError, ValueError):
            return ClaimState(epoch, False, True)  # appearing or vanishing: look again later
        if body.get("node") == self.node:
            start = process_start(int(body.get("pid", 0)))
            alive = start is not None and start == body.get("start")
            return ClaimState(epoch, not alive, False)
        now = time.monotonic()
        seen = self._seen.get(wdir)
        if seen is None or seen[:2] != (epoch, mtime):
            self._seen[wdir] = (epoch, mtime, now)
            return ClaimState(epoch, False, True)
        return ClaimState(epoch, now - seen[2] >= self.lease_s, True)

    def claim(self, wdir: Path, epoch: int) -> WriterLease | None:
        """Create ``claim.<epoch>`` atomically; None if another process got it first."""
        body = {"node": self.node, "pid": os.getpid(), "start": process_start(os.getpid()),
                "epoch": epoch, "host": socket.gethostname()}
        tmp = wdir / f".claim.{uuid.uuid4().hex}.tmp"
        fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            os.write(fd, json.dumps(body).encode())
        finally:
            os.close(fd)
        try:
            os.link(tmp, claim_path(wdir, epoch))
        except FileExistsError:
            return None
        finally:
            tmp.unlink()
        for old in _epochs(wdir, CLAIM) + _epochs(wdir, RELEASED):
            if old < epoch - 1:  # keep the previous epoch for the record
                for prefix in (CLAIM, RELEASED):
                    with contextlib.suppress(FileNotFoundError):
                        (wdir / f"{prefix}{old:08d}").unlink()
        return WriterLease(wdir, epoch, self.lease_s)


class SharedSlabStore(SlabStore):
    """:class:`~hicache_l3.slab.store.SlabStore` for a filesystem mounted by several
    machines. ``capacity_bytes`` is per writer; ``node`` overrides the node identity;
    ``node_locks=False`` drops the per-node flock and relies on claims alone."""

    uses_change_file = False  # one node's page cache says nothing of another node's writes

    def __init__(
        self,
        root: str | os.PathLike[str],
        namespace: Namespace,
        slot_bytes: int,
        *,
        max_writers: int = 8,
        lease_s: float = 60.0,
        rescan_s: float = 2.0,
        node: str = "",
        node_locks: bool = True,
        **kwargs: Any,
    ) -> None:
        if max_writers < 1:
            raise ConfigError(f"max_writers must be >= 1, got {max_writers}")
        if lease_s <= 0:
            raise ConfigError(f"lease_s must be > 0, got {lease_s}")
        self.max_writers = max_writers
        self.lease_s = lease_s
        self.rescan_s = rescan_s
        self.node = node or node_identity()
        self.node_locks = node_locks
        self._book = LeaseBook(self.node, lease_s)
        self.lease: WriterLease | None = None
        self._last_scan = 0.0
        self._stop = threading.Event()
        self._own_lock = threading.Lock()
        self._heart: threading.Thread | None = None
        self.takeovers = 0
        super().__init__(root, namespace, slot_bytes, **kwargs)

    def _index_capacity(self) -> int | None:
        """Every writer's slots: the namespace holds at most ``max_writers`` times this
        writer's capacity."""
        return None if self.max_slots is None else self.max_slots * self.max_writers

    # ---- reading ------------------------------------------------------------------------
    def refresh(self) -> None:
        """As the base class, plus a full rescan of ``writers/`` every ``rescan_s``."""
        now = time.monotonic()
        if now - self._last_scan >= self.rescan_s:
            self._last_scan = now
            self.index.logs.dir_mtime = -1  # directory mtime is not trusted across nodes
        super().refresh()

    # ---- ownership ----------------------------------------------------------------------
    def _become_writer(self) -> int:
        if self.me is None:
            with self._own_lock:  # never under self._lock: the wait must not block readers
                if self.me is None:
                    self._claim_a_writer()
        assert self.me is not None
        if self.lease is not None and self.lease.lost:
            raise WriterUnavailableError(f"writer directory {writer_name(self.me)} was taken over")
        return self.me

    def _claim_a_writer(self) -> None:
        self.refresh()
        deadline = time.monotonic() + self.lease_s * 1.25
        while True:
            pending = False
            for writer in range(self.max_writers):
                wdir = self.writers_dir / writer_name(writer)
                with contextlib.suppress(OSError):  # exists; or junk, skipped below
                    make_dir(wdir)
                if not is_real_dir(wdir):
                    continue  # junk named like a writer directory: the index logs it once
                state = self._book.observe(wdir)
                pending = pending or state.pending
                if state.free and self._try_claim(writer, state.epoch + 1):
                    return
            if not pending or time.monotonic() >= deadline:
                raise WriterUnavailableError(
                    f"all max_writers={self.max_writers} writer directories of {self.directory} "
                    "are held by live processes: raise max_writers (and the capacity with it)"
                )
            time.sleep(min(0.25, self.lease_s / 8))

    def _try_claim(self, writer: int, epoch: int) -> bool:
        wdir = self.writers_dir / writer_name(writer)
        lease = self._book.claim(wdir, epoch)
        if lease is None:
            return False
        with self._lock:
            owned = self._try_own(writer)  # retires the read-only descriptors it cached
        if not owned:
            lease.release()
            return False
        self.lease = lease
        if epoch > 1:
            self.takeovers += 1
        self._next_gen = max(self._next_gen, epoch << GEN_EPOCH_SHIFT)
        os.lseek(self._log_fd, 0, os.SEEK_END)  # O_APPEND is not relied on
        self._heart = threading.Thread(target=self._beat, name="hicache-lease", daemon=True)
        self._heart.start()
        return True

    def _lock_writer(self, fd: int) -> bool:
        return super()._lock_writer(fd) if self.node_locks else True

    def _beat(self) -> None:
        lease = self.lease
        assert lease is not None
        while not self._stop.wait(self.lease_s / 4):
            if not lease.heartbeat():
                return

    def _check_owned(self) -> None:
        if self.lease is not None and not self.lease.valid:
            raise WriterUnavailableError(
                f"lease on writer directory {writer_name(self.me or 0)} is lost or stale: not publishing"
            )

    def _may_rewrite_log(self) -> bool:
        """Only while the lease holds."""
        return self.lease is None or self.lease.valid

    # ---- writing ------------------------------------------------------------------------
    def _writer_ready(self) -> bool:
        try:
            self._become_writer()
            self._check_owned()
        except WriterUnavailableError as exc:
            log.warning("%s", exc)
            return False
        return True

    def reserve(self, count: int) -> Sequence[Slot]:
        """As the base class; empty (the caller reports ``no_space``) when this process
        cannot own a writer directory."""
        return super().reserve(count) if self._writer_ready() else []

    def commit(self, keys: Sequence[str], slots: Sequence[Slot], checksums: Sequence[int],
               ds: Sequence[bytes] | None = None, lengths: Sequence[int] | None = None) -> None:
        """Publish written pages, only while this process still owns its directory."""
        if keys:
            self._check_owned()
        super().commit(keys, slots, checksums, ds, lengths)

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """As the base class, refusing (raising) when the writer directory was lost."""
        self._become_writer()
        self._check_owned()
        return super().delete(keys)

    # ---- lifecycle ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Base figures plus the claim epoch, takeovers and the lease state."""
        out = super().stats()
        lease = self.lease
        out.update({
            "epoch": None if lease is None else lease.epoch,
            "lease_valid": None if lease is None else lease.valid,
            "takeovers": self.takeovers,
            "max_writers": self.max_writers,
        })
        return out

    def close(self) -> None:
        """Stop the heartbeat, release the claim (adoptable at once), close files."""
        self._stop.set()
        heart = self._heart
        if heart is not None and heart is not threading.current_thread():
            heart.join(timeout=5)
        with self._lock:
            closed = self._closed
        if not closed and self.lease is not None:
            self.lease.release()
        super().close()
