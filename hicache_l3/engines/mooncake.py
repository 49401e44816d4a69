"""The local Mooncake Store launcher: ``mooncake_master`` and a segment holder on loopback."""

from __future__ import annotations

import contextlib
import sys
import time
import urllib.request
from typing import Any

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines import loopback
from hicache_l3.engines.base import Engine, ManagedProcess, find_executable, free_port, wait_http


class MooncakeEngine(Engine):
    """A local Mooncake Store: ``mooncake_master`` (RPC, embedded HTTP metadata server and
    metrics/health server, each on a free loopback port) plus, with ``holder=True``, a
    ``mooncake_client`` that contributes a ``segment_size`` memory segment, so that pages
    outlive every connector (as in a deployment where SGLang's side holds no segment).

    ``master_flags`` adds ``mooncake_master`` flags (e.g. ``{"default_kv_lease_ttl": "200"}``).
    Every process started here has the loopback shim preloaded
    (:mod:`hicache_l3.engines.loopback`): the master's embedded HTTP metadata server, which
    binds 0.0.0.0 whatever host it is given, then binds 127.0.0.1. Without the shim (no C
    compiler at install time) the metadata is served instead by
    :mod:`hicache_l3.engines.mooncake_metadata` on 127.0.0.1 (the suite saw intermittent transfer
    failures under heavy load with it, not with the embedded one). Clients are started with
    ``MC_TCP_BIND_ADDRESS=127.0.0.1``, so they advertise loopback. A client's transfer
    engine listens on all interfaces (its handshake port on 0.0.0.0, its TCP data port on
    ``[::]``) and Mooncake has no setting to change that: every process started here has
    the loopback shim preloaded (:mod:`hicache_l3.engines.loopback`), so the holder listens
    on loopback only. The transfer engine inside a connector's own process (the test's,
    SGLang's) stays on all interfaces unless that process was started with the shim
    (README "Security").
    :meth:`kill_master`, :meth:`restart_master` and :meth:`kill_holder` are for fault tests.
    """

    name = "mooncake"

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
        self.master: ManagedProcess | None = None
        self.metadata_proc: ManagedProcess | None = None
        self._own_metadata = loopback.SHIM is None  # the shim keeps the master's on loopback
        self.holder_proc: ManagedProcess | None = None
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
            self.metadata_proc = self.spawn([
                sys.executable, "-m", "hicache_l3.engines.mooncake_metadata",
                "--host=127.0.0.1", f"--port={self.http_port}",
            ], "metadata_server")
            wait_http(f"http://127.0.0.1:{self.http_port}/health", 20.0, self.metadata_proc.proc)
        self.start_master()
        if self.holder:
            self.holder_proc = self.spawn([
                find_executable("mooncake_client"), "--host=127.0.0.1",
                f"--global_segment_size={self.segment_size}",
                f"--master_server_address={self.master_address}",
                f"--metadata_server={self.metadata_server}",
                f"--port={self.holder_port}",
            ], "mooncake_client", env=self._env)
            self.wait_capacity(1, timeout=20.0, proc=self.holder_proc)
        return self

    def start_master(self) -> None:
        """Start ``mooncake_master`` on this engine's ports and wait for ``/health``."""
        argv = [
            find_executable("mooncake_master"),
            f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
            *(["--enable_http_metadata_server=false"] if self._own_metadata else [
                "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}"]),
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            *(f"--{k}={v}" for k, v in self.master_flags.items()),
        ]
        self.master = self.spawn(argv, "mooncake_master", env=self._env)
        try:
            wait_http(self.metrics_url + "/health", 20.0, self.master.proc)
        except EngineUnavailableError as exc:
            tail = self.master.tail()
            raise EngineUnavailableError(f"{exc}\n--- mooncake_master log ---\n{tail}") from None

    def metric(self, name: str) -> float:
        """One unlabelled value of the master's Prometheus ``/metrics`` (0 if absent)."""
        with urllib.request.urlopen(self.metrics_url + "/metrics", timeout=2.0) as resp:
            for line in resp.read().decode(errors="replace").splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0

    def wait_capacity(self, minimum: float, timeout: float,
                      proc: ManagedProcess | None = None) -> None:
        """Wait until the master counts at least ``minimum`` bytes of mounted segments."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None and not proc.alive():
                raise EngineUnavailableError(
                    f"{proc.name} exited with code {proc.proc.returncode}:\n{proc.tail()}")
            with contextlib.suppress(OSError):
                if self.metric("master_total_capacity_bytes") >= minimum:
                    return
            time.sleep(0.1)
        raise EngineUnavailableError(f"no segment mounted at {self.master_address} within {timeout:.0f}s")

    def kill_master(self) -> None:
        """SIGKILL the master (clients see -900 until it is back)."""
        if self.master is not None:
            self.master.kill()
            self.master.proc.wait(10)
            self.master.stop()
            self.processes.remove(self.master)
            self.master = None

    def restart_master(self) -> None:
        """Start the master again on the same ports (its index starts empty)."""
        if self.master is None:
            self.start_master()

    def kill_holder(self) -> None:
        """SIGKILL the segment holder."""
        if self.holder_proc is not None:
            self.holder_proc.kill()
            self.holder_proc.proc.wait(10)

