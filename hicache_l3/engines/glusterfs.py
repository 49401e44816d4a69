"""The local GlusterFS launcher: one volume on loopback, mounted twice (two "nodes")."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines.base import Engine, ManagedProcess, tail_file, wait_until

GLUSTERD_PORT = 24007  # fixed: bricks and mounts fetch their volfiles there
GLUSTER_HOSTS_NAME = "hicache-l3-gluster"  # the /etc/hosts name added when none resolves to 127.0.0.1
# What glusterd creates outside its working directory whatever its vol file says (empty);
# stop() removes those it created.
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
    """A host name resolving to 127.0.0.1 only (the gluster CLI refuses ``127.0.0.1`` and
    ``localhost`` as a brick's host): this machine's name, its FQDN or another name of
    127.0.0.1 in ``hosts``; else ``127.0.0.1 hicache-l3-gluster`` is appended to ``hosts``
    (once) and that name returned."""
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
    """A GlusterFS volume mounted twice (FUSE): two "nodes" sharing one filesystem, each
    with its own client and page cache. Needs root, ``glusterfs-server``,
    ``glusterfs-client`` and ``/dev/fuse``.

    glusterd (a child, ``-N``), its state, logs, the brick and the mount points all live in
    :attr:`workdir`; glusterd and the brick bind ``address``. glusterd must use port 24007,
    so a second engine on one machine needs another loopback address (``127.0.0.2``).
    :meth:`start` returns once a file written through one mount reads back through the
    other (each wait up to ``timeout`` s). :meth:`stop` unmounts, deletes the volume, kills
    the processes this engine started (by PID, each checked to be still ours) and removes
    the work directory and what GlusterFS wrote outside it; idempotent. :attr:`timings`
    has the seconds start and stop took.
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
        """Run the ``gluster`` CLI against this engine's glusterd; its output. With ``check``,
        EngineUnavailableError (with glusterd's log tail) when it fails."""
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
                                         f"\n--- glusterd log ---\n{tail_file(self.logs / 'glusterd.log')}")
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
        """A copy of /etc/glusterfs/glusterd.vol with state, sockets and logs in the work
        directory, binding ``address``."""
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
        try:
            wait_until(self._glusterd_answers, self.timeout, f"glusterd on {self.socket_file}", self.glusterd)
        except EngineUnavailableError as exc:
            log = tail_file(self.logs / "glusterd.log")
            raise EngineUnavailableError(f"{exc}\n--- glusterd.log ---\n{log}") from None
        self.gluster("volume", "create", self.volume, f"{self.host}:{self.brick}", "force")
        self._volume_created = True
        self.gluster("volume", "start", self.volume)
        self._find_bricks()
        for mount in self.mounts:
            self._mount(mount)
        self._wait_shared(deadline)
        self.timings["start"] = time.monotonic() - began
        return self

    def _glusterd_answers(self) -> bool:
        if not self.socket_file.exists():
            return False
        try:
            self.gluster("volume", "list", timeout=10.0)
        except EngineUnavailableError:
            return False
        return True

    def _find_bricks(self) -> None:
        """Record the brick processes' PIDs and argv (from ``run/vols/VOL/*.pid``)."""
        for pidfile in sorted((self.run_dir / "vols").rglob("*.pid")):
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text().strip())
                argv = _cmdline(pid)
                if argv and str(self.workdir) in " ".join(argv):
                    self.brick_pids[pid] = argv
        if not self.brick_pids:
            raise EngineUnavailableError(f"no brick process of volume {self.volume} found under "
                                         f"{self.run_dir / 'vols'}:\n{tail_file(self.logs / 'glusterd.log')}")

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
                                         f"{self.timeout:.0f}s:\n{tail_file(log)}") from None
        for pid in self._clients_of(mount):
            self.client_pids[pid] = _cmdline(pid)
        if done.returncode != 0 or not _mounted(mount):
            raise EngineUnavailableError(
                f"mount -t glusterfs {self.host}:/{self.volume} {mount} failed ({done.returncode}): "
                f"{(done.stdout + done.stderr).strip()}\n--- {log.name} ---\n{tail_file(log)}")

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
        probe, payload = f".probe-{uuid.uuid4().hex}", os.urandom(64)

        def shared() -> bool:
            (self.mounts[0] / probe).write_bytes(payload)
            return (self.mounts[1] / probe).read_bytes() == payload

        try:
            wait_until(shared, max(0.0, deadline - time.monotonic()),
                       f"a file written on {self.mounts[0]} to read back on {self.mounts[1]}", interval=0.1)
        except EngineUnavailableError as exc:
            raise EngineUnavailableError(f"{exc}\n--- mount logs ---\n" + "\n".join(
                tail_file(self.logs / f"mount-{m.name}.log", 10) for m in self.mounts)) from None
        (self.mounts[1] / probe).unlink()

    def _kill_ours(self, pids: dict[int, list[str]], grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``grace`` s, each PID still running its recorded argv."""
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
        """Unmount (lazily when busy), delete the volume, stop every process, remove the
        brick's socket and the work directory. Idempotent; EngineUnavailableError at the end
        if a mount point stays mounted (the work directory is left; stop() again retries)."""
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
            with contextlib.suppress(EngineUnavailableError):  # after a half-done start
                self._find_bricks()
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

