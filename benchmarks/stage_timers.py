"""Wall-clock stage timers for the breakdown benchmarks (``nixl_stages.py``,
``slab_set_overhead.py``): :func:`timed` wraps a method or function in place, and every
call adds its wall time to :data:`spent` under a label. Times are inclusive (a stage's
time holds the stages it calls); a timer itself costs ~0.3 us a call."""

from __future__ import annotations

import collections
import functools
import time
from typing import Any

spent: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper adding its wall time to ``spent[label]``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)
