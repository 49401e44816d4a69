"""Bench backend ``nixl``: the nixl connector against raw NIXL. File mode (default): raw-nixl,
its own POSIX-plugin agent with the connector's ``posix_engine`` on one file, one transfer per
batch with adjacent pages joined (:func:`coalesce`, as the connector does); the connector's
capacity is one repetition's pages. ``--set nixl.mode=obj``: obj mode against a local
``moto_server`` (unless ``nixl.endpoint`` is set) and raw-nixl-obj, one object per page.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hicache_l3.bench.backend_file import RawPosix
from hicache_l3.bench.targets import BenchOptions, BenchTarget, ConnectorTarget, Pair, bench_namespace
from hicache_l3.common.memory import HostBuffer, MemoryRegion
from hicache_l3.common.pages import Page
from hicache_l3.common.registry import open_connector
from hicache_l3.connectors.nixl.base import Agent, NixlConfig, coalesce
from hicache_l3.slab.format import Geometry


class RawNixl(RawPosix):
    """The machine's limit through NIXL: one POSIX-plugin transfer per batch on raw-posix's file."""

    backend = "raw-nixl"

    def __init__(self, path: Path, size: int, engine: str) -> None:
        super().__init__(path, size)
        self.engine = engine
        self.extra = {"posix_engine": engine}
        self.agent: Agent | None = None
        self.file_reg: Any = None

    def prepare(self, buffers: Sequence[MemoryRegion], page_bytes: int) -> None:
        """Write the file; create the agent, register the buffers and the file once."""
        from hicache_l3.connectors.nixl.file import posix_params

        super().prepare(buffers, page_bytes)
        self.agent = Agent("POSIX", posix_params(self.engine))
        for b in buffers:
            self.agent.register_dram(b)
        self.file_reg = self.agent.register([(0, self.size, self.fd, "")], "FILE")

    def plan(self, op: str, keys: list[str], pages: list[Page]) -> Any:
        """The batch's DRAM and FILE descriptor lists (built before the clock)."""
        import numpy as np

        assert self.agent is not None
        local, remote = [], []
        for page in pages:
            offset = self._offset(page)
            for address, length in page:
                local.append((address, length, 0))
                remote.append((offset, length, self.fd))
                offset += length
        local, remote = coalesce(local, remote)
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
        """Deregister and drop the agent, then close and remove the file."""
        if self.agent is not None:
            if self.file_reg is not None:
                self.agent.deregister(self.file_reg)
            self.agent.close()
            self.agent = None
        super().close()


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


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """The nixl connector (file mode, in ``workdir`` unless configured) and raw-nixl;
    with ``nixl.mode=obj``, obj mode and raw-nixl-obj."""
    settings: dict[str, Any] = dict(opts.settings.get("nixl", {}))
    obj = NixlConfig.load("nixl", {"root": "-", "bucket": "-", **settings}).mode == "obj"
    if not obj:
        settings = {"mode": "file", "root": str(opts.workdir / "nixl-store"),
                    "capacity_bytes": opts.pages * Geometry(opts.page_bytes).stride, **settings}
    elif not settings.get("endpoint"):
        from hicache_l3.engines import S3Engine

        engine = S3Engine()
        stack.enter_context(engine)
        settings = {**engine.settings, **settings, "endpoint": engine.endpoint}
    config = NixlConfig.load("nixl", settings)
    conn = open_connector("nixl", bench_namespace(opts.page_bytes, "bench-nixl"), settings)
    stack.callback(conn.close)
    raw: BenchTarget
    if obj:
        raw, extra = RawNixlObj(config), {"mode": "obj", "checksum": config.use_checksum()}
    else:
        raw = RawNixl(opts.workdir / "raw-nixl.dat", opts.pages * opts.page_bytes, config.posix_engine)
        extra = {"mode": config.mode, "posix_engine": config.posix_engine}
    stack.callback(raw.close)
    return [Pair(ConnectorTarget(conn, "nixl", **extra), raw)]
