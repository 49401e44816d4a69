"""Slab file names, the descriptors a process keeps open on them, and the one way the
slab store creates and opens anything inside its root: directories 0700, files 0600, every
open ``O_NOFOLLOW | O_CLOEXEC`` (a planted symlink is refused, never followed)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


def open_file(path: str | os.PathLike[str], flags: int) -> int:
    """``os.open`` inside the root: never through a symlink; a created file is 0600."""
    fd = os.open(path, flags | _NOFOLLOW, FILE_MODE)
    if flags & os.O_CREAT:
        try:
            os.fchmod(fd, FILE_MODE)  # the umask may have taken bits off; an old file may be wider
        except OSError:
            os.close(fd)
            raise
    return fd


def no_readahead(fd: int) -> None:
    """Ask the kernel to read only what is asked of ``fd`` (``POSIX_FADV_RANDOM``): slab
    pages are read one by one in random order, and readahead past a page fills the page
    cache with slots nobody asked for (evicted unread where memory is short). A filesystem
    that ignores or refuses the advice is left as it is."""
    with contextlib.suppress(OSError, AttributeError):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)


def make_dir(path: str | os.PathLike[str], exist_ok: bool = False) -> None:
    """Create a private directory (0700 whatever the umask); FileExistsError unless
    ``exist_ok``. An existing one must be a real directory (not a symlink)."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not exist_ok:
            raise
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)  # ELOOP/ENOTDIR otherwise
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)


def is_real_dir(path: str | os.PathLike[str]) -> bool:
    """True for a directory that is not a symlink."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def writer_name(writer: int) -> str:
    """The directory name of writer ``writer`` under ``writers/``."""
    return f"w{writer:04d}"


def parse_writer_name(name: str) -> int | None:
    """The writer number a ``writers/`` entry name stands for, or None."""
    if name.startswith("w") and name[1:].isdigit():
        return int(name[1:])
    return None


def slab_file_name(slab: int, packed: bool = False) -> str:
    """The file name of slab ``slab``: ``slab-NNNNNN.dat``, or ``slab-NNNNNN.packed.dat``
    for packed small slots."""
    return f"slab-{slab:06d}.packed.dat" if packed else f"slab-{slab:06d}.dat"


class SlabFiles:
    """Open descriptors on slab files, cached per ``(writer, slab, direct)``. Not
    thread-safe (the store calls it under its lock). Descriptors other threads may still use
    are *retired* (closed at :meth:`close`), never closed early."""

    def __init__(self, writers_dir: Path, packed: bool = False) -> None:
        self.writers_dir = writers_dir
        self.packed = packed  # the namespace's slots are packed: its slabs' names say so
        self.owner: int | None = None  # the writer whose slabs open read-write
        self._fds: dict[tuple[int, int, bool], int] = {}
        self._retired: list[int] = []

    def path(self, writer: int, slab: int) -> Path:
        """The path of slab ``slab`` of ``writer``."""
        return self.writers_dir / writer_name(writer) / slab_file_name(slab, self.packed)

    def get(self, writer: int, slab: int, direct: bool = False) -> int:
        """A descriptor on that slab (opened on first use; O_DIRECT when ``direct``)."""
        fd = self._fds.get((writer, slab, direct))
        if fd is None:
            flags = os.O_RDWR if writer == self.owner else os.O_RDONLY
            if direct:
                flags |= os.O_DIRECT
            fd = open_file(self.path(writer, slab), flags)
            if not direct:
                no_readahead(fd)
            self._fds[(writer, slab, direct)] = fd
        return fd

    def create(self, writer: int, slab: int, size: int) -> int:
        """Create (or open) an own slab of ``size`` bytes, sparse; its read-write descriptor."""
        fd = open_file(self.path(writer, slab), os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, size)
        except OSError:
            os.close(fd)
            raise
        no_readahead(fd)
        old = self._fds.get((writer, slab, False))
        if old is not None:
            self._retired.append(old)
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
