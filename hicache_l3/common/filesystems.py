"""Which filesystem holds a path, and whether other nodes may share its files.

A filesystem mounted by several nodes (NFS, GlusterFS, CephFS, Lustre, 3FS through FUSE,
any FUSE filesystem) gives each node its own page cache: a node may read parts of a file
that another node has rewritten from its own cache, older than what the server holds.
The slab store's integrity argument needs to know when that can happen
(:mod:`hicache_l3.slab.format`, "Across nodes"); a local filesystem (ext4, xfs, tmpfs...)
has one page cache, coherent for every process of the machine.
"""

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
"""Filesystems whose files only this machine's kernel caches: one coherent page cache.
Every other type (``nfs``, ``nfs4``, ``cifs``, ``ceph``, ``lustre``, ``gpfs``,
``fuse.glusterfs``, ``fuse.hf3fs``, any ``fuse.*``, an unknown type) may be mounted by
other nodes too."""


class Mount(NamedTuple):
    """The mount holding a path: its mount point and filesystem type (``fuse.glusterfs``
    for a FUSE filesystem whose daemon names itself)."""

    point: str
    fstype: str

    @property
    def shared_across_nodes(self) -> bool:
        """Whether nodes other than this one may mount this filesystem, each with a page
        cache of its own (:data:`LOCAL_FILESYSTEMS`)."""
        return self.fstype not in LOCAL_FILESYSTEMS


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path: str | os.PathLike[str], mountinfo: str = MOUNTINFO) -> Mount:
    """The mount that holds ``path`` (resolved; it must exist): the longest mount point
    that is a prefix of it in ``mountinfo``. A path that no line covers (no ``/proc``)
    gives ``Mount("/", "unknown")``, which counts as shared across nodes."""
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
