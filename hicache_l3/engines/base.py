"""What every engine launcher shares: free ports, waiting for a URL, finding an executable,
:class:`ManagedProcess` (a child stopped by PID) and the :class:`Engine` base class (a work
directory and the processes it started, the loopback shim preloaded into each)."""

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

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines.loopback import preload_env


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
        on the wildcard address binds loopback instead: :mod:`hicache_l3.engines.loopback`)."""
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
