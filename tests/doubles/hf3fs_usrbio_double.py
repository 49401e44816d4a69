"""TEST DOUBLE of 3FS's USRBIO Python API (``hf3fs_fuse.io``), for tests only.

The real library (``hf3fs_py_usrbio``, wrapped by ``hf3fs_fuse/io.py``) needs a running
3FS FUSE daemon, which cannot be built here. This double offers the same functions with
the same signatures, as SGLang's ``hf3fs_usrbio_client.py`` and 3FS's ``hf3fs_fuse/io.py``
use them, and performs real file I/O underneath (``preadv``/``pwritev`` on the registered
file descriptors, from worker threads, as the FUSE daemon's I/O threads would):

* ``extract_mount_point(path)``: the nearest ancestor holding ``3fs-virt/iovs`` (a test
  "mount" is a directory with that subdirectory), or None;
* ``register_fd(fd, flags=0)`` / ``deregister_fd(fd)`` (the simulated daemon keeps its own
  reference to the file, so a late I/O never reaches a file that reused the number);
* ``make_iovec(shm, mount, block_size=0, numa=-1)``: a ``SharedMemory`` becomes an iovec;
  like the real one it symlinks ``<mount>/3fs-virt/iovs/<uuid>`` to ``/dev/shm/<name>``;
* ``make_ioring(mount, entries, for_read=True, io_depth=0, priority=None, timeout=None,
  numa=-1, flags=0)`` with ``prepare(iov, read, fd, off, userdata=None)``, ``submit()``
  and ``wait(*, max_results=0, min_results=0, timeout=None)`` returning completions
  with ``.result`` (bytes moved, or ``-errno``) and ``.userdata``.

It enforces the real API's preconditions, so that code passing here respects them:
I/O buffers must be slices of an iovec made from POSIX shared memory that still exists
in ``/dev/shm`` when the iovec is made (the FUSE daemon maps it by name; memory outside
it cannot be a target), slices are contiguous (step 1) and inside their iovec, the fd
must be registered (once), ``read`` must match the ring's direction, at most
``entries`` I/Os may be outstanding, and ``wait`` honours its timeout.
:data:`STATS` counts I/Os, bytes and waits, so tests can prove the USRBIO path ran;
:data:`EVENTS`, when a test sets it, records when each I/O starts and ends.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from typing import Any

STATS = {"ios": 0, "bytes": 0, "iovecs": 0, "waits": 0}
DELAY_S = 0.0  # tests set it to simulate a slow FUSE daemon
DELAY_MIN_BYTES = 0  # only I/Os of at least this many bytes are delayed
EVENTS: list[tuple[str, bool, int, int, int]] | None = None
"""Tests set a list: ``("start" | "done", read, file, offset, length)`` per I/O, in order
(``file``: the daemon's descriptor of the registered file, one per registration)."""
_lock = threading.Lock()
_registered: set[int] = set()
_files: dict[int, _File] = {}  # registered fd -> the daemon's own reference to its file
_pool = ThreadPoolExecutor(4, thread_name_prefix="usrbio-double")


def extract_mount_point(path: str) -> str | None:
    """The 3FS mount point holding ``path`` (None when it is not on one)."""
    current = os.path.abspath(path)
    while True:
        if os.path.isdir(os.path.join(current, "3fs-virt", "iovs")):
            return current
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


class _File:
    """The daemon's reference to a registered file (a duplicate descriptor): I/O submitted
    on an fd reaches the file registered then, even when it completes after ``fd`` was
    deregistered, closed and its number reused, as 3FS's daemon's own file handles do."""

    def __init__(self, fd: int) -> None:
        self.fd = os.dup(fd)
        self.users = 1  # the registration, and each I/O submitted and not yet done

    def release(self) -> None:
        """Drop one user (caller holds ``_lock``); the last one closes the duplicate."""
        self.users -= 1
        if self.users == 0:
            os.close(self.fd)


def register_fd(fd: int, flags: int = 0) -> None:
    """Allow USRBIO I/O on ``fd``; registering an fd twice is an error, as in 3FS."""
    os.fstat(fd)  # EBADF for a closed fd
    with _lock:
        if fd in _registered:
            raise OSError(errno.EINVAL, f"fd {fd} is already registered")
        _registered.add(fd)
        _files[fd] = _File(fd)


def deregister_fd(fd: int) -> None:
    """Forget ``fd`` (must happen before it is closed)."""
    with _lock:
        _registered.discard(fd)
        file = _files.pop(fd, None)
        if file is not None:
            file.release()


class iovec:
    """Shared memory registered with the (simulated) FUSE daemon, or a slice of it."""

    def __init__(self, buf: memoryview, link: str | None, root: iovec | None = None) -> None:
        self._buf = buf
        self.link = link
        self.root = root  # slices keep their iovec (and its link) alive; None for an iovec

    @property
    def size(self) -> int:
        """Bytes in this iovec (slice)."""
        return len(self._buf)

    def __len__(self) -> int:
        return len(self._buf)

    def __getitem__(self, item: slice) -> iovec:
        if not isinstance(item, slice):
            raise TypeError("iovec only supports slicing")
        start, stop, step = item.indices(len(self._buf))
        if step != 1:
            raise ValueError("step not 1 when slicing iovec")
        return iovec(self._buf[start:stop], None, self.root or self)

    def slice_by(self, buf: Any) -> iovec:
        """The part of this iovec that ``buf`` covers; out of range if it lies outside."""
        import ctypes

        view = memoryview(buf).cast("B")
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(view)) if not view.readonly else None
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._buf))
        if ptr is None or ptr < base or ptr + len(view) > base + len(self._buf):
            raise IndexError("given buf is out of range")
        return self[ptr - base : ptr - base + len(view)]

    def memory(self) -> memoryview:
        """The bytes (for the simulated daemon and for tests)."""
        return self._buf

    def __del__(self) -> None:
        if self.link is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.link)


