"""What a local Mooncake deployment started by the launcher exposes: every listening TCP
socket of the master (with its metadata server), the segment holder, a connector in a process
started with the loopback shim, and this test's own process, from ``ss -ltnp``.

Everything binds loopback. The one allowance: when this test's own process runs without
the shim (``make test`` preloads it; a bare ``pytest`` does not), Mooncake's transfer
engine in it listens on its handshake port (0.0.0.0) and its TCP data port (``[::]``),
which Mooncake offers no setting to bind (README "Security"). The test fails on any other
non-loopback socket, on more than those two, and on any at all when the shim is loaded.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.sockets import LOOPBACK, listening
from hicache_l3.engines import MooncakeEngine, loopback

# the transfer engine's sockets that cannot be bound (see the module docstring)
TRANSFER_ENGINE_PORTS = range(12000, 18000)


def shim_loaded() -> bool:
    """True when the loopback shim is mapped into this process (LD_PRELOAD at start)."""
    assert loopback.SHIM is not None
    with open("/proc/self/maps") as maps:
        return os.path.realpath(loopback.SHIM) in maps.read()


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
        master, holder, shimmed, me = (engine.master.pid, engine.holder_proc.pid,
                                       worker.proc.pid, os.getpid())
        rows = listening({master, holder, shimmed, me})
        print("\n".join(f"{h}:{p} {n} pid={pid}" for h, p, n, pid in rows))
        by_port = {(pid, p): h for h, p, _, pid in rows}
        assert by_port[(master, engine.http_port)] in LOOPBACK  # its metadata server, shimmed
        assert by_port[(master, engine.rpc_port)] in LOOPBACK
        assert by_port[(master, engine.metrics_port)] in LOOPBACK
        assert by_port[(holder, engine.holder_port)] in LOOPBACK
        for pid in (holder, shimmed):  # their transfer engines listen, on loopback
            assert len([p for _, p, _, q in rows if q == pid]) >= 2, f"pid {pid}: listeners not seen"
        exposed = [(h, p, n, pid) for h, p, n, pid in rows if h not in LOOPBACK]
        for host, port, name, pid in exposed:
            assert pid == me, f"{name} (pid {pid}) listens on {host}:{port}"
            assert port in TRANSFER_ENGINE_PORTS, f"unexpected {name} socket {host}:{port}"
        assert len(exposed) <= (0 if shim_loaded() else 2), f"this process exposes {exposed}"
        assert any(pid == me for _, _, _, pid in rows), "this process's transfer engine not seen"
