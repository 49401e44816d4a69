"""Which filesystem holds a path, and whether other nodes may share its files (each node
then has a page cache of its own, possibly stale)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

MOUNTINFO = "/proc/self/mountinfo"

LOCAL_FILESYSTEMS = frozenset({
    "ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "jfs", "reiserfs", "bcachefs",
    "tmpfs", "ramfs", "hugetlbfs", "overlay", "vfat", "exfat", "ntfs3", "squashfs",
})
"""Filesystems only this machine's kernel caches; any other type may be shared across nodes."""


class Mount(NamedTuple):
    """The mount holding a path: its mount point and filesystem type."""

    point: str
    fstype: str

    @property
    def shared_across_nodes(self) -> bool:
        """Whether other nodes may mount this filesystem (not in :data:`LOCAL_FILESYSTEMS`)."""
        return self.fstype not in LOCAL_FILESYSTEMS


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> Mount:
    """The mount that holds ``path`` (resolved): the longest mount point prefixing it;
    ``Mount("/", "unknown")`` (shared) when no line covers it."""
    target = os.path.realpath(path)
    best = Mount("", "unknown")
    try:
        lines = Path(mountinfo).read_text().splitlines()
    except OSError:
        return Mount("/", "unknown")
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = _unescape(fields[4])
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.point):  # later lines mount over earlier ones
            best = Mount(point, tail[0])
    return best if best.point else Mount("/", "unknown")
