"""What every engine launcher shares: free ports, polling until ready, finding executables,
:class:`ManagedProcess` (a child stopped by PID) and the :class:`Engine` base class."""

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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from hicache_l3.common.errors import EngineUnavailableError
from hicache_l3.engines.loopback import preload_env

T = TypeVar("T")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def tail_file(path: Path, n: int = 40) -> str:
    """The last ``n`` lines of a text file ("" if unreadable)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class Process(Protocol):
    """What an engine tracks of each process it started: a :class:`ManagedProcess`, or a
    container (:mod:`hicache_l3.engines.containers`)."""

    name: str

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def stop(self) -> None: ...

    def tail(self, n: int = 40) -> str: ...


def wait_until(ready: Callable[[], T | None], timeout: float, what: str,
               proc: Process | None = None, interval: float = 0.05) -> T:
    """Call ``ready`` until it returns a true value, and return that; an exception other than
    EngineUnavailableError counts as not ready. EngineUnavailableError naming ``what`` (the
    awaited state) after ``timeout`` s, or at once when ``proc`` exits; with ``proc``'s output."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while True:
        if proc is not None and not proc.alive():
            code = f" with code {proc.proc.returncode}" if isinstance(proc, ManagedProcess) else ""
            raise EngineUnavailableError(f"{proc.name} exited{code} while waiting for {what}:\n{proc.tail()}")
        try:
            value = ready()
            if value:
                return value
        except EngineUnavailableError:
            raise
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise EngineUnavailableError(f"timed out after {timeout:.0f}s waiting for {what}"
                                         + (f" ({last})" if last else "")
                                         + (f"\n--- {proc.name} log ---\n{proc.tail()}" if proc else ""))
        time.sleep(interval)


def answers(url: str) -> bool:
    """True when GET ``url`` answers 2xx within a second; raises otherwise."""
    with urllib.request.urlopen(url, timeout=1.0):
        return True


def wait_http(url: str, timeout: float, proc: Process | None = None) -> None:
    """Poll ``url`` until it answers 2xx. EngineUnavailableError on timeout, or when
    ``proc`` exits first."""
    wait_until(lambda: answers(url), timeout, f"{url} to answer", proc)


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
    """A child process in its own session, with its output in ``log_dir/NAME.log``;
    :meth:`stop` ends it by PID (SIGTERM, then SIGKILL after ``grace`` seconds)."""

    def __init__(self, argv: list[str], log_dir: Path, name: str,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})

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
        """The last ``n`` lines of the process's output."""
        return tail_file(self.log_path, n)


class Engine:
    """Base of the engine launchers, a context manager: :meth:`start` on enter, :meth:`stop`
    on exit (or when start fails); a temporary work directory and the processes started."""

    name = "engine"

    def __init__(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"hicache-l3-{self.name}-"))
        self.processes: list[Process] = []

    @property
    def settings(self) -> dict[str, Any]:
        """Connector settings that reach this engine."""
        raise NotImplementedError

    def start(self) -> Engine:
        """Start the engine's processes and wait until they answer."""
        raise NotImplementedError

    def spawn(self, argv: list[str], name: str, env: dict[str, str] | None = None) -> ManagedProcess:
        """Start and track one process, with the loopback shim preloaded (wildcard binds
        become loopback binds: :mod:`hicache_l3.engines.loopback`)."""
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
