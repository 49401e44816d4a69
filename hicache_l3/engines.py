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
import uuid
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


# glusterd's port: bricks and mounts fetch their volfiles there, with no way to name another
GLUSTERD_PORT = 24007
GLUSTER_HOSTS_NAME = "hicache-l3-gluster"  # the /etc/hosts name added when none resolves to 127.0.0.1
# What glusterd creates outside its working directory whatever its vol file says (empty):
# removed again by GlusterEngine.stop() when they were not there before its start.
GLUSTERD_FIXED_PATHS = (Path("/var/lib/glusterd/geo-replication/gsyncd_template.conf"),
                        Path("/var/lib/glusterd/geo-replication"), Path("/var/lib/glusterd/ss_brick"),
                        Path("/var/run/gluster/snaps"))


def _resolves_to(name: str, address: str) -> bool:
    """True when ``name``'s IPv4 addresses are exactly ``{address}``."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return False
    return {info[4][0] for info in infos} == {address}


def loopback_host_name(hosts: Path = Path("/etc/hosts")) -> str:
    """A host name that resolves to 127.0.0.1 only (the gluster CLI refuses ``127.0.0.1`` and
    ``localhost`` as a brick's host): this machine's name, its FQDN, or another name of
    127.0.0.1 in ``hosts``; failing those, the line ``127.0.0.1 hicache-l3-gluster`` is
    appended to ``hosts`` (once: an existing line is reused) and that name is returned."""
    candidates = [socket.gethostname(), socket.getfqdn()]
    with contextlib.suppress(OSError):
        for line in hosts.read_text().splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) > 1 and fields[0] == "127.0.0.1":
                candidates += fields[1:]
    for name in candidates:
        if name and name != "localhost" and _resolves_to(name, "127.0.0.1"):
            return name
    try:
        with open(hosts, "a+") as f:
            f.seek(0)
            text = f.read()
            f.write(("" if text.endswith("\n") or not text else "\n")
                    + f"127.0.0.1 {GLUSTER_HOSTS_NAME}  # added by hicache_l3.engines.GlusterEngine\n")
    except OSError as exc:
        raise EngineUnavailableError(f"no host name resolves to 127.0.0.1, and {hosts} cannot "
                                     f"take one: {exc}") from None
    if not _resolves_to(GLUSTER_HOSTS_NAME, "127.0.0.1"):
        raise EngineUnavailableError(f"{GLUSTER_HOSTS_NAME} added to {hosts} but does not "
                                     "resolve to 127.0.0.1 (nsswitch.conf without 'files'?)")
    return GLUSTER_HOSTS_NAME


def _tail(path: Path, n: int = 30) -> str:
    """The last ``n`` lines of a log file ("" if unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _cmdline(pid: int) -> list[str]:
    """A process's argv ([] when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _mounted(path: Path) -> bool:
    """True while ``path`` is a mount point (per /proc/self/mounts)."""
    target = os.path.realpath(path)
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        # mount points escape blanks as octal (\040); the work directories have none
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)
    return False


class GlusterEngine(Engine):
    """A GlusterFS volume with two FUSE mounts of it: two "nodes" sharing one filesystem,
    each with its own client and page cache (what a deployment's nodes see of a
    distributed filesystem). Needs root, ``glusterfs-server`` and ``glusterfs-client``
    (scripts/setup.sh installs them) and ``/dev/fuse``.

    Started here, all in :attr:`workdir` (state, run directory, logs, brick, mount points):
    ``glusterd`` in the foreground (``-N``, a managed child), with a copy of
    ``/etc/glusterfs/glusterd.vol`` whose ``working-directory``, ``run-directory``,
    ``logging-directory``, ``glusterd-sockfile`` and ``snap-brick-path`` point into the
    work directory and which binds ``address``; one volume with a unique name and one
    brick (``workdir/brick``), created with ``force`` and started with GlusterFS's default
    volume options (write-behind, flush-behind, quick-read, md-cache... on: what users get,
    stale pages across mounts included); the brick process (``glusterfsd``, which glusterd
    starts and which is not its child) binds ``address`` too. The volume is mounted twice
    (``mount -t glusterfs HOST:/VOL DIR``) at :attr:`mounts`; :meth:`start` returns once a
    file written through one mount is read through the other.

    ``address`` is the loopback address glusterd and the brick listen on. glusterd must
    listen on port 24007: the bricks it starts fetch their configuration there, with no
    way to name another port. So two engines on one machine need two addresses
    (``127.0.0.2`` for the second), and a system glusterd on 24007 keeps the engine from
    starting (the error says so). For ``127.0.0.1`` the brick's host is a name resolving to
    127.0.0.1 (the CLI refuses the address and ``localhost``): see
    :func:`loopback_host_name`, which, where no name does, appends the line
    ``127.0.0.1 hicache-l3-gluster`` to /etc/hosts (once; later runs reuse it). For another
    loopback address, the host is the address itself (which the CLI accepts).
    ``timeout``: the seconds :meth:`start` waits for glusterd, each mount, and a file to
    show through both mounts.

    Outside the work directory GlusterFS writes a few things it cannot be told to put
    elsewhere: the brick's control socket in ``/var/run/gluster/``, and the empty
    :data:`GLUSTERD_FIXED_PATHS`; :meth:`stop` removes the socket, and those of the paths
    that were not there before :meth:`start` (and are still empty). Nothing goes to
    /var/log/glusterfs (the CLI and the mounts log into the work directory too).

    :meth:`stop` unmounts both mounts (lazily if busy), stops and deletes the volume,
    kills the brick and client processes this engine started (by PID, each checked to
    still be ours) and glusterd, and removes the work directory; idempotent.
    :attr:`timings` has the seconds :meth:`start` and :meth:`stop` took.
    """

    name = "glusterfs"

    def __init__(self, address: str = "127.0.0.1", timeout: float = 60.0) -> None:
        super().__init__()
        self.address = address
        self.timeout = timeout
        self.volume = f"hicache{uuid.uuid4().hex[:12]}"
        self.host = ""  # chosen in start()
        self.brick = self.workdir / "brick"
        self.mounts: tuple[Path, Path] = (self.workdir / "node-a", self.workdir / "node-b")
        self.logs = self.workdir / "logs"
        self.run_dir = self.workdir / "run"
        self.socket_file = self.run_dir / "glusterd.socket"
        self.glusterd: ManagedProcess | None = None
        self.brick_pids: dict[int, list[str]] = {}  # pid -> argv when found
        self.client_pids: dict[int, list[str]] = {}
        self.timings: dict[str, float] = {}
        self._exe: dict[str, str] = {}
        self._created_outside: list[Path] = []
        self._volume_created = False
        self._stopped = False

    @property
    def settings(self) -> dict[str, Any]:
        """The two mount points (node A's and node B's roots), the volume and its host."""
        return {"root_a": str(self.mounts[0]), "root_b": str(self.mounts[1]),
                "volume": self.volume, "host": self.host}

    def gluster(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        """Run the ``gluster`` CLI against this engine's glusterd; its output. Raises
        EngineUnavailableError with the output (and glusterd's log tail) when it fails
        and ``check``."""
        argv = [self._exe.get("gluster", "gluster"), f"--glusterd-sock={self.socket_file}",
                "--mode=script", f"--log-file={self.logs / 'cli.log'}", *args]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            if not check:
                return ""
            raise EngineUnavailableError(f"`gluster {' '.join(args)}` took over {timeout:.0f}s") from None
        out = (done.stdout + done.stderr).strip()
        if check and done.returncode != 0:
            raise EngineUnavailableError(f"`gluster {' '.join(args)}` failed ({done.returncode}): {out}"
                                         f"\n--- glusterd log ---\n{_tail(self.logs / 'glusterd.log')}")
        return out

    def _preflight(self) -> None:
        """What start() needs, each missing piece named."""
        if os.geteuid() != 0:
            raise EngineUnavailableError("the glusterfs engine needs root (glusterd, bricks' "
                                         "trusted xattrs, mount)")
        for exe, package in (("glusterd", "glusterfs-server"), ("gluster", "glusterfs-server"),
                             ("mount.glusterfs", "glusterfs-client"), ("glusterfs", "glusterfs-client"),
                             ("mount", "mount"), ("umount", "mount")):
            found = shutil.which(exe, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin:/usr/bin:/bin")
            if found is None:
                raise EngineUnavailableError(f"{exe} not found: apt-get install {package} "
                                             "(scripts/setup.sh does, as root)")
            self._exe[exe] = found
        if not os.path.exists("/dev/fuse"):
            raise EngineUnavailableError("/dev/fuse is missing: the mounts need FUSE")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((self.address, GLUSTERD_PORT))
            except OSError as exc:
                raise EngineUnavailableError(
                    f"{self.address}:{GLUSTERD_PORT} is taken ({exc}): another glusterd runs there "
                    "(a second engine needs another loopback address, e.g. 127.0.0.2)") from None

    def _write_volfile(self) -> Path:
        """A copy of /etc/glusterfs/glusterd.vol that keeps glusterd's state, sockets and logs
        in the work directory and binds ``address``."""
        text = Path("/etc/glusterfs/glusterd.vol").read_text()
        moved = {"working-directory": self.workdir / "state", "run-directory": self.run_dir,
                 "logging-directory": self.logs, "glusterd-sockfile": self.socket_file,
                 "snap-brick-path": self.workdir / "snaps", "transport.socket.listen-port": GLUSTERD_PORT,
                 "transport.socket.bind-address": self.address}
        lines = [ln for ln in text.splitlines()
                 if not (ln.split()[:2] and ln.split()[0] == "option" and ln.split()[1] in moved)]
        end = max(i for i, ln in enumerate(lines) if ln.strip() == "end-volume")
        lines[end:end] = [f"    option {k} {v}" for k, v in moved.items()]
        for d in ("state", "run", "logs", "snaps"):
            (self.workdir / d).mkdir(exist_ok=True)
        path = self.workdir / "glusterd.vol"
        path.write_text("\n".join(lines) + "\n")
        return path

    def start(self) -> GlusterEngine:
        """Start glusterd, create and start the volume, mount it twice, and wait until a
        file written on node A reads back on node B. Raises EngineUnavailableError naming
        what failed (with the log's tail)."""
        began = time.monotonic()
        self._preflight()
        self.host = loopback_host_name() if self.address == "127.0.0.1" else self.address
        self._created_outside = [p for p in GLUSTERD_FIXED_PATHS if not os.path.lexists(p)]
        volfile = self._write_volfile()
        self.glusterd = self.spawn([self._exe["glusterd"], "-N", "-f", str(volfile),
                                    "-p", str(self.workdir / "glusterd.pid"),
                                    "-l", str(self.logs / "glusterd.log")], "glusterd")
        deadline = time.monotonic() + self.timeout
        while True:
            if not self.glusterd.alive():
                raise EngineUnavailableError(
                    f"glusterd exited with code {self.glusterd.proc.returncode}:\n"
                    f"{_tail(self.logs / 'glusterd.log')}\n{self.glusterd.tail()}")
            if self.socket_file.exists():
                with contextlib.suppress(EngineUnavailableError):
                    self.gluster("volume", "list", timeout=10.0)
                    break
            if time.monotonic() > deadline:
                raise EngineUnavailableError(f"glusterd did not answer on {self.socket_file} within "
                                             f"{self.timeout:.0f}s:\n{_tail(self.logs / 'glusterd.log')}")
            time.sleep(0.05)
        self.gluster("volume", "create", self.volume, f"{self.host}:{self.brick}", "force")
        self._volume_created = True
        self.gluster("volume", "start", self.volume)
        self._find_bricks()
        for mount in self.mounts:
            self._mount(mount)
        self._wait_shared(deadline)
        self.timings["start"] = time.monotonic() - began
        return self

    def _find_bricks(self) -> None:
        """Record the brick processes' PIDs and argv, from the pid files glusterd's run
        directory holds (``run/vols/VOL/*.pid``)."""
        for pidfile in sorted((self.run_dir / "vols").rglob("*.pid")):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().strip())
                argv = _cmdline(pid)
                if argv and str(self.workdir) in " ".join(argv):
                    self.brick_pids[pid] = argv
        if not self.brick_pids:
            raise EngineUnavailableError(f"no brick process of volume {self.volume} found under "
                                         f"{self.run_dir / 'vols'}:\n{_tail(self.logs / 'glusterd.log')}")

    def _mount(self, mount: Path) -> None:
        """``mount -t glusterfs HOST:/VOL mount``; record its client process."""
        mount.mkdir(exist_ok=True)
        log = self.logs / f"mount-{mount.name}.log"
        try:
            done = subprocess.run([self._exe["mount"], "-t", "glusterfs", "-o", f"log-file={log}",
                                   f"{self.host}:/{self.volume}", str(mount)],
                                  capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise EngineUnavailableError(f"mounting {self.volume} on {mount} took over "
                                         f"{self.timeout:.0f}s:\n{_tail(log)}") from None
        for pid in self._clients_of(mount):
            self.client_pids[pid] = _cmdline(pid)
        if done.returncode != 0 or not _mounted(mount):
            raise EngineUnavailableError(
                f"mount -t glusterfs {self.host}:/{self.volume} {mount} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr).strip()}\n--- {log.name} ---\n{_tail(log)}")

    @staticmethod
    def _clients_of(mount: Path) -> list[int]:
        """PIDs of the ``glusterfs`` client processes serving ``mount`` (argv ends with it)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                argv = _cmdline(int(entry.name))
                if argv and os.path.basename(argv[0]) == "glusterfs" and argv[-1] == str(mount):
                    pids.append(int(entry.name))
        return pids

    def _wait_shared(self, deadline: float) -> None:
        """Wait until a file written through node A reads back, same bytes, through node B."""
        probe = f".probe-{uuid.uuid4().hex}"
        payload = os.urandom(64)
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                (self.mounts[0] / probe).write_bytes(payload)
                if (self.mounts[1] / probe).read_bytes() == payload:
                    (self.mounts[1] / probe).unlink()
                    return
            except OSError as exc:
                last = exc
            time.sleep(0.1)
        raise EngineUnavailableError(
            f"a file written on {self.mounts[0]} did not read back on {self.mounts[1]} "
            f"within {self.timeout:.0f}s ({last})\n--- mount logs ---\n"
            + "\n".join(_tail(self.logs / f"mount-{m.name}.log", 10) for m in self.mounts))

    def _kill_ours(self, pids: dict[int, list[str]], grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds, each PID still running the argv
        recorded for it (so that a reused PID is left alone)."""
        live = [pid for pid, argv in pids.items() if _cmdline(pid) == argv]
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while live and time.monotonic() < deadline:
            live = [pid for pid in live if _cmdline(pid) == pids[pid]]
            time.sleep(0.05)
        for pid in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Unmount both mounts (lazily when busy), stop and delete the volume, stop the
        brick, client and glusterd processes, remove the brick's socket and the work
        directory. Idempotent; raises EngineUnavailableError at the end if a mount point
        could not be unmounted (the work directory is then left, and calling stop() again
        tries again)."""
        if self._stopped:
            return
        began = time.monotonic()
        for mount in self.mounts:
            for pid in self._clients_of(mount):  # a client started since (or missed by) start()
                self.client_pids.setdefault(pid, _cmdline(pid))
            if _mounted(mount):
                umount = self._exe.get("umount", "umount")
                done = subprocess.run([umount, str(mount)], capture_output=True, timeout=60)
                if done.returncode != 0 and _mounted(mount):  # busy: detach now, gone when closed
                    subprocess.run([umount, "-l", str(mount)], capture_output=True, timeout=60)
        if self._volume_created and self.glusterd is not None and self.glusterd.alive():
            self._find_bricks_quietly()
            self.gluster("volume", "stop", self.volume, "force", check=False)
            self.gluster("volume", "delete", self.volume, check=False)
        self._kill_ours(self.client_pids)
        self._kill_ours(self.brick_pids)
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        for argv in self.brick_pids.values():
            if "-S" in argv[:-1]:
                sock = Path(argv[argv.index("-S") + 1])
                if str(sock.parent) in ("/var/run/gluster", "/run/gluster"):
                    sock.unlink(missing_ok=True)
        for path in self._created_outside:  # files first, then their directories
            with contextlib.suppress(OSError):  # gone, or not empty: someone else's now
                if path.is_dir() and not path.is_symlink():
                    path.rmdir()
                elif path.is_file() and path.stat().st_size == 0:
                    path.unlink()
        self._created_outside = []
        still = [m for m in self.mounts if _mounted(m)]
        self.timings["stop"] = time.monotonic() - began
        if not still:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self._stopped = True
        else:  # a later stop() tries again
            raise EngineUnavailableError(f"could not unmount {', '.join(map(str, still))}; "
                                         f"{self.workdir} left in place")

    def _find_bricks_quietly(self) -> None:
        """:meth:`_find_bricks` without raising (stop() after a half-done start)."""
        with contextlib.suppress(EngineUnavailableError):
            self._find_bricks()


ENGINES["glusterfs"] = GlusterEngine
