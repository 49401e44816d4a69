"""I/O threads resident in C for the native transport's shared reads and writes
(``hl3_readers_*``, hicache_l3/native/batch_io.c).

A pool thread that Python wakes for each batch (:meth:`~hicache_l3.common.parallel.BatchPool.run_shared`)
joins the batch 60-90 us after the caller started reading it on the 2-core VM: a futex
wake, then the GIL, which the caller holds while it plans. On a 128-page get of 64 KiB
pages (~1 ms) the caller reads alone for that long. A resident reader enters one C call
when it starts and stays there, without the GIL, until :meth:`ResidentReaders.close`:
it waits in the readers' mailbox (spinning for :data:`LINGER_NS` after a batch, then
asleep on a futex), and drains each batch the caller publishes there, with the caller.
:meth:`ResidentReaders.wake`, called when a get starts planning, wakes a sleeping reader,
which then spins up to 300 us for the batch, so that it is up when the batch is published.

A reader that finds itself on the CPU of the caller it is to share a batch with (woken
there by the caller while another CPU idled) moves off it (``readers_step_aside``): the two
would otherwise take turns on one CPU until the kernel balanced them out, a few ms.

A set's write batch takes the same way (:meth:`ResidentReaders.write`): its Python pool
thread joined it 58 us late at the median (85 at p90) on SGLang's controller path, where a
128-page write of 64 KiB pages takes ~800 us; :meth:`ResidentReaders.wake` is called when
a set starts reserving its slots.

One caller at a time owns the mailbox; a caller that finds it taken (another thread's
get), or a process that is a fork of the one that started the readers, shares its batch
through the pool as before. The mailbox is C memory that is never freed while a reader
may run: a reader still inside a finished batch, or one left running at interpreter exit,
touches nothing else.
"""

from __future__ import annotations

import array
import ctypes
import os
import threading
import time
from collections.abc import Callable

from hicache_l3.slab.native import LoadedOnce, PlanRead

_vp, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64

LINGER_NS = 100_000
"""How long a reader spins for the next batch before it sleeps. A caller sends its 128-page
batches 150-250 us apart (its Python: the result, the next keys, validation, the plan); a
reader asleep takes 60-90 us to wake, so :meth:`ResidentReaders.wake` wakes it when the
plan starts and it then spins up to 300 us for the batch. Spinning longer costs more than it
saves where the other core is busy: on SGLang's controller path (each get right after the
host pool was filled by torch and a set), 64 KiB gets with readers over gets without, in one
run: 500 us 0.90x, 100 us 1.06x, 0 1.04x and 1.04x; back-to-back gets alone gain from a
longer spin (500 us 1.05x, 100 us 1.045x, 0 1.02x)."""

_MAILBOX_BYTES = 176  # sizeof(struct hl3_readers)
_GATE_BUSY = 1  # its first word's bit: a caller owns the mailbox (HL3_GATE_BUSY)


class _Library:
    """The ``hl3_readers_*`` calls, typed once: ``run`` and ``read`` (long) release the
    GIL; the others take microseconds and keep it (PyDLL), so that a Python thread waiting
    for the GIL does not get it in the middle of a get."""

    def __init__(self, path: str) -> None:
        lib, short = ctypes.CDLL(path), ctypes.PyDLL(path)
        self.size = short.hl3_readers_size
        self.size.restype, self.size.argtypes = ctypes.c_size_t, []
        self.run = lib.hl3_readers_run
        self.run.restype, self.run.argtypes = ctypes.c_int, [_vp, _i64]
        self.read = lib.hl3_readers_read
        self.read.restype, self.read.argtypes = ctypes.c_int, [_vp, _i64]
        self.publish = short.hl3_readers_publish
        self.publish.restype, self.publish.argtypes = ctypes.c_int, [_vp, _i64, _i64, _i64, _i32, _vp, _vp]
        self.publish_write = short.hl3_readers_publish_write
        self.publish_write.restype = ctypes.c_int
        self.publish_write.argtypes = [_vp, _i64, _i64, _i64, _vp, _vp]
        self.wake = short.hl3_readers_wake
        self.stop_batch = short.hl3_readers_stop_batch
        self.done = short.hl3_readers_done
        self.stop = short.hl3_readers_stop
        for fn in (self.wake, self.stop_batch, self.done, self.stop):
            fn.restype, fn.argtypes = None, [_vp]
        self.idle = short.hl3_readers_idle
        self.idle.restype, self.idle.argtypes = ctypes.c_int, [_vp]
        self.moves = short.hl3_readers_moves
        self.moves.restype, self.moves.argtypes = _i64, [_vp]
        libc = ctypes.CDLL(None)
        self.calloc = libc.calloc
        self.calloc.restype, self.calloc.argtypes = _vp, [ctypes.c_size_t, ctypes.c_size_t]


def _self_test(lib: _Library) -> None:
    if lib.size() != _MAILBOX_BYTES:
        raise RuntimeError(f"hl3_readers_size() is {lib.size()}, not {_MAILBOX_BYTES}")


_native = LoadedOnce(_Library, _self_test, "hicache_l3._batch_io has no usable resident readers")


