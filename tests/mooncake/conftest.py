"""Fixtures of the Mooncake engine tests: engines, namespaces, client worker processes."""

from __future__ import annotations

import json
import select
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace

WORKER = Path(__file__).with_name("mc_worker.py")


@pytest.fixture
def namespace() -> Namespace:
    """A namespace unique to the test."""
    return Namespace(model="mooncake-tests", kv_dtype="bfloat16", layout="page_first",
                     page_size=16, tag=f"t{uuid.uuid4().hex[:12]}")


class Worker:
    """A separate client process (``mc_worker.py``) driven over stdin/stdout."""

    def __init__(self, settings: dict[str, Any], namespace: Namespace, log: Path) -> None:
        self.log = log
        self._err = open(log, "wb")  # noqa: SIM115 - closed in stop()
        ns = json.dumps(namespace.fields() | {"tp_rank": namespace.tp_rank})
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(settings), ns],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
        )
        assert self._read(60.0) == {"ready": True}

    def _read(self, timeout: float) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"worker {self.proc.pid} did not answer within {timeout}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited ({self.proc.poll()}):\n{self.tail()}")
        return json.loads(line)

    def request(self, op: str, keys: list[str], page_bytes: int = 16 << 10,
                timeout: float = 60.0) -> list[bool]:
        """Run one op in the worker; per-key results."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, "keys": keys, "page_bytes": page_bytes}) + "\n")
        self.proc.stdin.flush()
        results: list[bool] = self._read(timeout)["results"]
        return results

    def tail(self) -> str:
        """The last lines of the worker's stderr."""
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        """Close stdin (the worker closes its connector and exits); kill if it hangs."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(15)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait(10)
        self._err.close()


@pytest.fixture
def spawn_worker(tmp_path: Path) -> Iterator[Any]:
    """Factory of :class:`Worker` processes, all stopped at teardown."""
    workers: list[Worker] = []

    def factory(settings: dict[str, Any], namespace: Namespace) -> Worker:
        w = Worker(settings, namespace, tmp_path / f"worker-{len(workers)}.log")
        workers.append(w)
        return w

    yield factory
    for w in workers:
        w.stop()

