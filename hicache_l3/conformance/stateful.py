"""A Hypothesis state machine for every connector: random set / get / exists / delete /
clear / reopen / compact / damage at rest / second-process rules, run against the connector
and a model (the set of stored keys; a page's bytes are a function of its key).

Invariant after each rule: a hit has exactly the model's bytes; a miss only where the
model allows one (never stored, deleted, damaged at rest, reopened without ``persistent``,
or set by a second process killed before it reported); a True set is stored; a set a
killed writer completed stays stored where the connector declares ``persistent``.
Derandomized; ``HICACHE_L3_STATEFUL_EXAMPLES`` (4) sequences of ``HICACHE_L3_STATEFUL_STEPS``
(10) rules.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings, strategies
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from hicache_l3.common.connector import Connector
from hicache_l3.common.keys import Namespace
from hicache_l3.conformance import worker
from hicache_l3.conformance.pages import Pages

KEYS = [f"sm-{i:02d}" for i in range(10)]
SPAWNS_PER_SEQUENCE = 1  # second processes are slow: at most this many per sequence
KILL_FILLERS = 512  # pages a killed writer sets before the model's keys (the kill lands in them)


def run_model(tests: Any, open_conn: Callable[..., Connector[Any]], conn_settings: dict[str, Any],
              base: Namespace) -> None:
    """Run the state machine against ``tests.connector_name`` (a ``ConnectorTests``)."""

    page_bytes = tests.page_bytes
    batches = strategies.lists(strategies.sampled_from(KEYS), min_size=1, max_size=6, unique=True)

    class ConnectorModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            fields = base.fields() | {"tag": f"sm{uuid.uuid4().hex[:10]}"}
            self.namespace = Namespace.from_dict(fields)
            self.conn = open_conn(self.namespace)
            self.caps = self.conn.capabilities
            self.pages = Pages(self.conn, page_bytes, len(KEYS))
            self.stored: set[str] = set()
            self.maybe_missing: set[str] = set()  # stored, but a miss is allowed
            self.maybe_stored: set[str] = set()  # a killed writer may have stored them
            # a killed writer's keys: a set of them may be False for a while (even after clear)
            self.refusable: set[str] = set()
            self.spawns = 0

        def _pages(self, keys: list[str]) -> list[Any]:
            return [self.pages.pages[KEYS.index(k)] for k in keys]

        def _required(self, key: str) -> bool:
            return key in self.stored and key not in self.maybe_missing

        def _allowed(self, key: str) -> bool:
            """May ``key`` be a hit?"""
            return key in self.stored or key in self.maybe_stored

        def _forget(self, keys: Any) -> None:
            self.stored.difference_update(keys)
            self.maybe_missing.difference_update(keys)
            self.maybe_stored.difference_update(keys)

        @rule(keys=batches)
        def set_pages(self, keys: list[str]) -> None:
            self.pages.fill_at([KEYS.index(k) for k in keys], keys)
            got = self.conn.batch_set(keys, self._pages(keys))
            for key, ok in zip(keys, got):
                assert ok or key in self.refusable, f"set {keys} -> {got}"
            done = [k for k, ok in zip(keys, got) if ok]
            self.stored.update(done)
            self.maybe_stored.difference_update(done)
            self.refusable.difference_update(done)

        @rule(keys=batches)
        def get_pages(self, keys: list[str]) -> None:
            self.pages.wipe()
            got = self.conn.batch_get(keys, self._pages(keys))
            for key, ok in zip(keys, got):
                if ok:
                    assert self._allowed(key), f"get of {key} hit, but it is not stored"
                    assert self.pages.matches(KEYS.index(key), key), f"WRONG BYTES for {key}"
                else:
                    assert not self._required(key), f"get of stored {key} missed"

        @rule(keys=batches)
        def exists(self, keys: list[str]) -> None:
            got = self.conn.batch_exists(keys)
            for key, hit in zip(keys, got):
                if not self._allowed(key):
                    assert not hit, f"exists({key}) is True, but it is not stored"
                elif self._required(key):
                    assert hit, f"exists({key}) is False, but it is stored"

        @rule(keys=batches)
        def delete(self, keys: list[str]) -> None:
            got = self.conn.delete(keys)
            for key, gone in zip(keys, got):
                if not self._allowed(key):
                    assert not gone, f"delete({key}) is True, but it was not stored"
                elif self._required(key):
                    assert gone, f"delete({key}) is False, but it was stored"
            self._forget(keys)

        @rule()
        def clear(self) -> None:
            self.conn.clear()
            self._forget(KEYS)

        @rule()
        def reopen(self) -> None:
            self.conn.close()
            self.conn = open_conn(self.namespace)
            self.conn.register(self.pages.buffer)
            if not self.caps.persistent:
                self.maybe_missing.update(self.stored)
                self.maybe_stored.clear()

        @rule()
        def compact(self) -> None:
            tests.backdoor_compact(self.conn)

        @precondition(lambda self: bool(self.stored) and self.caps.detects_corruption)
        @rule(data=strategies.data())
        def damage_at_rest(self, data: Any) -> None:
            key = data.draw(strategies.sampled_from(sorted(self.stored)))
            if key in self.maybe_missing:
                return
            try:
                tests.backdoor_corrupt(conn_settings, self.namespace, key, "flip")
            except (KeyError, FileNotFoundError, LookupError):
                return  # not where the backdoor looks (e.g. evicted meanwhile): nothing damaged
            self.maybe_missing.add(key)

        @precondition(lambda self: self.caps.shared_across_processes
                      and self.spawns < SPAWNS_PER_SEQUENCE)
        @rule(keys=batches)
        def second_process_get(self, keys: list[str]) -> None:
            self.spawns += 1
            got = tests._spawn(conn_settings, self.namespace, "verify", keys)
            for key, outcome in zip(keys, got):
                assert outcome != "wrong", f"WRONG BYTES for {key} in a second process"
                if outcome == "hit":
                    assert self._allowed(key), f"second process hit {key}, which is not stored"
                else:
                    assert not self._required(key), f"second process missed stored {key}"

        @precondition(lambda self: self.caps.shared_across_processes and tests.stateful_kills
                      and self.spawns < SPAWNS_PER_SEQUENCE)
        @rule(keys=batches, after_ms=strategies.integers(min_value=0, max_value=40))
        def kill_writer_process(self, keys: list[str], after_ms: int) -> None:
            """A second process setting fillers then ``keys`` is SIGKILLed ``after_ms`` in."""
            self.spawns += 1
            fresh = [k for k in keys if k not in self.stored]
            fillers = [f"sm-filler-{self.spawns}-{i}" for i in range(KILL_FILLERS)]
            proc = worker.start_ready(tests._worker(conn_settings, self.namespace, "set", fillers + fresh))
            try:
                proc.wait(timeout=after_ms / 1000)
            except subprocess.TimeoutExpired:
                proc.kill()
            proc.wait(timeout=60)
            self.maybe_stored.update(fresh)
            self.refusable.update(fresh)

        @precondition(lambda self: self.caps.shared_across_processes and tests.stateful_kills
                      and self.spawns < SPAWNS_PER_SEQUENCE)
        @rule(keys=batches)
        def kill_writer_after_set(self, keys: list[str]) -> None:
            """A second process sets ``keys``, reports, and is SIGKILLed with its connector
            open: what it reported stored stays stored (persistent connectors)."""
            self.spawns += 1
            proc, got = worker.start_held(tests._worker(conn_settings, self.namespace, "set", keys))
            proc.kill()
            proc.wait(timeout=60)
            for key, ok in zip(keys, got):
                assert ok or key in self.refusable, f"second process set {keys} -> {got}"
            fresh = [k for k, ok in zip(keys, got) if ok and k not in self.stored]
            if self.caps.persistent:
                self.stored.update(fresh)
                self.maybe_stored.difference_update(fresh)
                self.refusable.difference_update(fresh)
            else:
                self.maybe_stored.update(fresh)

        def teardown(self) -> None:
            self.conn.close()

    examples = int(os.environ.get("HICACHE_L3_STATEFUL_EXAMPLES", "4"))
    steps = int(os.environ.get("HICACHE_L3_STATEFUL_STEPS", "10"))
    run_state_machine_as_test(ConnectorModel, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
        database=None, suppress_health_check=list(HealthCheck), print_blob=True,
    ))
