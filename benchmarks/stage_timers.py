"""Wall-clock stage timers for the breakdown benchmarks (``nixl_stages.py``,
``slab_set_overhead.py``): :func:`timed` wraps a method or function in place, and every
call adds its wall time to :data:`spent` under a label, and appends it (ns) to :data:`calls`
for per-call medians. Times are inclusive (a stage's
time holds the stages it calls); a timer itself costs ~0.3 us a call."""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

spent: collections.Counter[str] = collections.Counter()
calls: collections.defaultdict[str, list[int]] = collections.defaultdict(list)


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``spent[label]``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            ns = time.perf_counter_ns() - start
            spent[label] += ns / 1e9
            calls[label].append(ns)

    setattr(owner, name, wrapper)
