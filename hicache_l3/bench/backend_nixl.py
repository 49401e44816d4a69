"""Bench backend ``nixl``: the nixl connector in file mode against raw NIXL.

raw-nixl follows the baseline rules: its own NIXL agent with the POSIX plugin and the
connector's POSIX engine (``posix_engine``, default the measured fastest), the bench
buffers registered as DRAM once, one file fully written before timing and registered
once as FILE; per batch, one NIXL transfer of the batch's pages (page ``i`` of the
bench at file offset ``i * page_size``), descriptor lists built before the clock with
adjacent pages joined into one row (:func:`~hicache_l3.connectors.nixl.base.coalesce`,
which the connector applies to its own rows: NIXL's POSIX plugin is much faster with
fewer, larger requests, so a baseline without it would flatter the connector),
polled tightly until done, one thread, buffered, no fsync. The connector runs with a
capacity of exactly one repetition's pages, so timed repetitions measure the steady
state of a full cache (slots reused), as the file backend does.

``--set nixl.mode=obj`` measures obj mode instead, against a local ``moto_server``
started for the run unless ``nixl.endpoint`` is set, and raw-nixl-obj: its own agent
with the OBJ plugin, one PUT or ranged GET per page in one transfer per batch, object
keys registered before the clock (no commit records, no checksums).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from hicache_l3.bench.targets import BenchOptions, BenchTarget, ConnectorTarget, Pair
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import Page
from hicache_l3.common.registry import open_connector
from hicache_l3.connectors.nixl.base import Agent, NixlConfig, coalesce
from hicache_l3.slab.format import Geometry


def bench_namespace(opts: BenchOptions) -> Namespace:
    """The namespace nixl bench pages are stored in."""
    return Namespace(model="hicache-l3-bench", kv_dtype="uint8", layout="page_first",
                     page_size=opts.page_bytes, tag="bench-nixl")


class RawNixl(BenchTarget):
    """The machine's limit through NIXL: one POSIX-plugin transfer per batch."""

    backend = "raw-nixl"
    ops = ("set", "get")

    def __init__(self, path: Path, size: int, engine: str) -> None:
        self.path = path
        self.size = size
        self.engine = engine
        self.extra = {"posix_engine": engine}
        self.fd = -1
        self.agent: Agent | None = None
        self.file_reg: Any = None
        self.buffers: list[HostBuffer] = []

    def prepare(self, buffers: list[HostBuffer], page_bytes: int) -> None:
        """Create the agent, register the buffers and the fully written file once."""
        from hicache_l3.connectors.nixl.file import posix_params

        self.agent = Agent("POSIX", posix_params(self.engine))
        self.buffers = list(buffers)
        for b in buffers:
            self.agent.register_dram(b)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        src = buffers[0].view()
        written = 0
        while written < self.size:
            written += os.pwrite(self.fd, src[written : self.size], written)
        self.file_reg = self.agent.register([(0, self.size, self.fd, "")], "FILE")

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """The batch's DRAM and FILE descriptor lists (built before the clock)."""
        import numpy as np

        assert self.agent is not None
        local, remote = [], []
        for page in pages:
            base = next(b.address for b in self.buffers if b.contains(page[0][0], page[0][1]))
            offset = page[0][0] - base
            for address, length in page:
                local.append((address, length, 0))
                remote.append((offset, length, self.fd))
                offset += length
        local, remote = coalesce(local, remote)  # adjacent pages as one row, as the connector does
        nx = self.agent.agent
        ldescs = nx.get_xfer_descs(np.array(local, dtype=np.uint64), "DRAM")
        rdescs = nx.get_xfer_descs(np.array(remote, dtype=np.uint64), "FILE")
        return "WRITE" if op == "set" else "READ", ldescs, rdescs, len(pages)

    def run(self, op: str, plan: Any) -> list[bool]:
        """One transfer of the batch, polled until done."""
        assert self.agent is not None
        nx = self.agent.agent
        xop, ldescs, rdescs, n = plan
        handle = nx.initialize_xfer(xop, ldescs, rdescs, nx.name)
        state = nx.transfer(handle)
        while state == "PROC":
            state = nx.check_xfer_state(handle)
        nx.release_xfer_handle(handle)
        return [state == "DONE"] * n

    def close(self) -> None:
        """Deregister, close and remove the file, drop the agent."""
        if self.agent is not None:
            if self.file_reg is not None:
                self.agent.deregister(self.file_reg)
            self.agent.close()
            self.agent = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


