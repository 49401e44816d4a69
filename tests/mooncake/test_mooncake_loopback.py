"""Mooncake's transfer engine and loopback: the connector warns at open, naming the ports,
when the engine listens beyond loopback while the client advertises a loopback address (no
loopback shim), and stays quiet with the shim; ``hicache-l3 sglang-args --backend mooncake``
prints a launch command that preloads the shim for a one-machine deployment (loopback
master) and not for a multi-machine one. Real engines: the launcher's master and segment
holder, connectors in separate processes, sockets read with ``ss``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.conformance.sockets import LOOPBACK, listening
from hicache_l3.engines import MooncakeEngine, loopback

WARNING = re.compile(r"listens beyond loopback on (.+?) while it advertises local_hostname=(\S+):")


def test_warns_naming_the_ports_it_exposes(namespace: Namespace, spawn_worker: Any,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert loopback.SHIM is not None, loopback.WHY_NOT
    with MooncakeEngine(holder=True, segment_size="64 MB") as engine:
        monkeypatch.delenv("LD_PRELOAD", raising=False)
        bare = spawn_worker(engine.settings, namespace)
        monkeypatch.setenv("LD_PRELOAD", loopback.SHIM)
        shimmed = spawn_worker(engine.settings, namespace)
        monkeypatch.delenv("LD_PRELOAD")
        assert bare.request("set", ["loopback-0"]) == [True]
        assert shimmed.request("get", ["loopback-0"]) == [True]
        exposed = {port for host, port, _, _ in listening({bare.proc.pid}) if host not in LOOPBACK}
        assert exposed, "without the shim the transfer engine should listen beyond loopback"
        found = WARNING.search(bare.log.read_text(errors="replace"))
        assert found, f"no warning in the connector's log:\n{bare.tail()}"
        named = {int(item.rpartition(":")[2]) for item in found.group(1).split(", ")}
        assert named == exposed, (found.group(0), exposed)
        assert found.group(2) == engine.settings.get("local_hostname", "127.0.0.1")
        assert all(host in LOOPBACK for host, _, _, _ in listening({shimmed.proc.pid}))
        assert not WARNING.search(shimmed.log.read_text(errors="replace")), shimmed.tail()


def sglang_args(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "hicache_l3.cli", "sglang-args", "--backend", "mooncake",
            "--config", str(tmp_path / "mooncake.toml")]
    for item in sets:
        argv += ["--set", item]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out


def test_sglang_args_preloads_the_shim_on_one_machine(tmp_path: Path) -> None:
    assert loopback.SHIM is not None, loopback.WHY_NOT
    local = sglang_args(tmp_path, "master_address=127.0.0.1:50051")
    assert local.stdout.startswith(f"LD_PRELOAD={loopback.SHIM} python -m sglang.launch_server "), \
        local.stdout
    remote = sglang_args(tmp_path, "master_address=10.1.2.3:50051", "local_hostname=10.1.2.4")
    assert remote.stdout.startswith("python -m sglang.launch_server "), remote.stdout
    assert "firewall" in remote.stderr, remote.stderr
    # a loopback master but an address the others must reach: not one machine
    mixed = sglang_args(tmp_path, "master_address=127.0.0.1:50051", "local_hostname=10.1.2.4")
    assert "LD_PRELOAD" not in mixed.stdout, mixed.stdout
