"""Per-operation counters and latency histograms, with Prometheus text exposition."""

from __future__ import annotations

import bisect
import threading
from typing import Any

from hicache_l3.common.errors import Reason

# Latency bucket upper bounds, seconds (0.05 ms .. 30 s).
BUCKETS: tuple[float, ...] = (
    5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

OPS = ("set", "get", "exists", "delete")
_OK = Reason.OK


class OpMetrics:
    """Counters of one operation kind. Not thread-safe on its own: see :class:`Metrics`."""

    def __init__(self) -> None:
        self.calls = 0
        self.pages = 0
        self.bytes = 0
        self.ok = 0
        self.reasons: dict[str, int] = {}
        self.buckets = [0] * (len(BUCKETS) + 1)
        self.seconds = 0.0

    def observe(self, reasons: list[Reason], nbytes: int, seconds: float) -> None:
        """Record one batch call."""
        self.calls += 1
        self.seconds += seconds
        self.bytes += nbytes
        self.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
        ok = reasons.count(_OK)
        self.pages += len(reasons)
        self.ok += ok
        if ok != len(reasons):
            for r in reasons:
                if r is not _OK:
                    self.reasons[r.value] = self.reasons.get(r.value, 0) + 1

    def quantile(self, q: float) -> float:
        """Estimated latency quantile in seconds (the upper bound of its bucket)."""
        total = sum(self.buckets)
        if total == 0:
            return 0.0
        rank, seen = q * total, 0
        for i, count in enumerate(self.buckets):
            seen += count
            if seen >= rank:
                return BUCKETS[i] if i < len(BUCKETS) else float("inf")
        return float("inf")

    def snapshot(self) -> dict[str, Any]:
        """A plain dict of the counters (for ``stats()``)."""
        return {
            "calls": self.calls,
            "pages": self.pages,
            "bytes": self.bytes,
            "ok": self.ok,
            "failed": dict(sorted(self.reasons.items())),
            "seconds": self.seconds,
            "p50_ms": self.quantile(0.5) * 1e3,
            "p99_ms": self.quantile(0.99) * 1e3,
        }


class Metrics:
    """Thread-safe counters for every op of one connector, plus free-form engine counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ops = {op: OpMetrics() for op in OPS}
        self._counters: dict[str, int] = {}

    def observe(self, op: str, reasons: list[Reason], nbytes: int, seconds: float) -> None:
        """Record one batch call of ``op``."""
        m = self._ops[op]
        with self._lock:
            m.observe(reasons, nbytes, seconds)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to a named counter (engine-specific events: evictions, retries...)."""
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + n

    def snapshot(self) -> dict[str, Any]:
        """All counters as a plain dict: ``{"set": {...}, "get": {...}, ..., "counters": {}}``.

        For ``get`` and ``exists``, ``ok`` counts hits and ``failed["miss"]`` misses.
        """
        with self._lock:
            out: dict[str, Any] = {op: m.snapshot() for op, m in self._ops.items()}
            out["counters"] = dict(sorted(self._counters.items()))
        return out

    def prometheus(self, prefix: str = "hicache_l3", labels: str = "") -> str:
        """Prometheus text exposition of every counter and histogram."""
        lab = f"{labels}," if labels else ""
        lines = []
        with self._lock:
            for op, m in self._ops.items():
                base = f'{lab}op="{op}"'
                for metric, value in (("calls", m.calls), ("pages", m.pages), ("bytes", m.bytes),
                                      ("pages_ok", m.ok)):
                    lines.append(f"{prefix}_{metric}_total{{{base}}} {value}")
                for reason, n in sorted(m.reasons.items()):
                    lines.append(f'{prefix}_pages_failed_total{{{base},reason="{reason}"}} {n}')
                cumulative = 0
                for bound, n in zip((*BUCKETS, float("inf")), m.buckets):
                    cumulative += n
                    le = "+Inf" if bound == float("inf") else repr(bound)
                    lines.append(f'{prefix}_latency_seconds_bucket{{{base},le="{le}"}} {cumulative}')
                lines.append(f"{prefix}_latency_seconds_sum{{{base}}} {m.seconds}")
                lines.append(f"{prefix}_latency_seconds_count{{{base}}} {m.calls}")
            for name, n in sorted(self._counters.items()):
                lines.append(f'{prefix}_events_total{{{lab}event="{name}"}} {n}')
        return "\n".join(lines) + "\n"
