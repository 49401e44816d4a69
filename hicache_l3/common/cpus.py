"""Which CPU the calling thread runs on, and a helper thread kept off it.

After idle time the scheduler can wake a helper thread (a NIXL lane, a benchmark's raw
helper) onto the CPU of the caller that woke it, and leave both there while another CPU
idles, batch after batch. The caller avoids it by narrowing the helper's affinity to the
CPUs it may use but its own before the wake (:func:`keep_off`; docs/benchmarks.md,
session 26). The file connector's resident readers do the same in C (batch_io.c
``readers_step_aside``).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Set


def _cpu_reader() -> Callable[[], int]:
    """``sched_getcpu`` of libc, or a stand-in answering -1 where there is none."""
    try:
        fn = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return lambda: -1
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


#: The calling thread's CPU now (-1: unknown).
current_cpu: Callable[[], int] = _cpu_reader()


def keep_off(tid: int, allowed: Set[int], cpu: int) -> bool:
    """Let thread ``tid`` run on the CPUs of ``allowed`` but ``cpu``; False (nothing
    changed) when ``cpu`` is unknown or not among them, no other CPU is left, ``tid`` is
    not a thread id (0 would name the caller itself) or the system refuses."""
    if tid <= 0 or cpu < 0 or cpu not in allowed or len(allowed) < 2:
        return False
    try:
        os.sched_setaffinity(tid, set(allowed) - {cpu})
    except OSError:
        return False
    return True
