"""Every engine process the launcher starts listens on loopback only; the
Mooncake deployment, with the connector's own transfer engine, is checked in
tests/mooncake/test_mooncake_exposure.py."""

from __future__ import annotations

from hicache_l3.conformance.sockets import LOOPBACK, listening
from hicache_l3.engines import MooncakeEngine, S3Engine, loopback


def test_s3_server_listens_on_loopback_only() -> None:
    with S3Engine() as engine:
        pids = {p.pid for p in engine.processes}
        rows = listening(pids)
        assert any(port == engine.port for _, port, _, _ in rows), rows
        assert [r for r in rows if r[0] not in LOOPBACK] == []


def test_mooncake_engine_processes_listen_on_loopback_only() -> None:
    """Master, metadata server and segment holder: no connector in this test, so every
    listener of every process the launcher started must be loopback (the holder's transfer
    engine too, through the preloaded shim)."""
    assert loopback.SHIM is not None, loopback.WHY_NOT
    with MooncakeEngine(holder=True, segment_size="64 MB") as engine:
        rows = listening({p.pid for p in engine.processes})
        names = {name for _, _, name, _ in rows}
        assert {"mooncake_master", "mooncake_client"} <= names, rows
        assert len(rows) >= 6, rows  # master rpc+metrics, metadata, holder port+handshake+data
        assert [r for r in rows if r[0] not in LOOPBACK] == []
