"""The fault-injecting wrapper: with no faults it passes the whole suite around the file
connector (a wrapper must not change behaviour); with faults, they are per key, seeded,
counted, and never wrong bytes."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance import ConnectorTests
from hicache_l3.conformance.slab_backdoor import SlabBackdoor
from hicache_l3.conformance.suite import Pages
from hicache_l3.connectors.faulty import wrap

PAGE = 4096


class TestFaultyPassThrough(SlabBackdoor, ConnectorTests):
    connector_name = "faulty"

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"inner": "file", "root": str(tmp_path / "store"), "capacity_bytes": "1GiB"}


def _ns() -> Namespace:
    return Namespace(model="faulty/model", kv_dtype="bfloat16", layout="page_first", page_size=16,
                     tag=f"f{uuid.uuid4().hex[:10]}")


def _run(seed: int, rate: float, keys: list[str]) -> tuple[list[bool], list[bool]]:
    conn = open_connector("faulty", _ns(), {"inner": "memory", "seed": seed, "set_failure": rate,
                                            "get_failure": rate})
    with conn:
        pages = Pages(conn, PAGE, len(keys))
        pages.fill(keys)
        stored = conn.batch_set(keys, pages.pages)
        pages.wipe()
        got = conn.batch_get(keys, pages.pages)
        for i, (key, ok) in enumerate(zip(keys, got)):
            assert not ok or pages.matches(i, key), "a faulted wrapper returned wrong bytes"
            if not ok:
                assert bytes(pages.view[i * PAGE:(i + 1) * PAGE]) == bytes(PAGE)  # untouched
        injected = conn.stats()["engine"]["injected"]
        assert injected.get("set", 0) == stored.count(False)
        return stored, got


def test_fault_injection_is_per_key_and_seeded() -> None:
    keys = [f"k{i}" for i in range(200)]
    first = _run(7, 0.3, keys)
    assert first == _run(7, 0.3, keys)  # same seed, same calls: same faults
    assert first != _run(8, 0.3, keys)
    stored, got = first
    assert 20 < stored.count(False) < 100  # per key, not the whole batch
    assert all(not g for s, g in zip(stored, got) if not s)  # a failed set is never a hit


def test_fault_drop_keys_read_as_misses() -> None:
    inner = open_connector("memory", _ns())
    conn = wrap(inner, drop_keys="b,d")
    with conn:
        keys = ["a", "b", "c", "d"]
        pages = Pages(conn, PAGE, 4)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * 4
        assert conn.batch_exists(keys) == [True, False, True, False]
        assert conn.batch_get(keys, pages.pages) == [True, False, True, False]
        assert inner.batch_exists(keys) == [True] * 4  # the inner store still has them
        assert conn.stats()["ops"]["get"]["failed"] == {"miss": 2}
    assert inner.closed


def test_fault_delay_is_applied_once_per_call() -> None:
    conn = open_connector("faulty", _ns(), {"inner": "memory", "delay_s": 0.3})
    with conn:
        pages = Pages(conn, PAGE, 1)
        for call in (lambda: conn.batch_exists(["x"]), lambda: conn.batch_set(["x"], pages.pages),
                     lambda: conn.batch_get(["x"], pages.pages)):
            start = time.monotonic()
            call()
            elapsed = time.monotonic() - start
            assert 0.3 <= elapsed < 0.55  # a get draws two kinds of fault, and sleeps once


def test_fault_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="get_failure"):
        open_connector("faulty", _ns(), {"inner": "memory", "get_failure": 1.5})
    with pytest.raises(ConfigError, match="inner"):
        open_connector("faulty", _ns(), {"inner": "faulty"})
