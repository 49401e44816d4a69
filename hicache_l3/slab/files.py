"""Slab file names and the descriptors a process keeps open on them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def writer_name(writer: int) -> str:
    """The directory name of writer ``writer`` under ``writers/``."""
    return f"w{writer:04d}"


def parse_writer_name(name: str) -> int | None:
    """The writer number a ``writers/`` entry name stands for, or None."""
    if name.startswith("w") and name[1:].isdigit():
        return int(name[1:])
    return None


class SlabFiles:
    """Open descriptors on slab files, cached per ``(writer, slab, direct)``.

    Not thread-safe by itself: the store calls it under its lock. Descriptors that other
    threads may still use are *retired* (closed at :meth:`close`), never closed early: a
    closed number can be reused by another open, and a late read would hit that file.
    """

    def __init__(self, writers_dir: Path) -> None:
        self.writers_dir = writers_dir
        self.owner: int | None = None  # the writer whose slabs open read-write
        self._fds: dict[tuple[int, int, bool], int] = {}
        self._retired: list[int] = []

    def path(self, writer: int, slab: int) -> Path:
        """The path of slab ``slab`` of ``writer``."""
        return self.writers_dir / writer_name(writer) / f"slab-{slab:06d}.dat"

    def get(self, writer: int, slab: int, direct: bool = False) -> int:
        """A descriptor on that slab (opened on first use; O_DIRECT when ``direct``)."""
        fd = self._fds.get((writer, slab, direct))
        if fd is None:
            flags = os.O_RDWR if writer == self.owner else os.O_RDONLY
            if direct:
                flags |= os.O_DIRECT
            fd = os.open(self.path(writer, slab), flags | os.O_CLOEXEC)
            self._fds[(writer, slab, direct)] = fd
        return fd

    def create(self, writer: int, slab: int, size: int) -> int:
        """Create (or open) an own slab of ``size`` bytes, sparse; its read-write descriptor."""
        fd = os.open(self.path(writer, slab), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        os.ftruncate(fd, size)
        self._fds[(writer, slab, False)] = fd
        return fd

    def retire_writer(self, writer: int) -> None:
        """Stop using the cached descriptors of ``writer`` (opened read-only before this
        process adopted it); they close at :meth:`close`."""
        for cached in [k for k in self._fds if k[0] == writer]:
            self._retired.append(self._fds.pop(cached))

    def close(self) -> None:
        """Close every descriptor, cached and retired, once."""
        fds = [*self._fds.values(), *self._retired]
        self._fds.clear()
        self._retired.clear()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
