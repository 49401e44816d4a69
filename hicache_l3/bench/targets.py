"""What the bench measures: a :class:`BenchTarget` is a connector or a raw engine baseline.

Backend ``NAME`` is benchmarked by ``hicache_l3.bench.backend_NAME``, which provides
``make_pairs(opts, stack) -> list[Pair]`` (engines started on ``stack`` when no address is
configured). Every raw baseline moves the same pages, registers memory once before timing,
builds its request lists before the clock (:meth:`BenchTarget.plan`), uses one thread unless
stated; bytes are verified after timing.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any

from hicache_l3.common.connector import Connector
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page

OPS = ("set", "get", "exists", "mixed")
DEFAULT_OPS = ("set", "get", "exists")


@dataclasses.dataclass
class BenchOptions:
    """One bench configuration (from the command line)."""

    page_bytes: int
    pages: int
    batch: int
    threads: int
    reps: int
    workdir: Path
    settings: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # per backend
    cache: str = "warm"  # "cold": drop the page cache of the workdir's files before reads
    read_fraction: float = 0.8  # share of get batches in the "mixed" op
    idle_s: float = 0.0  # sleep before every timed op, off the clock


def bench_namespace(page_bytes: int, tag: str, kv_dtype: str = "uint8") -> Namespace:
    """The namespace bench pages of ``page_bytes`` are stored in, tagged ``tag``;
    ``kv_dtype`` ``bfloat16`` where pages hold bf16 KV (zstd then splits byte planes)."""
    return Namespace(model="hicache-l3-bench", kv_dtype=kv_dtype, layout="page_first",
                     page_size=page_bytes, tag=tag)


class BenchTarget(abc.ABC):
    """One measured thing. ``backend`` is the JSON ``"backend"`` value ("file",
    "raw-posix", ...); ``extra`` adds JSON fields (e.g. ``{"placement": "remote"}``)."""

    backend: str = "?"
    extra: dict[str, Any] = {}
    ops: tuple[str, ...] = ("set", "get", "exists")  # "mixed" runs where set and get do

    def supports(self, op: str) -> bool:
        """True when this target can run ``op``."""
        return op in self.ops or (op == "mixed" and "set" in self.ops and "get" in self.ops)

    @abc.abstractmethod
    def prepare(self, buffers: list[HostBuffer], page_bytes: int) -> None:
        """Once before timing: register ``buffers`` (set sources, get destinations), open files."""

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """Untimed: the request lists ``run`` needs for one batch."""
        return keys, pages

    @abc.abstractmethod
    def run(self, op: str, plan: Any) -> list[bool]:
        """Timed: one batch of ``op`` ("set", "get" or "exists"); success per page."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release everything (called once at the end)."""


@dataclasses.dataclass
class Pair:
    """A connector target and the raw engine baseline it is compared with."""

    connector: BenchTarget
    raw: BenchTarget


class ConnectorTarget(BenchTarget):
    """Any :class:`Connector`, measured through its public batch API."""

    def __init__(self, connector: Connector[Any], backend: str, **extra: Any) -> None:
        self.connector = connector
        self.backend = backend
        self.extra = extra

    def prepare(self, buffers: list[HostBuffer], page_bytes: int) -> None:
        """Register the bench buffers once."""
        for buffer in buffers:
            self.connector.register(buffer)

    def run(self, op: str, plan: Any) -> list[bool]:
        """One batch through the connector."""
        keys, pages = plan
        if op == "set":
            return self.connector.batch_set(keys, pages)
        if op == "get":
            return self.connector.batch_get(keys, pages)
        return self.connector.batch_exists(keys)

    def close(self) -> None:
        """Close the connector."""
        self.connector.close()
