"""Private storage roots (0700, ours, reached through directories no other user can
replace) and private small files (0600, atomic, never through a symlink)."""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
from pathlib import Path

from hicache_l3.common.errors import ConfigError

log = logging.getLogger("hicache_l3.safe_fs")

DIR_MODE = 0o700
FILE_MODE = 0o600


def owner_name(uid: int) -> str:
    """``name (uid N)`` for messages; the bare uid when it has no passwd entry."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _describe(path: Path, st: os.stat_result) -> str:
    mode = stat.S_IMODE(st.st_mode)
    return f"{path} (owner {owner_name(st.st_uid)}, mode {stat.filemode(st.st_mode)} = {mode:04o})"


def _me() -> int:
    return os.geteuid()


def _check_ancestor(path: Path, what: str) -> None:
    """Refuse a parent directory another user could use to swap what lies below it."""
    me = _me()
    lst = os.lstat(path)
    if stat.S_ISLNK(lst.st_mode) and lst.st_uid not in (0, me):
        raise ConfigError(
            f"{what}: parent {path} is a symlink owned by {owner_name(lst.st_uid)}, who could "
            f"point it anywhere; use a path without it")
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}: parent {path} is not a directory")
    if st.st_uid not in (0, me):
        raise ConfigError(
            f"{what}: parent directory {_describe(path, st)} belongs to another user, who could "
            f"replace what lies under it; put the root under a directory you or root own "
            f"(e.g. ~/.cache/hicache-l3)")
    # group-writable directories of our own are allowed: a user-private group (umask 002)
    writable = stat.S_IWOTH if st.st_uid == me else stat.S_IWOTH | stat.S_IWGRP
    if st.st_mode & writable and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(
            f"{what}: parent directory {_describe(path, st)} is writable by other users without "
            f"the sticky bit, so they could rename or replace the root; "
            f"fix: chmod o-w,g-w {path} (or chmod +t), or choose another root")


def _check_own_dir(path: Path, what: str, repair: bool) -> None:
    """``path`` exists: refuse it unless it is a directory of ours closed to others."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(
            f"{what}: {path} is a symlink (to {os.readlink(path)!r}); a storage root must be a real "
            f"directory. Fix: use the target's path directly, or remove the link")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{what}: {_describe(path, st)} is not a directory")
    if st.st_uid != _me():
        raise ConfigError(
            f"{what}: {_describe(path, st)} belongs to another user, not to you "
            f"({owner_name(_me())}): they could read your pages or plant their own. Fix: choose a "
            f"root of your own (the default is per-user), or have its owner remove it")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077 == 0:
        return
    if mode & stat.S_IWOTH or not repair:
        raise ConfigError(
            f"{what}: {_describe(path, st)} is open to other users (they may have planted pages "
            f"in it). Fix: check its contents, then chmod 700 {path}; or choose another root")
    os.chmod(path, DIR_MODE, follow_symlinks=False)
    log.warning("%s: %s was mode %04o; made it 0700 (private to %s)", what, path, mode, owner_name(_me()))


def _mkdir_private(path: Path) -> None:
    """Create one directory 0700 whatever the umask; an existing one is checked by the caller."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE, follow_symlinks=False)  # the umask may have removed owner bits


def private_root(root: str | os.PathLike[str], what: str = "storage root") -> Path:
    """Create ``root`` (and missing parents) with mode 0700, or check an existing one:
    refuse a symlink, another user's directory, one writable by others, or a parent
    another user could swap; repair a readable or group-writable directory of ours to 0700.
    Returns the absolute path. ConfigError (prefixed ``what``) naming path, owner, mode and
    fix when refused or when creating fails."""
    path = Path(os.path.abspath(os.fspath(root)))
    missing: list[Path] = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    try:
        for ancestor in reversed(probe.parents):
            _check_ancestor(ancestor, what)
        if probe not in missing:
            if probe == path:
                _check_own_dir(path, what, repair=True)
            else:
                _check_ancestor(probe, what)
        for directory in reversed(missing):
            _mkdir_private(directory)
            # created by us just now, or by someone racing us: check either way
            _check_own_dir(directory, what, repair=False)
    except OSError as exc:
        raise ConfigError(f"{what}: cannot create or check {path}: {exc}") from None
    return path


def default_root(sub: str = "") -> Path:
    """The per-user root used when none is configured: ``$XDG_CACHE_HOME/hicache-l3``, else
    ``~/.cache/hicache-l3`` when the home directory is ours, else ``/var/tmp/hicache-l3-<uid>``;
    with ``sub`` appended. Not created here (:func:`private_root` does that on open)."""
    base: Path | None = None
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):
        base = Path(xdg) / "hicache-l3"
    else:
        home = os.path.expanduser("~")
        with contextlib.suppress(OSError):
            if os.path.isabs(home) and os.stat(home).st_uid == _me():
                base = Path(home) / ".cache" / "hicache-l3"
    if base is None:
        base = Path("/var/tmp") / f"hicache-l3-{_me()}"
    return base / sub if sub else base


def write_synced(fd: int, data: bytes) -> None:
    """Write all of ``data`` at ``fd``'s offset (short writes continued) and fsync it."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.fsync(fd)


def write_private_file(path: str | os.PathLike[str], data: bytes | str) -> None:
    """Replace ``path`` with ``data`` atomically, mode 0600 whatever the umask (a new file
    fsynced and renamed over it). A symlink at ``path`` is refused (ConfigError); missing
    parents are created 0700."""
    target = Path(os.path.abspath(os.fspath(path)))
    blob = data.encode() if isinstance(data, str) else data
    if target.parent != target and not target.parent.exists():
        private_root(target.parent, what=f"directory of {target}")
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(target)
        if stat.S_ISLNK(st.st_mode):
            raise ConfigError(
                f"{target} is a symlink (to {os.readlink(target)!r}); refusing to write a file "
                f"that may hold secrets through it. Fix: remove the link or name its target")
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{target} exists and is not a regular file")
    dir_fd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tmp = f".{target.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     FILE_MODE, dir_fd=dir_fd)
        try:
            os.fchmod(fd, FILE_MODE)
            write_synced(fd, blob)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.close(fd)
        try:
            os.replace(tmp, target.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
