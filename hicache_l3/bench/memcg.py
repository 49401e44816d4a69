"""A memory cgroup (v1 or v2; creating one needs root) that bounds the page cache a bench
process may use. Charges made before a process joins stay where they were, so a worker
allocates its buffers first and joins after."""

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
