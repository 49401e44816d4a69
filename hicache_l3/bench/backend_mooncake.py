"""Bench backend ``mooncake``: the Mooncake connector against raw ``MooncakeDistributedStore``
(:class:`RawMooncake`, its own client with the same setup), in two placements on one master:
``local`` (pages in this client's own segment: in-process copies) and ``remote`` (no segment
here: pages go to the segment holder over TCP). Both remove the previous repetition's keys in
``plan`` (untimed), so the segments never fill. Without ``mooncake.master_address`` a local
master and segment holder are started for the run.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from hicache_l3.bench.targets import BenchOptions, BenchTarget, ConnectorTarget, Pair, bench_namespace
from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page
from hicache_l3.common.registry import open_connector


class _Recycler:
    """Remembers the keys of the last set repetition; drops them when a new one starts."""

    def __init__(self, drop: Callable[[list[str]], Any]) -> None:
        self.drop = drop
        self.rep = ""
        self.keys: list[str] = []

    def new_batch(self, keys: list[str]) -> None:
        """Record ``keys``; drop the previous repetition's keys (1024 a call) when a new one begins."""
        rep = keys[0].rsplit("-", 1)[0] if keys else ""
        if rep != self.rep:
            for lo in range(0, len(self.keys), 1024):
                self.drop(self.keys[lo : lo + 1024])
            self.keys, self.rep = [], rep
        self.keys.extend(keys)


class MooncakeConnectorTarget(ConnectorTarget):
    """The connector, deleting the previous repetition's pages before a new set (untimed)."""

    def __init__(self, connector: Connector[Any], placement: str) -> None:
        super().__init__(connector, "mooncake", placement=placement)
        self._recycler = _Recycler(connector.delete)

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """Untimed: on the first batch of a set repetition, delete the last one's pages."""
        if op == "set":
            self._recycler.new_batch(keys)
        return keys, pages


class RawMooncake(BenchTarget):
    """``batch_put_from``/``batch_get_into`` of the same pages, one object per page, under
    ``raw-<placement>:<key>``; ``batch_is_exist`` of ``exists_prefix + key`` (the
    connector's storage keys when given, else its own)."""

    backend = "raw-mooncake"

    def __init__(self, settings: dict[str, Any], placement: str, exists_prefix: str = "") -> None:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig

        self.extra = {"placement": placement}
        self.prefix = f"raw-{placement}:"
        self.exists_prefix = exists_prefix or self.prefix
        self.store: Any = MooncakeDistributedStore()
        metadata = settings.get("metadata_server") or (
            f"http://{settings['master_address'].rsplit(':', 1)[0]}:8080/metadata")
        rc = self.store.setup(
            settings.get("local_hostname", "127.0.0.1"), metadata,
            int(settings.get("global_segment_size", 0)), 16 << 20,
            settings.get("protocol", "tcp"), settings.get("device_names", ""),
            settings["master_address"])
        if rc != 0:
            raise EngineUnavailableError(f"raw-mooncake: setup failed with code {rc}")
        self.config = ReplicateConfig()
        if placement == "local":
            self.config.preferred_segment = self.store.get_hostname()
        self.registered: list[int] = []
        self._recycler = _Recycler(lambda old: self.store.batch_remove([self.prefix + k for k in old], True))

    def prepare(self, buffers: list[HostBuffer], page_bytes: int) -> None:
        """Register the bench buffers once."""
        for b in buffers:
            rc = self.store.register_buffer(b.address, b.size)
            if rc != 0:
                raise EngineUnavailableError(f"raw-mooncake: register_buffer returned {rc}")
            self.registered.append(b.address)

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """Key, pointer and size lists (and, for a new set repetition, drop the last one)."""
        if op == "set":
            self._recycler.new_batch(keys)
        prefix = self.exists_prefix if op == "exists" else self.prefix
        skeys = [prefix + k for k in keys]  # the two placements share one master
        return skeys, [p[0][0] for p in pages], [p[0][1] for p in pages]

    def run(self, op: str, plan: Any) -> list[bool]:
        """One Mooncake batch call."""
        keys, ptrs, sizes = plan
        if op == "set":
            return [c == 0 for c in self.store.batch_put_from(keys, ptrs, sizes, self.config)]
        if op == "get":
            return [g == s for g, s in zip(self.store.batch_get_into(keys, ptrs, sizes), sizes)]
        return [c == 1 for c in self.store.batch_is_exist(keys)]

    def close(self) -> None:
        """Unregister the buffers and close the client."""
        if self.store is None:
            return
        for address in self.registered:
            self.store.unregister_buffer(address)
        self.store.close()
        self.store = None


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """(connector, raw-mooncake) for placement ``local`` and ``remote``."""
    settings: dict[str, Any] = dict(opts.settings.get("mooncake", {}))
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.get("local_hostname", "127.0.0.1"))
    # one repetition alive per target, plus slack
    per_target = opts.pages * opts.page_bytes * 3 // 2 + (64 << 20)
    if not settings.get("master_address"):
        from hicache_l3.engines import MooncakeEngine

        engine = MooncakeEngine(holder=True, segment_size=f"{(2 * per_target >> 20) + 1} MB")
        stack.enter_context(engine)
        settings.update(engine.settings)
    pairs = []
    for placement in ("local", "remote"):
        chosen = dict(settings)
        if placement == "local":
            chosen.update(global_segment_size=per_target, preferred_segment="local")
        else:
            chosen.update(global_segment_size=0)
        namespace = bench_namespace(opts.page_bytes, f"bench-mooncake-{placement}")
        conn = open_connector("mooncake", namespace, chosen)
        stack.callback(conn.close)
        raw = RawMooncake(chosen, placement, exists_prefix=namespace.storage_key(""))
        stack.callback(raw.close)
        pairs.append(Pair(MooncakeConnectorTarget(conn, placement), raw))
    return pairs
