"""Mooncake with several client processes: sharing both ways, and a segment owner that
crashes (SIGKILL). The master runs without a segment holder, so the only memory in the
store is the segment of the owning worker process."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.suite import Pages
from hicache_l3.engines import MooncakeEngine

CLIENT_TTL = 2  # seconds the master keeps a silent client's segment (default 10)


@pytest.fixture(scope="module")
def engine() -> Iterator[MooncakeEngine]:
    """A master alone (no holder), with a short client TTL."""
    with MooncakeEngine(holder=False, master_flags={"client_ttl": str(CLIENT_TTL)}) as eng:
        yield eng  # type: ignore[misc]


def _owner(engine: MooncakeEngine) -> dict[str, Any]:
    return {**engine.settings, "global_segment_size": "64MiB"}


def _guest(engine: MooncakeEngine) -> dict[str, Any]:
    return {**engine.settings, "global_segment_size": 0}


def test_two_processes_share_pages_both_ways(engine: MooncakeEngine, namespace: Namespace,
                                             spawn_worker: Any) -> None:
    owner = spawn_worker(_owner(engine), namespace)
    guest = spawn_worker(_guest(engine), namespace)
    mine, theirs = [f"own-{i}" for i in range(16)], [f"guest-{i}" for i in range(16)]
    assert owner.request("set", mine) == [True] * 16
    assert guest.request("exists", [*mine, "own-absent"]) == [True] * 16 + [False]
    assert guest.request("get", mine) == [True] * 16  # bytes checked in the worker
    # the guest has no segment: its pages land in the owner's
    assert guest.request("set", theirs) == [True] * 16
    assert owner.request("get", theirs) == [True] * 16
    assert owner.request("exists", [*theirs, "guest-absent"]) == [True] * 16 + [False]


def test_guest_without_any_segment_gets_no_space(engine: MooncakeEngine, namespace: Namespace) -> None:
    """With no segment anywhere, a set fails per key with no_space (-200), counted."""
    with open_connector("mooncake", namespace, _guest(engine)) as conn:
        pages = Pages(conn, 16 << 10, 4)
        assert conn.batch_set([f"nowhere-{i}" for i in range(4)], pages.pages) == [False] * 4
        ops = conn.stats()["ops"]
        assert ops["set"]["failed"] == {"no_space": 4}
        assert ops["counters"]["mooncake_-200"] == 4


def test_killed_owner_pages_become_misses_never_wrong_bytes(
        engine: MooncakeEngine, namespace: Namespace, spawn_worker: Any) -> None:
    owner = spawn_worker(_owner(engine), namespace)
    keys = [f"doomed-{i}" for i in range(32)]
    assert owner.request("set", keys) == [True] * 32
    guest = spawn_worker(_guest(engine), namespace)
    assert guest.request("get", keys) == [True] * 32
    owner.kill()
    # right after the crash: every read fails (or, if it succeeds, has the right bytes:
    # the worker reports True only for exact bytes); never a hang
    t0 = time.monotonic()
    got = guest.request("get", keys, timeout=30)
    assert time.monotonic() - t0 < 10.0
    assert got == [False] * 32
    # once the master has dropped the dead client, the pages are plain misses
    deadline = time.monotonic() + 4 * CLIENT_TTL + 10
    while time.monotonic() < deadline and any(guest.request("exists", keys)):
        time.sleep(0.5)
    assert guest.request("exists", keys) == [False] * 32
    assert guest.request("get", keys) == [False] * 32
    # and the store takes new pages again once a new owner comes
    owner2 = spawn_worker(_owner(engine), namespace)
    assert owner2.request("set", keys[:4]) == [True] * 4
    assert guest.request("get", keys[:4]) == [True] * 4
