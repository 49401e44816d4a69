"""Per-pool, per-op, per-reason page counts for SGLang's storage metrics, as deltas since
the previous call and as the Prometheus counter
``hicache_l3_pages_total{pool,op,result,tp_rank}`` (when ``prometheus_client`` is present).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

OPS = ("set", "get", "exists")
Deltas = dict[str, dict[str, dict[str, int]]]  # pool -> op -> result ("ok" or reason) -> pages

_COUNTER: Any = None
_COUNTER_LOCK = threading.Lock()


def prometheus_counter() -> Any:
    """The process-wide ``hicache_l3_pages_total`` counter, or None without prometheus_client."""
    global _COUNTER
    with _COUNTER_LOCK:
        if _COUNTER is None:
            try:
                from prometheus_client import Counter
            except ImportError:
                return None
            _COUNTER = Counter("hicache_l3_pages_total",
                               "Pages moved by hicache-l3 per pool, op and result (ok or the failure reason)",
                               ["pool", "op", "result", "tp_rank"])
        return _COUNTER


class ReasonCounts:
    """Cumulative per-pool connector counters -> deltas since the previous :meth:`delta`.
    Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, str, str], int] = {}

    def delta(self, ops_by_pool: Mapping[str, Mapping[str, Any]]) -> Deltas:
        """``ops_by_pool``: pool name -> ``metrics.snapshot()``. Unmoved counts are left out; a
        count that went back (a reopened connector) counts from zero again."""
        now: dict[tuple[str, str, str], int] = {}
        for pool, ops in ops_by_pool.items():
            for op in OPS:
                m = ops.get(op) or {}
                now[(pool, op, "ok")] = int(m.get("ok", 0))
                for reason, n in (m.get("failed") or {}).items():
                    now[(pool, op, str(reason))] = int(n)
        out: Deltas = {}
        with self._lock:
            for key, n in now.items():
                before = self._seen.get(key, 0)
                moved = n - before if n >= before else n
                if moved:
                    pool, op, result = key
                    out.setdefault(pool, {}).setdefault(op, {})[result] = moved
            self._seen = now
        return out


def publish(deltas: Deltas, tp_rank: int) -> None:
    """Add ``deltas`` to the Prometheus counter (nothing without prometheus_client)."""
    counter = prometheus_counter()
    if counter is None:
        return
    for pool, ops in deltas.items():
        for op, results in ops.items():
            for result, n in results.items():
                counter.labels(pool=pool, op=op, result=result, tp_rank=str(tp_rank)).inc(n)
