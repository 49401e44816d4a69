"""Start and stop the real engines the suite and the bench run against.

Each engine is a context manager that starts local processes on free loopback ports,
waits until they answer, exposes the connector settings to reach them
(:attr:`Engine.settings`), and stops them by PID on exit, leaving nothing behind.
``hicache-l3 engines up NAME`` runs one in the foreground for development.

Engines: see :data:`ENGINES` (each added by its connector's work).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from hicache_l3.common import loopback
from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.common.loopback import preload_env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> str:
    """Poll ``url`` until it answers 2xx; returns the body. Raises EngineUnavailableError
    naming the URL (and the process's exit code, if it died) on timeout."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise EngineUnavailableError(f"process for {url} exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                body: str = resp.read().decode(errors="replace")
                return body
        except Exception as exc:
            last = exc
            time.sleep(0.05)
    raise EngineUnavailableError(f"{url} did not answer within {timeout:.0f}s: {last}")


def find_executable(name: str) -> str:
    """Path of ``name`` next to this Python (a venv's bin/) or on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise EngineUnavailableError(f"{name} not found next to {sys.executable} or on PATH")
    return found


class ManagedProcess:
    """A child process in its own session, with its output in a log file; stopped by PID
    (SIGTERM, then SIGKILL after ``grace`` seconds) on :meth:`stop`."""

    def __init__(self, argv: list[str], log_dir: Path, name: str,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    @property
    def pid(self) -> int:
        """The child's PID."""
        return self.proc.pid

    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the process group (tests use it to simulate crashes)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """Terminate, wait, kill if needed; idempotent."""
        if self.alive():
            self.kill(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(grace)
        self._log.close()

    def tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the process's output (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Engine:
    """Base of the engine launchers: a temporary work directory and managed processes."""

    name = "engine"

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"hicache-l3-{self.name}-"))
        self.processes: list[ManagedProcess] = []

    @property
    def settings(self) -> dict[str, Any]:
        """Connector settings that reach this engine."""
        raise NotImplementedError

    def start(self) -> Engine:
        """Start the engine's processes and wait until they answer."""
        raise NotImplementedError

    def spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> ManagedProcess:
        """Start and track one process, with the loopback shim preloaded (a listener it opens
        on the wildcard address binds loopback instead: :mod:`hicache_l3.common.loopback`)."""
        proc = ManagedProcess(argv, self.workdir, name, {**preload_env(), **(env or {})})
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        """Stop every process (last started first) and remove the work directory."""
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Engine:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


# name -> Engine subclass; each connector's work adds its engine here.
ENGINES: dict[str, type[Engine]] = {}


def add_arguments(parser: Any) -> None:
    """``hicache-l3 engines up NAME``: arguments."""
    parser.add_argument("action", choices=["up"], help="'up': start and run until Ctrl-C")
    parser.add_argument("engine", help="engine to start: " + ", ".join(sorted(ENGINES) or ["(none)"]))


def run(args: Any) -> int:
    """Start an engine, print its settings as TOML, and run until interrupted."""
    cls = ENGINES.get(args.engine)
    if cls is None:
        print(f"unknown engine {args.engine!r}; choose one of {sorted(ENGINES)}", file=sys.stderr)
        return 2
    with cls() as engine:
        print(f"# {engine.name} is up; connector settings:")
        for key, value in engine.settings.items():
            print(f"{key} = {value!r}")
        print("# Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(p.alive() for p in engine.processes):
                time.sleep(0.5)
    return 0


class MooncakeEngine(Engine):
    """A local Mooncake Store: ``mooncake_master`` (RPC, embedded HTTP metadata server and
    metrics/health server, each on a free loopback port) plus, with ``holder=True``, a
    ``mooncake_client`` that contributes a ``segment_size`` memory segment, so that pages
    outlive every connector (as in a deployment where SGLang's side holds no segment).

    ``master_flags`` adds ``mooncake_master`` flags (e.g. ``{"default_kv_lease_ttl": "200"}``).
    Every process started here has the loopback shim preloaded
    (:mod:`hicache_l3.common.loopback`): the master's embedded HTTP metadata server, which
    binds 0.0.0.0 whatever host it is given, then binds 127.0.0.1. Without the shim (no C
    compiler at install time) the metadata is served instead by
    :mod:`hicache_l3.metadata_server` on 127.0.0.1 (the suite saw intermittent transfer
    failures under heavy load with it, not with the embedded one). Clients are started with
    ``MC_TCP_BIND_ADDRESS=127.0.0.1``, so they advertise loopback. A client's transfer
    engine listens on all interfaces (its handshake port on 0.0.0.0, its TCP data port on
    ``[::]``) and Mooncake has no setting to change that: every process started here has
    the loopback shim preloaded (:mod:`hicache_l3.common.loopback`), so the holder listens
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
                sys.executable, "-m", "hicache_l3.metadata_server",
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


ENGINES["mooncake"] = MooncakeEngine


class S3Engine(Engine):
    """A local S3 server: ``moto_server`` (from the ``moto[server]`` package, next to this
    Python) on a free loopback port, with one bucket created through boto3. Its
    :attr:`settings` open the nixl connector in OBJ mode against it (test credentials
    that moto accepts). :meth:`client` is a boto3 client on it, for tests' backdoors.
    """

    name = "s3"

    def __init__(self, bucket: str = "hicache-l3") -> None:
        super().__init__()
        self.bucket = bucket
        self.port = free_port()
        self.access_key = "hicache-test-key"
        self.secret_key = "hicache-test-secret"

    @property
    def endpoint(self) -> str:
        """The server's URL."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> dict[str, Any]:
        """nixl connector settings (OBJ mode) reaching this server's bucket."""
        return {
            "mode": "obj", "endpoint": self.endpoint, "bucket": self.bucket,
            "region": "us-east-1", "scheme": "http", "virtual_addressing": False,
            "access_key": self.access_key, "secret_key": self.secret_key,
        }

    def client(self) -> Any:
        """A boto3 S3 client on this server (boto3 comes with ``moto[server]``)."""
        try:
            import boto3
        except ImportError as exc:
            raise EngineUnavailableError("the s3 engine needs boto3: pip install 'moto[server]'") from exc
        return boto3.client(
            "s3", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.access_key, aws_secret_access_key=self.secret_key,
        )

    def start(self) -> S3Engine:
        """Start moto_server, wait until it answers, create the bucket."""
        proc = self.spawn([find_executable("moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
                          "moto_server")
        wait_http(f"{self.endpoint}/moto-api/", timeout=30.0, proc=proc.proc)
        self.client().create_bucket(Bucket=self.bucket)
        return self


ENGINES["s3"] = S3Engine