def make_iovec(shm: Any, hf3fs_mount_point: str, block_size: int = 0, numa: int = -1) -> iovec:
    """Register a ``multiprocessing.shared_memory.SharedMemory`` as an iovec."""
    if not isinstance(shm, shared_memory.SharedMemory):
        raise TypeError("make_iovec needs a multiprocessing.shared_memory.SharedMemory")
    target = os.path.normpath(f"/dev/shm/{shm.name.lstrip('/')}")
    if not os.path.exists(target):
        raise FileNotFoundError(errno.ENOENT, "shared memory is not in /dev/shm", target)
    if extract_mount_point(hf3fs_mount_point) != os.path.abspath(hf3fs_mount_point):
        raise OSError(errno.EINVAL, "not a 3FS mount point", hf3fs_mount_point)
    link = os.path.join(hf3fs_mount_point, "3fs-virt", "iovs",
                        str(uuid.uuid4()) + (f".b{block_size}" if block_size > 0 else ""))
    os.symlink(target, link)
    with _lock:
        STATS["iovecs"] += 1
    return iovec(shm.buf, link)


class _Cqe:
    def __init__(self, result: int, userdata: Any) -> None:
        self.result = result
        self.userdata = userdata


class ioring:
    """A submission/completion ring for one direction (read or write)."""

    def __init__(self, mount: str, entries: int, for_read: bool, timeout: int | None) -> None:
        if extract_mount_point(mount) != os.path.abspath(mount):
            raise OSError(errno.EINVAL, "not a 3FS mount point", mount)
        if entries <= 0:
            raise OSError(errno.EINVAL, f"entries must be > 0, got {entries}")
        self.entries = entries
        self.for_read = for_read
        self._prepared: list[tuple[iovec, _File, int, Any]] = []
        self._outstanding = 0
        self._done: queue.Queue[_Cqe] = queue.Queue()
        self._lock = threading.Lock()

    @staticmethod
    def size_for_entries(entries: int) -> int:
        """Bytes of shared memory a ring of ``entries`` takes (indicative)."""
        return 4096 + entries * 64

    def prepare(self, iov: iovec, read: bool, fd: int, off: int, userdata: Any = None) -> ioring:
        """Queue one I/O between ``iov`` (an iovec slice) and ``fd`` at ``off``."""
        if not isinstance(iov, iovec):
            raise TypeError("iov must be a slice of an iovec made by make_iovec "
                            f"(USRBIO moves data only through its shared memory), got {type(iov)}")
        if bool(read) != self.for_read:
            raise OSError(errno.EINVAL, "read flag does not match the ioring's direction")
        with _lock:
            if fd not in _registered:
                raise OSError(errno.EBADF, f"fd {fd} is not registered")
            file = _files[fd]
        if off < 0:
            raise OSError(errno.EINVAL, f"negative offset {off}")
        with self._lock:
            if self._outstanding + len(self._prepared) >= self.entries:
                raise OSError(errno.EAGAIN, f"ioring full ({self.entries} entries)")
            self._prepared.append((iov, file, off, userdata))
        return self

    def submit(self) -> ioring:
        """Hand the prepared I/Os to the (simulated) daemon."""
        with self._lock:
            batch, self._prepared = self._prepared, []
            self._outstanding += len(batch)
        with _lock:
            for _, file, _, _ in batch:
                file.users += 1
        _pool.submit(self._start, batch)  # one call, as the real submit is one C call
        return self

    def _start(self, batch: list[tuple[iovec, _File, int, Any]]) -> None:
        for io in batch:
            _pool.submit(self._run, *io)

    def _run(self, iov: iovec, file: _File, off: int, userdata: Any) -> None:
        view, fd = iov.memory(), file.fd
        _event("start", self.for_read, fd, off, len(view))
        if DELAY_S and len(view) >= DELAY_MIN_BYTES:
            time.sleep(DELAY_S)
        try:
            if self.for_read:
                n = os.preadv(fd, [view], off)
            else:
                n = os.pwritev(fd, [view], off)
        except OSError as exc:
            n = -(exc.errno or errno.EIO)
        with _lock:
            STATS["ios"] += 1
            STATS["bytes"] += max(n, 0)
            file.release()
        _event("done", self.for_read, fd, off, len(view))
        self._done.put(_Cqe(n, userdata))

    def wait(self, *, max_results: int = 0, min_results: int = 0,
             timeout: datetime.timedelta | None = None) -> list[_Cqe]:
        """At least ``min_results`` completions (fewer only on timeout), at most
        ``max_results`` (0: no limit beyond what is ready)."""
        max_results = max(max_results, min_results)
        with _lock:
            STATS["waits"] += 1
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        out: list[_Cqe] = []
        while len(out) < min_results:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            try:
                out.append(self._done.get(timeout=left))
            except queue.Empty:
                break
        while not max_results or len(out) < max_results:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            self._outstanding -= len(out)
        if not out and min_results > 0:
            raise OSError(errno.ETIMEDOUT, "timed out waiting for I/O completions")
        return out


def _event(what: str, read: bool, fd: int, off: int, length: int) -> None:
    events = EVENTS
    if events is not None:
        with _lock:
            events.append((what, read, fd, off, length))


def make_ioring(hf3fs_mount_point: str, entries: int, for_read: bool = True, io_depth: int = 0,
                priority: int | None = None, timeout: int | None = None, numa: int = -1,
                flags: int = 0) -> ioring:
    """A ring for ``entries`` outstanding I/Os in one direction."""
    return ioring(hf3fs_mount_point, entries, for_read, timeout)


def make_test_mount(directory: str) -> str:
    """Turn ``directory`` into a test "3FS mount" (creates ``3fs-virt/iovs``)."""
    os.makedirs(os.path.join(directory, "3fs-virt", "iovs"), exist_ok=True)
    return directory
