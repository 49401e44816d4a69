"""The namespace's change file (``<namespace>/changes``, 8 bytes per writer): one ``pread``
tells a process that no other writer published anything since it last looked at the logs.
Any failure with it means a full look every time; a full look happens every
:data:`FULL_LOOK_S` regardless.
"""

from __future__ import annotations

import logging
import os
import random
import stat
from pathlib import Path
from time import monotonic

from hicache_l3.slab.files import open_file

log = logging.getLogger("hicache_l3.slab")

CHANGES_FILE = "changes"
READ_BYTES = 4096  # slots of writers 0..511
FULL_LOOK_S = 1.0  # a full look at the logs at least this often, whatever the file says


class ChangeFile:
    """This process's handle on ``<namespace>/changes``. Not
    thread-safe: callers hold the index lock."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._seen: bytearray | None = None  # the file's bytes when the logs were last looked at
        self._full_at = 0.0  # (monotonic) the next full look, whatever the file says
        self._random = random.Random(os.urandom(16))
        self._warned = False

    @classmethod
    def open(cls, directory: Path) -> ChangeFile | None:
        """The change file of the namespace in ``directory``, created if missing (0600, no
        symlink followed); None when it cannot be opened or is not a regular file."""
        fd = -1
        try:
            fd = open_file(directory / CHANGES_FILE, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{directory / CHANGES_FILE} is not a regular file")
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            log.debug("%s: no change file (%s): every call looks at the logs", directory, exc)
            return None
        return cls(fd)

    def unchanged(self) -> bool:
        """True when no writer published anything since the last call that returned False;
        False otherwise (what the file holds now is remembered). Call it *before* looking at the
        logs."""
        try:
            now = os.pread(self._fd, READ_BYTES, 0)
        except OSError:
            self._seen = None
            return False
        seen = self._seen
        if seen is not None and now == seen and monotonic() < self._full_at:
            return True
        self._seen = bytearray(now)
        self._full_at = monotonic() + FULL_LOOK_S
        return False

    def published(self, writer: int) -> None:
        """Writer ``writer`` (this process's own) made a change other processes must see: a
        new random value in its slot, remembered here too."""
        value = self._random.getrandbits(64).to_bytes(8, "little")
        at = 8 * writer
        try:
            written = os.pwrite(self._fd, value, at)
        except OSError as exc:
            written = -1
            if not self._warned:
                self._warned = True
                log.warning("change file not written (%s): other processes see this writer's "
                            "changes within %.0f s only", exc, FULL_LOOK_S)
        seen = self._seen
        if written != 8 or seen is None or at >= READ_BYTES:
            return
        if len(seen) < at:
            seen.extend(bytes(at - len(seen)))  # slots never written read as zeros (a hole)
        seen[at:at + 8] = value

    def close(self) -> None:
        """Close the file (idempotent)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
