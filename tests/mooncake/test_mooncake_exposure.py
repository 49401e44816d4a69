"""What a local Mooncake deployment exposes: the listening sockets of the master, the
segment holder and a connector's process, from ``ss -ltnp``.

Documented in :mod:`hicache_l3.connectors.mooncake`: everything binds 127.0.0.1 except
the master's embedded HTTP metadata server (0.0.0.0 whatever host it is given) and the
transfer engine's handshake listeners of each client (0.0.0.0, ports 12000-17999 seen).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.engines import MooncakeEngine

_USER = re.compile(r'\("([^"]+)",pid=(\d+)')


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
                rows.append((host.strip("[]"), int(port), name, int(pid)))
    return sorted(set(rows))


def test_listening_sockets_are_loopback_except_documented(namespace: Namespace) -> None:
    with MooncakeEngine(holder=True, segment_size="64 MB") as engine, \
            open_connector("mooncake", namespace, engine.settings):
        assert engine.master is not None and engine.holder_proc is not None
        master, holder, me = engine.master.pid, engine.holder_proc.pid, os.getpid()
        rows = listening({master, holder, me})
        print("\n".join(f"{h}:{p} {n} pid={pid}" for h, p, n, pid in rows))
        loopback = {"127.0.0.1", "::1"}
        by_port = {(pid, p): h for h, p, _, pid in rows}
        # the master: RPC and metrics on loopback; only the metadata server on all interfaces
        assert by_port[(master, engine.rpc_port)] in loopback
        assert by_port[(master, engine.metrics_port)] in loopback
        assert by_port[(master, engine.http_port)] in {"0.0.0.0", "*"}
        assert by_port[(holder, engine.holder_port)] in loopback
        exposed = [(h, p, n) for h, p, n, pid in rows if h not in loopback]
        for host, port, name in exposed:
            if name == "mooncake_master":
                assert port == engine.http_port, f"unexpected master socket {host}:{port}"
            else:  # a transfer-engine listener of a client (the holder or this process)
                assert 12000 <= port < 18000, f"unexpected {name} socket {host}:{port}"
        assert any(pid == me for _, _, _, pid in rows), "this process's transfer engine not seen"
