"""Owning a writer directory on one node: ``flock`` on its ``lock`` file, its ``index.log``
opened for appends, a crashed owner's torn tail set aside.
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

from hicache_l3.slab.files import is_real_dir, make_dir, open_file, parse_writer_name, writer_name

log = logging.getLogger("hicache_l3.slab")


def own_first(writers_dir: Path, try_own: Callable[[int], bool]) -> int:
    """The first writer directory under ``writers_dir`` that ``try_own`` adopts: the
    existing ones in order, then new ones (created with ``mkdir``, numbered past them)."""
    existing = sorted(w for w in map(parse_writer_name, os.listdir(writers_dir)) if w is not None)
    for writer in existing:
        if try_own(writer):
            return writer
    writer = (existing[-1] + 1) if existing else 0
    while True:
        try:
            make_dir(writers_dir / writer_name(writer))
        except FileExistsError:
            writer += 1
            continue
        if try_own(writer):
            return writer
        writer += 1


def lock_writer(fd: int) -> bool:
    """Take the writer directory's lock on ``fd`` without blocking; False if held."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def open_writer(wdir: Path, lock: Callable[[int], bool]) -> tuple[int, int] | None:
    """Writer directory ``wdir`` locked (``lock`` on its ``lock`` file) and its log opened
    for appends: ``(lock_fd, log_fd)``; None (descriptors closed) when it cannot be owned."""
    if not is_real_dir(wdir):
        return None  # junk or a planted link named like a writer directory
    try:
        fd = open_file(wdir / "lock", os.O_RDWR | os.O_CREAT)
    except OSError as exc:
        log.warning("%s: cannot take its lock (%s): skipped", wdir, exc.strerror)
        return None
    if not lock(fd):
        os.close(fd)
        return None
    log_path = wdir / "index.log"
    try:
        log_fd = open_file(log_path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    except OSError as exc:  # a symlink planted at the log: refused, the writer skipped
        log.warning("%s: cannot open (%s): writer directory skipped", log_path, exc.strerror)
        os.close(fd)
        return None
    return fd, log_fd


def set_aside_tail(log_fd: int, path: Path, offset: int) -> None:
    """Move the log's unparsable tail past ``offset`` to ``index.log.damaged-N`` beside it,
    then cut it off."""
    size = os.fstat(log_fd).st_size
    data = os.pread(log_fd, size - offset, offset)
    n = 0
    while True:
        aside = path.with_name(f"index.log.damaged-{n}")
        try:
            fd = open_file(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            break
        except FileExistsError:
            n += 1
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.ftruncate(log_fd, offset)
    log.warning("%s: %d unparsable bytes at its end moved to %s", path, len(data), aside)