class ResidentReaders:
    """``threads`` resident readers (module docstring) named ``name``-N; none when the
    library lacks them or ``threads`` < 1 (:attr:`running` is then False)."""

    def __init__(self, threads: int, name: str, linger_ns: int = LINGER_NS) -> None:
        self._lib = _native.get() if threads > 0 else None
        self._pid = os.getpid()
        self._threads: list[threading.Thread] = []
        self._mailbox = 0
        lib = self._lib
        if lib is None:
            return
        self._mailbox = lib.calloc(1, _MAILBOX_BYTES) or 0
        if not self._mailbox:
            return
        for k in range(threads):
            t = threading.Thread(target=lib.run, args=(self._mailbox, linger_ns), name=f"{name}-{k}",
                                 daemon=True)
            t.start()
            self._threads.append(t)

    @property
    def moves(self) -> int:
        """How many times a reader moved off the CPU of the caller it was to share a batch
        with (``readers_step_aside``, batch_io.c: woken onto the caller's CPU while another
        idled, the two took turns on one CPU)."""
        return int(self._lib.moves(self._mailbox)) if self._lib is not None and self._mailbox else 0

    @property
    def running(self) -> bool:
        """Whether readers run (in this process: a fork's child has none)."""
        return bool(self._threads) and os.getpid() == self._pid

    def wake(self) -> None:
        """A get starts planning: wake the readers if they sleep (no syscall when not)."""
        if self._lib is not None and self.running:
            self._lib.wake(self._mailbox)

    def read(self, call: PlanRead, chunk: int, parts: int, nowait: bool, wait_ns: int) -> bool:
        """Read every page of ``call`` (:meth:`~hicache_l3.slab.native.BatchIO.plan_read`)
        with the readers: chunks claimed as a :class:`~hicache_l3.slab.native.Share` of
        ``chunk`` pages and ``parts`` claims, the calling thread's wait for the readers'
        chunks up to ``wait_ns`` spinning, then sleeping. True once every page was read;
        False, having read nothing, when the readers are not there or another caller owns
        the mailbox. Whatever ends the call, no reader touches ``call``'s pages after it
        (interrupted: no chunk starts, and the running ones are waited for)."""
        lib = self._lib
        if lib is None or not self.running:
            return False
        return self._run(lambda mailbox, owned: lib.publish(
            mailbox, len(call.status), chunk, parts, int(nowait), call.args.buffer_info()[0], owned), wait_ns)

    def write(self, args: array.array[int], n: int, chunk: int, wait_ns: int) -> bool:
        """Write the ``n`` pages of a write batch with the readers (``args``:
        :meth:`~hicache_l3.slab.native.BatchIO.write_args`): chunks of ``chunk`` pages
        (cut at 2 MiB-aligned file offsets, as a shared write's are), the calling thread's
        wait as :meth:`read`'s. True once every page was written (each page's outcome in
        the batch's status); False, having written nothing, when the readers are not there
        or another caller owns the mailbox. Whatever ends the call, no reader touches the
        batch's pages after it."""
        lib = self._lib
        if lib is None or not self.running:
            return False
        return self._run(lambda mailbox, owned: lib.publish_write(
            mailbox, n, chunk, 0, args.buffer_info()[0], owned), wait_ns)

    def _run(self, publish: Callable[[int, int], object], wait_ns: int) -> bool:
        """``publish(mailbox, owned_at)`` a batch, drain it with the readers and give the
        mailbox back (:meth:`read`, :meth:`write`)."""
        lib = self._lib
        assert lib is not None
        mailbox = self._mailbox
        owned = array.array("q", (0,))  # set by the publish itself: an interruption cannot lose it
        finished = False
        try:
            publish(mailbox, owned.buffer_info()[0])
            if not owned[0]:
                return False
            finished = bool(lib.read(mailbox, wait_ns))
        finally:
            if owned[0]:
                if not finished:  # a chunk still running, or interrupted: none starts, wait for them
                    lib.stop_batch(mailbox)
                    self._wait_idle()
                lib.done(mailbox)
        return True

    def _wait_idle(self) -> None:
        """Until no reader is inside the batch, through further interruptions (a second
        Ctrl-C must not leave a reader in the caller's pages)."""
        assert self._lib is not None
        while True:
            try:
                while not self._lib.idle(self._mailbox):
                    time.sleep(20e-6)
                return
            except BaseException:  # interrupted again while waiting: keep waiting
                continue

    def close(self, timeout: float = 5.0) -> None:
        """Stop the readers and wait for them (each ends its current batch first). The
        mailbox is freed only when every reader ended and no caller owns it (a get still
        in flight, past the connector's wait at close, keeps it: a few bytes leaked)."""
        lib = self._lib
        if lib is None or not self._threads or not self.running:
            return
        lib.stop(self._mailbox)  # from here no caller can take the mailbox
        for t in self._threads:
            t.join(timeout)
        self._threads = [t for t in self._threads if t.is_alive()]
        owned = ctypes.c_uint64.from_address(self._mailbox).value & _GATE_BUSY
        if not self._threads and not owned:
            ctypes.CDLL(None).free(ctypes.c_void_p(self._mailbox))
            self._mailbox = 0
        self._lib = None