class RawNixlObj(BenchTarget):
    """The OBJ plugin's limit: one transfer of the batch's page objects."""

    backend = "raw-nixl-obj"
    ops = ("set", "get")

    def __init__(self, config: NixlConfig) -> None:
        self.config = config
        self.agent: Agent | None = None
        self.prefix = f"{config.prefix}raw-nixl-obj/"
        self.regs: list[Any] = []
        self.devs: dict[str, int] = {}

    def prepare(self, buffers: list[HostBuffer], page_bytes: int) -> None:
        """Create the agent and register the buffers once."""
        from hicache_l3.connectors.nixl.obj import obj_params

        self.agent = Agent("OBJ", obj_params(self.config))
        for b in buffers:
            self.agent.register_dram(b)

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """Register the batch's object keys (untimed) and build its descriptor lists."""
        assert self.agent is not None
        new = [k for k in keys if k not in self.devs]
        if new:
            n = pages[0][0][1]
            for k in new:
                self.devs[k] = len(self.devs) + 1
            self.regs.append(self.agent.register(
                [(0, n, self.devs[k], self.prefix + k) for k in new], "OBJ"))
        local = [(p[0][0], p[0][1], 0) for p in pages]
        remote = [(0, p[0][1], self.devs[k]) for k, p in zip(keys, pages)]
        return "WRITE" if op == "set" else "READ", local, remote

    def run(self, op: str, plan: Any) -> list[bool]:
        """One transfer of the batch."""
        assert self.agent is not None
        xop, local, remote = plan
        self.agent.transfer(xop, local, remote, "DRAM", "OBJ", self.config.timeout_s)
        return [True] * len(local)

    def close(self) -> None:
        """Deregister and drop the agent (the objects stay; the bench's server is temporary)."""
        if self.agent is not None:
            for reg in self.regs:
                self.agent.deregister(reg)
            self.agent.close()
            self.agent = None


def _obj_pairs(opts: BenchOptions, stack: contextlib.ExitStack,
               overrides: dict[str, Any]) -> list[Pair]:
    settings = dict(overrides)
    if not settings.get("endpoint"):
        from hicache_l3.engines import S3Engine

        engine = S3Engine()
        stack.enter_context(engine)
        settings = {**engine.settings, **settings, "endpoint": engine.endpoint}
    config = NixlConfig.load("nixl", settings)
    conn = open_connector("nixl", bench_namespace(opts), settings)
    stack.callback(conn.close)
    raw = RawNixlObj(config)
    stack.callback(raw.close)
    return [Pair(ConnectorTarget(conn, "nixl", mode="obj", checksum=config.use_checksum()), raw)]


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """The nixl connector (file mode, in ``workdir`` unless configured) and raw-nixl;
    with ``nixl.mode=obj``, obj mode and raw-nixl-obj."""
    overrides = dict(opts.settings.get("nixl", {}))
    if NixlConfig.load("nixl", {"root": "-", "bucket": "-", **overrides}).mode == "obj":
        return _obj_pairs(opts, stack, overrides)
    settings: dict[str, Any] = {
        "mode": "file",
        "root": str(opts.workdir / "nixl-store"),
        "capacity_bytes": opts.pages * Geometry(opts.page_bytes).stride,
    }
    settings.update(overrides)
    config = NixlConfig.load("nixl", settings)
    conn = open_connector("nixl", bench_namespace(opts), settings)
    stack.callback(conn.close)
    raw = RawNixl(opts.workdir / "raw-nixl.dat", opts.pages * opts.page_bytes, config.posix_engine)
    stack.callback(raw.close)
    return [Pair(ConnectorTarget(conn, "nixl", mode=config.mode,
                                 posix_engine=config.posix_engine), raw)]
