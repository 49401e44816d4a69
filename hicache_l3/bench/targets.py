"""What the bench measures: a :class:`BenchTarget` is a connector or a raw engine baseline.

A backend ``NAME`` is benchmarked by the module ``hicache_l3.bench.backend_NAME``, which
provides ``make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]``:
one or more (connector, raw baseline) pairs over the same pages, engines started on
``stack`` when no address is configured. Rules every raw baseline follows, so that a
ratio means what it says: the same pages, memory registered once before timing, request
lists built before the clock (:meth:`BenchTarget.plan`), fresh keys for every set
repetition, one thread unless stated, bytes verified after timing.
"""

from __future__ import annotations

import abc
import dataclasses
from pathlib import Path
from typing import Any

from hicache_l3.common.connector import Connector
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
    idle_s: float = 0.0  # sleep before every timed op, off the clock (a server's op after a pause)


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
        """Called once before any timing: register the bench ``buffers`` (the source
        pages of sets and the destination pages of gets), open files, warm up."""

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """Untimed: build whatever request lists ``run`` needs for one batch."""
        return keys, pages

    @abc.abstractmethod
    def run(self, op: str, plan: Any) -> list[bool]:
        """Timed: perform one batch of ``op`` ("set", "get" or "exists")."""

    def close(self) -> None:  # noqa: B027 - optional
        """Release everything (called once at the end)."""


@dataclasses.dataclass
class Pair:
    """A connector target and the raw engine baseline it is compared with."""

    connector: BenchTarget
    raw: BenchTarget | None


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
