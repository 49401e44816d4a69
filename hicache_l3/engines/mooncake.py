"""The local Mooncake Store launcher: ``mooncake_master`` and a segment holder on loopback."""

from __future__ import annotations

import sys
import urllib.request
from typing import Any

from hicache_l3.engines import loopback
from hicache_l3.engines.base import Engine, Process, find_executable, free_port, wait_http, wait_until


class MooncakeEngine(Engine):
    """A local Mooncake Store: ``mooncake_master`` (RPC, HTTP metadata and metrics servers,
    each on a free loopback port) plus, with ``holder=True``, a ``mooncake_client`` holding a
    ``segment_size`` memory segment, so pages outlive every connector. ``master_flags`` adds
    ``mooncake_master`` flags. Every process listens on loopback only (the loopback shim;
    without it the metadata is served by :mod:`hicache_l3.engines.mooncake_metadata`).
    :meth:`kill_master`, :meth:`restart_master` and :meth:`kill_holder` are for fault tests.
    """

    name = "mooncake"
    start_timeout = 20.0  # seconds each process gets to answer

    def __init__(self, holder: bool = True, segment_size: str = "1 GB",
                 master_flags: dict[str, str] | None = None) -> None:
        super().__init__()
        self.holder = holder
        self.segment_size = segment_size
        self.master_flags = dict(master_flags or {})
        self.rpc_port = free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.holder_port = free_port()
        self.master: Process | None = None
        self.metadata_proc: Process | None = None
        self._own_metadata = loopback.SHIM is None  # the master's own binds 0.0.0.0 without the shim
        self.holder_proc: Process | None = None
        self._env = {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    @property
    def master_address(self) -> str:
        """``host:port`` of the master's RPC service."""
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """URL of the loopback HTTP metadata server."""
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def metrics_url(self) -> str:
        """Base URL of the master's metrics server (``/health``, ``/metrics``)."""
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def settings(self) -> dict[str, Any]:
        """Mooncake connector settings reaching this master (no segment of its own when a
        holder runs, so the connector's pages live in the holder)."""
        return {
            "master_address": self.master_address,
            "metadata_server": self.metadata_server,
            "protocol": "tcp",
            "local_hostname": "127.0.0.1",
            "global_segment_size": 0 if self.holder else 64 << 20,
        }

    def start(self) -> MooncakeEngine:
        """Start the metadata server, the master (and the holder); wait for each to answer."""
        if self._own_metadata:
            self.metadata_proc = self._run_metadata()
        self.start_master()
        if self.holder:
            self.holder_proc = self._run_holder()
            self.wait_capacity(1, timeout=self.start_timeout, proc=self.holder_proc)
        return self

    def start_master(self) -> None:
        """Start the master on this engine's ports and wait for ``/health``."""
        self.master = self._run_master()

    def _run_metadata(self) -> Process:
        proc = self.spawn([sys.executable, "-m", "hicache_l3.engines.mooncake_metadata",
                           "--host=127.0.0.1", f"--port={self.http_port}"], "metadata_server")
        wait_http(f"http://127.0.0.1:{self.http_port}/health", self.start_timeout, proc)
        return proc

    def _run_master(self) -> Process:
        argv = [
            find_executable("mooncake_master"),
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            *(["--enable_http_metadata_server=false"] if self._own_metadata else [
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}"]),
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            *(f"--{k}={v}" for k, v in self.master_flags.items()),
        ]
        proc = self.spawn(argv, "mooncake_master", env=self._env)
        wait_http(self.metrics_url + "/health", self.start_timeout, proc)
        return proc

    def _run_holder(self) -> Process:
        return self.spawn([find_executable("mooncake_client"), "--host=127.0.0.1", *self._holder_args()],
                          "mooncake_client", env=self._env)

    def _holder_args(self) -> list[str]:
        return [f"--global_segment_size={self.segment_size}",
                f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_server}", f"--port={self.holder_port}"]

    def metric(self, name: str) -> float:
        """One unlabelled value of the master's Prometheus ``/metrics`` (0 if absent)."""
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=2.0) as resp:
            for line in resp.read().decode(errors="replace").splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def wait_capacity(self, minimum: float, timeout: float,
                      proc: Process | None = None) -> None:
        """Wait until the master counts at least ``minimum`` bytes of mounted segments
        (EngineUnavailableError on timeout, or when ``proc`` exits first)."""
        wait_until(lambda: self.metric("master_total_capacity_bytes") >= minimum, timeout,
                   f"a segment mounted at {self.master_address}", proc, interval=0.1)

    def kill_master(self) -> None:
        """SIGKILL the master (clients see -900 until it is back)."""
        if self.master is not None:
            self.master.kill()
            self.master.stop()
            self.processes.remove(self.master)
            self.master = None

    def restart_master(self) -> None:
        """Start the master again on the same ports (its index starts empty)."""
        if self.master is None:
            self.start_master()

    def kill_holder(self) -> None:
        """SIGKILL the segment holder."""
        holder = self.holder_proc
        if holder is not None:
            holder.kill()
            wait_until(lambda: not holder.alive(), 10.0, "the killed holder to exit")
