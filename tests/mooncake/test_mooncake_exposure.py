"""What a local Mooncake deployment started by the launcher exposes: every listening TCP
socket of the metadata server, the master, the segment holder, a connector in a process
started with the loopback shim, and this test's own process, from ``ss -ltnp`` (issue 13).

Everything binds loopback, except in this test's own process (started without the shim):
there Mooncake's transfer engine listens on its handshake port (0.0.0.0) and its TCP data
port (``[::]``), which Mooncake offers no setting to bind (README "Security"). The test
fails on any other non-loopback socket, and on more than those two.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

import pytest

from hicache_l3.common import loopback
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.engines import MooncakeEngine

_USER = re.compile(r'\("([^"]+)",pid=(\d+)')
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
# the transfer engine's sockets that cannot be bound (see the module docstring)
TRANSFER_ENGINE_PORTS = range(12000, 18000)


def listening(pids: set[int]) -> list[tuple[str, int, str, int]]:
    """(host, port, process name, pid) of every listening TCP socket of ``pids``."""
    ss = shutil.which("ss")
    assert ss is not None, "this test needs `ss` (Debian package iproute2)"
    out = subprocess.run([ss, "-ltnpH"], capture_output=True, text=True, check=True).stdout
    rows = []
    for line in out.splitlines():
        fields = line.split()
        host, _, port = fields[3].rpartition(":")
        for name, pid in _USER.findall(line):
            if int(pid) in pids:
                rows.append((host.strip("[]").split("%")[0], int(port), name, int(pid)))
    return sorted(set(rows))


def test_listening_sockets_are_loopback(namespace: Namespace, spawn_worker: Any,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    assert loopback.SHIM is not None, loopback.WHY_NOT
    with MooncakeEngine(holder=True, segment_size="64 MB") as engine, \
            open_connector("mooncake", namespace, engine.settings):
        monkeypatch.setenv("LD_PRELOAD", loopback.SHIM)  # as an operator starts SGLang
        worker = spawn_worker(engine.settings, namespace)
        monkeypatch.delenv("LD_PRELOAD")
        assert worker.request("set", ["exposure-0"]) == [True]
        assert worker.request("get", ["exposure-0"]) == [True]
        assert engine.master is not None and engine.holder_proc is not None
        assert engine.metadata_proc is not None
        master, holder, meta, shimmed, me = (engine.master.pid, engine.holder_proc.pid,
                                             engine.metadata_proc.pid, worker.proc.pid, os.getpid())
        rows = listening({master, holder, meta, shimmed, me})
        print("\n".join(f"{h}:{p} {n} pid={pid}" for h, p, n, pid in rows))
        by_port = {(pid, p): h for h, p, _, pid in rows}
        assert by_port[(meta, engine.http_port)] in LOOPBACK
        assert by_port[(master, engine.rpc_port)] in LOOPBACK
        assert by_port[(master, engine.metrics_port)] in LOOPBACK
        assert by_port[(holder, engine.holder_port)] in LOOPBACK
        for pid in (holder, shimmed):  # their transfer engines listen, on loopback
            assert len([p for _, p, _, q in rows if q == pid]) >= 2, f"pid {pid}: listeners not seen"
        exposed = [(h, p, n, pid) for h, p, n, pid in rows if h not in LOOPBACK]
        for host, port, name, pid in exposed:
            assert pid == me, f"{name} (pid {pid}) listens on {host}:{port}"
            assert port in TRANSFER_ENGINE_PORTS, f"unexpected {name} socket {host}:{port}"
        assert len(exposed) <= 2, f"this process exposes more than the transfer engine's two: {exposed}"
        assert any(pid == me for _, _, _, pid in rows), "this process's transfer engine not seen"
