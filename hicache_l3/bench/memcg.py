"""The cgroups a bench worker runs in (v1 or v2; creating one needs root): a memory cgroup
that bounds the page cache it may use, and an I/O limit on the disk its stores live on (a
device slower than the cores, as a remote filesystem is to a many-core host). Charges made
before a process joins stay where they were, so a worker allocates its buffers first and
joins after."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def create(limit_bytes: int, name: str, root: Path = CGROUP_ROOT) -> tuple[Path | None, str]:
    """A new memory cgroup ``name`` limited to ``limit_bytes``: ``(its directory, "")``, or
    ``(None, why not)`` when this process may not create one (not root, no memory
    controller, a read-only cgroup filesystem)."""
    v1 = root / "memory"
    controllers = root / "cgroup.controllers"
    try:
        if (v1 / "memory.limit_in_bytes").exists():
            path, limit_file = v1 / name, "memory.limit_in_bytes"
        elif controllers.exists() and "memory" in controllers.read_text().split():
            with contextlib.suppress(OSError):  # the root may already delegate memory
                (root / "cgroup.subtree_control").write_text("+memory")
            path, limit_file = root / name, "memory.max"
        else:
            return None, f"no memory cgroup controller under {root}"
        path.mkdir()
    except OSError as exc:
        return None, f"cannot create a memory cgroup under {root}: {exc.strerror or exc}"
    try:
        (path / limit_file).write_text(str(limit_bytes))
    except OSError as exc:
        remove(path)
        return None, f"cannot set the limit of {path}: {exc.strerror or exc}"
    return path, ""


def disk_of(directory: Path) -> str:
    """``MAJ:MIN`` of the whole disk holding ``directory`` (a partition's parent): the
    device an I/O limit names. ValueError for a filesystem on no block device (tmpfs, FUSE)."""
    dev = os.stat(directory).st_dev
    sysfs = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not sysfs.exists():
        raise ValueError(f"{directory} is on no block device (device {os.major(dev)}:{os.minor(dev)})")
    if (sysfs / "partition").exists():
        sysfs = sysfs.resolve().parent
    return (sysfs / "dev").read_text().strip()


def limit_io(rate: int, directory: Path, name: str, memory: Path | None,
             root: Path = CGROUP_ROOT) -> tuple[Path | None, str]:
    """Limit reads and writes of the disk holding ``directory`` to ``rate`` bytes per second
    for the processes of a cgroup: ``(the cgroup to join, "")`` or ``(None, why not)``. v2
    sets ``io.max`` on the memory cgroup ``memory`` (a process is in one v2 cgroup); v1
    makes the blkio cgroup ``name``, where page-cache writeback is not limited (the
    flusher writes it, not the worker)."""
    try:
        disk = disk_of(directory)
        v1 = root / "blkio"
        if (v1 / "blkio.throttle.read_bps_device").exists():
            path = v1 / name
            path.mkdir()
            try:
                for op in ("read", "write"):
                    (path / f"blkio.throttle.{op}_bps_device").write_text(f"{disk} {rate}")
            except OSError:
                remove(path)
                raise
            return path, ""
        if memory is None or memory.parent != root:
            return None, "a v2 I/O limit needs the bench's memory cgroup"
        with contextlib.suppress(OSError):
            (root / "cgroup.subtree_control").write_text("+io")
        (memory / "io.max").write_text(f"{disk} rbps={rate} wbps={rate}")
        return memory, ""
    except (OSError, ValueError) as exc:
        return None, f"cannot limit the disk of {directory}: {getattr(exc, 'strerror', None) or exc}"


def join(path: Path) -> None:
    """Move this process into the cgroup at ``path`` (OSError when it may not)."""
    (path / "cgroup.procs").write_text(str(os.getpid()))


def remove(path: Path, timeout_s: float = 5.0) -> bool:
    """Remove the cgroup at ``path`` once its processes have left it; whether it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
