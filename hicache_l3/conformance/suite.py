"""``ConnectorTests``: the behaviour every connector must show, against its real engine.

A connector's test module subclasses it, sets ``connector_name``, gives a ``settings``
fixture (the engine's settings; opens nothing) and the backdoor methods, which read,
damage and write stored pages *without* the connector, so the suite checks bytes at rest.
The suite asserts what the connector declares in
:class:`~hicache_l3.common.connector.Capabilities`; it skips only what a connector
declares it lacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConnectorClosedError, MemoryRegistrationError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer, MemoryRegion
from hicache_l3.common.pages import Page
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance import worker
from hicache_l3.conformance.compression import CompressionTests
from hicache_l3.conformance.pages import Pages, page_pattern, store_pages, strided_roundtrip
from hicache_l3.conformance.pages import numbered_keys as _keys

HOSTILE_KEYS = [
    "../../etc/passwd", "/etc/passwd", "a/b", "a\\b", "nul\0byte", "", ".hidden", "..",
    "x" * 10_000, "spaces are bad", "line\nbreak", "ümlaut",
]


@contextlib.contextmanager
def _sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt inside, even in a process started with SIGINT ignored
    (there ``_thread.interrupt_main`` would do nothing); the old handler is put back after."""
    handler = signal.getsignal(signal.SIGINT)
    if handler is signal.default_int_handler or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


@pytest.mark.conformance
class ConnectorTests(CompressionTests):
    """The shared conformance suite; see the module docstring for how to subclass it."""

    connector_name: ClassVar[str]
    page_bytes: ClassVar[int] = 16 << 10
    stateful_kills: ClassVar[bool] = True  # the stateful model kills a second process mid-set
    large_batch: ClassVar[int] = 4096  # test_batch_sizes' largest batch (a long prefix's pages)

    # ---- what a subclass provides ----------------------------------------------------
    @pytest.fixture
    def settings(self) -> dict[str, Any]:
        """The connector's settings on its real engine (override in the subclass)."""
        raise NotImplementedError("a ConnectorTests subclass must define a settings fixture")

    def backdoor_read(self, settings: dict[str, Any], namespace: Namespace, key: str) -> bytes | None:
        """The page bytes stored under ``key``, read without the connector; None if absent."""
        raise NotImplementedError

    def backdoor_corrupt(self, settings: dict[str, Any], namespace: Namespace, key: str, how: str) -> None:
        """Damage the stored page: ``"flip"`` one data byte, or ``"truncate"`` it."""
        raise NotImplementedError

    def backdoor_compact(self, conn: Connector[Any]) -> None:
        """Compact the connector's own metadata now, if it has any (default: nothing)."""

    def eviction_settings(self, settings: dict[str, Any], capacity_pages: int) -> dict[str, Any]:
        """Settings bounding the store to about ``capacity_pages`` pages (evicting connectors)."""
        raise NotImplementedError

    # ---- fixtures and helpers ----------------------------------------------------------
    @pytest.fixture
    def namespace(self) -> Namespace:
        """A namespace unique to the test, so tests sharing an engine never interfere."""
        return Namespace(model="conformance/model", kv_dtype="bfloat16", layout="page_first",
                         page_size=16, tag=f"t{uuid.uuid4().hex[:12]}")

    @pytest.fixture
    def open_conn(self, settings: dict[str, Any], namespace: Namespace) -> Iterator[Any]:
        """``open_conn(ns=None, **overrides)``: opens a connector (closed at teardown)."""
        opened: list[Connector[Any]] = []

        def factory(ns: Namespace | None = None, **overrides: Any) -> Connector[Any]:
            opened.append(open_connector(self.connector_name, ns or namespace, {**settings, **overrides}))
            return opened[-1]

        yield factory
        for conn in opened:
            conn.close()

    @pytest.fixture
    def conn(self, open_conn: Any) -> Connector[Any]:
        """One open connector on the test's namespace."""
        connector: Connector[Any] = open_conn()
        return connector

    def _store(self, conn: Connector[Any], keys: list[str]) -> Pages:
        return store_pages(conn, self.page_bytes, keys)

    def _worker(self, settings: dict[str, Any], namespace: Namespace, op: str, keys: list[str]) -> list[str]:
        return worker.command(self.connector_name, settings, namespace, op, keys, self.page_bytes)

    def _spawn(self, settings: dict[str, Any], namespace: Namespace, op: str, keys: list[str]) -> list[Any]:
        """Run ``op`` on ``keys`` in a second process; its per-key results."""
        return worker.run(self._worker(settings, namespace, op, keys))

    # ---- round trips -------------------------------------------------------------------
    def test_roundtrip_contiguous(self, conn: Connector[Any]) -> None:
        keys = _keys("rt", 8)
        pages = self._store(conn, keys)
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * 8
        assert pages.holds(keys)

    def test_roundtrip_multi_segment(self, conn: Connector[Any]) -> None:
        strided_roundtrip(conn, self.page_bytes, _keys("ms", 6))

    def test_bytes_at_rest_are_the_page(self, conn: Connector[Any], settings: dict[str, Any],
                                        namespace: Namespace) -> None:
        keys = _keys("rest", 3)
        self._store(conn, keys)
        for key in keys:
            assert self.backdoor_read(settings, namespace, key) == page_pattern(key, self.page_bytes)
        assert self.backdoor_read(settings, namespace, "never-stored") is None

    def test_miss(self, conn: Connector[Any]) -> None:
        pages = Pages(conn, self.page_bytes, 3)
        assert conn.batch_get(_keys("absent", 3), pages.pages) == [False] * 3
        assert conn.batch_exists(_keys("absent", 3)) == [False] * 3
        stats = conn.stats()["ops"]["get"]
        assert stats["failed"].get("miss") == 3

    def test_all_miss_batch_where_pages_are_stored(self, conn: Connector[Any]) -> None:
        """A batch with no stored key, in a namespace that has pages: misses, not errors."""
        self._store(conn, _keys("present", 2))
        pages = Pages(conn, self.page_bytes, 3)
        assert conn.batch_get(_keys("absent-here", 3), pages.pages) == [False] * 3
        assert conn.stats()["ops"]["get"]["failed"] == {"miss": 3}
        assert conn.batch_set(_keys("present", 2), pages.pages[:2]) == [True, True]  # nothing to write
        assert conn.stats()["ops"]["set"]["failed"] == {}

    def test_mixed_hits_and_misses_keep_order(self, conn: Connector[Any]) -> None:
        stored = _keys("mix", 4)
        self._store(conn, stored)
        query = [stored[0], "mix-absent-1", stored[2], "mix-absent-2", stored[3]]
        pages = Pages(conn, self.page_bytes, len(query))
        assert conn.batch_get(query, pages.pages) == [True, False, True, False, True]
        assert pages.matches(0, stored[0]) and pages.matches(2, stored[2])
        assert pages.matches(4, stored[3])
        assert conn.batch_exists(query) == [True, False, True, False, True]

    def test_leading_hits(self, conn: Connector[Any]) -> None:
        keys = _keys("lead", 6)
        self._store(conn, [keys[0], keys[1], keys[2], keys[4]])
        assert conn.leading_hits(keys) == 3
        assert conn.leading_hits(keys[3:]) == 0
        assert conn.leading_hits([]) == 0

    @pytest.mark.parametrize("size", ["0", "1", "128", "large"])
    def test_batch_sizes(self, open_conn: Any, size: str) -> None:
        count = self.large_batch if size == "large" else int(size)
        conn = open_conn()
        keys = _keys(f"b{count}", count)
        pages = Pages(conn, self.page_bytes, count)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * count
        assert conn.batch_exists(keys) == [True] * count
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * count
        assert pages.holds(keys)
        assert conn.leading_hits(keys) == count

    def test_set_existing_key_is_harmless(self, conn: Connector[Any]) -> None:
        keys = _keys("dup", 2)
        pages = self._store(conn, keys)
        other = Pages(conn, self.page_bytes, 2)
        other.fill(["other-a", "other-b"])
        assert conn.batch_set(keys, other.pages) == [True, True]
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True, True]
        for i, key in enumerate(keys):  # the first or the second value, never a mix
            assert pages.matches(i, key) or pages.matches(i, ["other-a", "other-b"][i])

    def test_duplicate_keys_in_one_batch(self, conn: Connector[Any]) -> None:
        pages = Pages(conn, self.page_bytes, 3)
        pages.fill(["dupe", "dupe", "single"])
        assert conn.batch_set(["dupe", "dupe", "single"], pages.pages) == [True] * 3
        pages.wipe()
        assert conn.batch_get(["dupe", "single"], pages.pages[:2]) == [True, True]
        assert pages.matches(0, "dupe") and pages.matches(1, "single")

    # ---- bad input ---------------------------------------------------------------------
    def test_wrong_page_size_is_refused_per_key(self, conn: Connector[Any]) -> None:
        keys = _keys("size", 2)
        pages = self._store(conn, keys)
        small = [((pages.buffer.address, self.page_bytes // 2),)]
        assert conn.batch_set(["size-small"], small) == [False]
        assert conn.batch_get([keys[0]], small) == [False]
        assert conn.batch_exists(["size-small"]) == [False]
        # the good page of a mixed batch still works
        assert conn.batch_get([keys[0], keys[1]], [small[0], pages.pages[1]]) == [False, True]
        failed = conn.stats()["ops"]["get"]["failed"]
        assert failed.get("size_mismatch", 0) >= 2

    def test_unregistered_memory_is_refused_per_key(self, conn: Connector[Any]) -> None:
        keys = _keys("unreg", 2)
        pages = self._store(conn, keys)
        stray = HostBuffer(self.page_bytes)  # never registered
        bad: Page = ((stray.address, self.page_bytes),)
        assert conn.batch_set(["unreg-x", keys[0] + "-new"], [bad, pages.pages[0]]) == [False, True]
        assert conn.batch_get([keys[1], keys[0]], [bad, pages.pages[0]]) == [False, True]
        half_out: Page = ((pages.buffer.address + pages.buffer.size - 8, self.page_bytes),)
        assert conn.batch_get([keys[1]], [half_out]) == [False]
        assert conn.stats()["ops"]["get"]["failed"].get("unregistered_memory") == 2
        assert conn.batch_exists(["unreg-x"]) == [False]

    def test_hostile_malformed_pages_are_refused_per_key(self, conn: Connector[Any]) -> None:
        """Every malformed page is refused per key, before any I/O, wherever it is in the
        batch; the good pages of the batch still move."""
        keys = _keys("shape", 2)
        pages = self._store(conn, keys)
        address, nbytes = pages.pages[0][0]
        malformed: list[Any] = [
            ((address, nbytes, 0),), ((float(address), nbytes),), ((address, float(nbytes)),),
            ((None, nbytes),), None, {address: nbytes}, ((address,),), "page", (), ((True, nbytes),),
            ((address, -nbytes),),
        ]
        for bad in malformed:
            for op in (conn.batch_set, conn.batch_get):
                pages.wipe() if op is conn.batch_get else None
                got = op(["shape-bad", keys[1]], [bad, pages.pages[1]])
                assert got == [False, True], (bad, op)
                if op is conn.batch_get:
                    assert pages.matches(1, keys[1])
            assert conn.batch_get([keys[0], "shape-bad"], [pages.pages[0], bad]) == [True, False]
        assert conn.batch_exists(["shape-bad"]) == [False]
        failed = conn.stats()["ops"]["get"]["failed"]
        assert failed.get("malformed_page", 0) >= 2 * len(malformed)

    def test_hostile_overlapping_get_destinations_raise(self, conn: Connector[Any]) -> None:
        """Two keys read into the same bytes is a caller error: ValueError, before any I/O."""
        keys = _keys("overlap", 2)
        pages = self._store(conn, keys)
        pages.wipe()
        same = [pages.pages[0], pages.pages[0]]
        with pytest.raises(ValueError, match="overlap"):
            conn.batch_get(keys, same)
        address, nbytes = pages.pages[0][0]
        shifted: list[Page] = [pages.pages[0], ((address + nbytes // 2, nbytes),)]
        with pytest.raises(ValueError, match="overlap"):
            conn.batch_get(keys, shifted)
        assert bytes(pages.view) == bytes(len(pages.view))  # nothing was read
        assert conn.batch_set(["overlap-src-a", "overlap-src-b"], same) == [True, True]  # sources may
        assert conn.batch_get(keys, pages.pages[:2]) == [True, True]

    # an interrupt landing in a finalizer the GC runs is reported as unraisable and ignored
    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    def test_fault_interrupted_get_leaves_no_thread_writing(self, conn: Connector[Any]) -> None:
        """Once a KeyboardInterrupt in a get reaches the caller, nothing writes its pages."""
        import _thread

        count = 512
        keys = _keys("intr", count)
        pages = self._store(conn, keys)
        with _sigint_raises():
            interrupted = self._interrupt_gets(conn, keys, pages, _thread.interrupt_main)
        assert interrupted > 0, "no interrupt landed: the test saw nothing"
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * count  # the connector still works
        assert pages.holds(keys)

    @staticmethod
    def _interrupt_gets(conn: Connector[Any], keys: list[str], pages: Pages,
                        interrupt_main: Callable[[], None]) -> int:
        """Gets of ``keys`` interrupted at staggered moments; how many interrupts landed
        (for each, asserts the pages no longer change once the call raised). Stops once
        every delay was tried and ten interrupts landed."""
        interrupted = 0
        for attempt in range(40):
            if attempt >= 10 and interrupted >= 10:
                break
            pages.wipe()
            timer = threading.Timer(0.0005 * (attempt % 10), interrupt_main)
            try:
                timer.start()
                conn.batch_get(keys, pages.pages)
                timer.join()
                time.sleep(0.01)  # an interrupt that lands after the call ends here
            except KeyboardInterrupt:
                interrupted += 1
                before = bytes(pages.view)
                time.sleep(0.05)
                assert bytes(pages.view) == before, "pages changed after the call raised"
        timer.cancel()
        for _ in range(3):  # an interrupt still pending must land here, not in pytest
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                interrupted += 1
        return interrupted

    def test_stateful_model(self, open_conn: Any, settings: dict[str, Any], namespace: Namespace) -> None:
        """Random sequences of every operation agree with a model (:mod:`.stateful`)."""
        from hicache_l3.conformance.stateful import run_model

        run_model(self, open_conn, settings, namespace)

    def test_mismatched_batch_lengths_raise(self, conn: Connector[Any]) -> None:
        pages = Pages(conn, self.page_bytes, 2)
        with pytest.raises(ValueError, match="2 keys but 1 pages"):
            conn.batch_set(["a", "b"], pages.pages[:1])
        with pytest.raises(ValueError):
            conn.batch_get(["a"], pages.pages)

    def test_overlapping_registration_is_refused(self, conn: Connector[Any]) -> None:
        buf = HostBuffer(4 * self.page_bytes)
        conn.register(buf)
        conn.register(buf)  # the same region again: a no-op
        inner = MemoryRegion(buf.address + self.page_bytes, self.page_bytes, owner=buf)
        with pytest.raises(MemoryRegistrationError, match="overlaps"):
            conn.register(inner)

    def test_hostile_keys_never_escape_or_collide(self, conn: Connector[Any]) -> None:
        n = len(HOSTILE_KEYS)
        pages = Pages(conn, self.page_bytes, n + 1)
        keys = [*HOSTILE_KEYS, "honest-key"]
        pages.fill([f"fill-{i}" for i in range(n + 1)])
        assert conn.batch_set(keys, pages.pages) == [False] * n + [True]
        assert conn.batch_exists(keys) == [False] * n + [True]
        assert conn.batch_get(keys, pages.pages) == [False] * n + [True]
        assert conn.delete(HOSTILE_KEYS) == [False] * n
        assert conn.stats()["ops"]["set"]["failed"].get("invalid_key") == n
        # non-string keys are refused the same way
        assert conn.batch_exists([None, 42, b"bytes"]) == [False, False, False]  # type: ignore[list-item]

    # ---- lifecycle -----------------------------------------------------------------------
    def test_close_twice_and_calls_after_close(self, open_conn: Any) -> None:
        conn = open_conn()
        pages = Pages(conn, self.page_bytes, 1)
        conn.close()
        conn.close()
        assert conn.closed
        with pytest.raises(ConnectorClosedError):
            conn.batch_exists(["k"])
        with pytest.raises(ConnectorClosedError):
            conn.batch_get(["k"], pages.pages)
        with pytest.raises(ConnectorClosedError):
            conn.batch_set(["k"], pages.pages)

    def test_context_manager_closes(self, settings: dict[str, Any], namespace: Namespace) -> None:
        with open_connector(self.connector_name, namespace, settings) as conn:
            assert conn.batch_exists(["x"]) == [False]
        assert conn.closed

    def test_delete(self, conn: Connector[Any]) -> None:
        keys = _keys("del", 3)
        pages = self._store(conn, keys)
        assert conn.delete([keys[1], "del-never"]) == [True, False]
        assert conn.batch_exists(keys) == [True, False, True]
        assert conn.batch_get(keys, pages.pages) == [True, False, True]
        pages.fill(keys)
        assert conn.batch_set([keys[1]], [pages.pages[1]]) == [True]
        assert conn.batch_exists(keys) == [True, True, True]

    def test_clear_touches_only_its_namespace(self, open_conn: Any, namespace: Namespace) -> None:
        mine = open_conn()
        other_ns = dataclasses.replace(namespace, tag=namespace.tag + "-other")
        other = open_conn(other_ns)
        keys = _keys("clr", 4)
        self._store(mine, keys)
        self._store(other, keys)
        mine.clear()
        assert mine.batch_exists(keys) == [False] * 4
        assert other.batch_exists(keys) == [True] * 4
        pages = Pages(other, self.page_bytes, 4)
        assert other.batch_get(keys, pages.pages) == [True] * 4
        assert pages.holds(keys)

    def test_stats_count_every_page(self, conn: Connector[Any]) -> None:
        keys = _keys("st", 5)
        pages = self._store(conn, keys)
        spare = Pages(conn, self.page_bytes, 1)  # destinations of one get never overlap
        conn.batch_get([*keys, "st-miss"], [*pages.pages, spare.pages[0]])
        ops = conn.stats()["ops"]
        assert ops["set"]["ok"] == 5 and ops["set"]["bytes"] == 5 * self.page_bytes
        assert ops["get"]["pages"] == 6 and ops["get"]["ok"] == 5
        assert ops["get"]["failed"] == {"miss": 1}
        assert ops["get"]["calls"] == 1

    # ---- namespaces ----------------------------------------------------------------------
    @pytest.mark.parametrize(
        "change",
        [{"kv_dtype": "float16"}, {"tp_rank": 1, "tp_size": 2}, {"pp_rank": 1, "pp_size": 2},
         {"layout": "layer_first"}, {"page_size": 32}, {"model": "another/model"},
         {"tag": "someone-else"}],
    )
    def test_namespace_isolation(self, open_conn: Any, namespace: Namespace,
                                 change: dict[str, Any]) -> None:
        writer = open_conn()
        keys = _keys("iso", 3)
        self._store(writer, keys)
        if "tag" in change:
            change = {"tag": namespace.tag + change["tag"]}
        reader = open_conn(dataclasses.replace(namespace, **change))
        pages = Pages(reader, self.page_bytes, 3)
        assert reader.batch_exists(keys) == [False] * 3
        assert reader.batch_get(keys, pages.pages) == [False] * 3
        same = open_conn(namespace)
        assert same.batch_exists(keys) == [True] * 3

    # ---- integrity -----------------------------------------------------------------------
    def test_truncated_page_is_a_miss(self, conn: Connector[Any], settings: dict[str, Any],
                                      namespace: Namespace) -> None:
        keys = _keys("trunc", 3)
        pages = self._store(conn, keys)
        self.backdoor_corrupt(settings, namespace, keys[1], "truncate")
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True, False, True]
        assert pages.matches(0, keys[0]) and pages.matches(2, keys[2])

    def test_corrupted_page_is_a_miss(self, open_conn: Any, settings: dict[str, Any],
                                      namespace: Namespace) -> None:
        conn = open_conn()
        if not conn.capabilities.detects_corruption:
            pytest.skip("optional capability detects_corruption: not declared")
        keys = _keys("flip", 3)
        pages = self._store(conn, keys)
        self.backdoor_corrupt(settings, namespace, keys[1], "flip")
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True, False, True]
        assert conn.stats()["ops"]["get"]["failed"] == {"corrupt": 1}
        # a fresh reader (another connector instance) also refuses it
        fresh = open_conn()
        other = Pages(fresh, self.page_bytes, 1)
        assert fresh.batch_get([keys[1]], other.pages) == [False]

    # ---- persistence and sharing ------------------------------------------------------------
    def test_reopen(self, open_conn: Any) -> None:
        keys = _keys("reopen", 4)
        first = open_conn()
        self._store(first, keys)
        persistent = first.capabilities.persistent
        first.close()
        second = open_conn()
        pages = Pages(second, self.page_bytes, 4)
        got = second.batch_get(keys, pages.pages)
        if persistent:
            assert got == [True] * 4
            assert pages.holds(keys)
        else:
            assert got == [False] * 4

    def test_write_after_reading_a_reopened_store(self, open_conn: Any) -> None:
        """A reopened connector that reads before it writes can still write."""
        first = open_conn()
        self._store(first, _keys("rrw", 2))
        first.close()
        second = open_conn()
        pages = Pages(second, self.page_bytes, 2)
        second.batch_get(_keys("rrw", 2), pages.pages)
        more = _keys("rrw-more", 2)
        pages.fill(more)
        assert second.batch_set(more, pages.pages) == [True, True]
        pages.wipe()
        assert second.batch_get(more, pages.pages) == [True, True]
        assert pages.holds(more)

    def test_second_process_reads_and_writes(self, conn: Connector[Any], settings: dict[str, Any],
                                             namespace: Namespace) -> None:
        if not conn.capabilities.shared_across_processes:
            pytest.skip("optional capability shared_across_processes: not declared")
        mine = _keys("p1", 5)
        self._store(conn, mine)
        assert self._spawn(settings, namespace, "exists", [*mine, "p1-absent"]) == [True] * 5 + [False]
        assert self._spawn(settings, namespace, "get", mine) == [True] * 5
        theirs = _keys("p2", 5)
        assert self._spawn(settings, namespace, "set", theirs) == [True] * 5
        assert conn.batch_exists([*theirs, "p2-absent"]) == [True] * 5 + [False]
        pages = Pages(conn, self.page_bytes, 5)
        assert conn.batch_get(theirs, pages.pages) == [True] * 5
        assert pages.holds(theirs)

    def test_fault_completed_set_survives_its_writer_killed(
            self, conn: Connector[Any], settings: dict[str, Any], namespace: Namespace) -> None:
        """Pages a second process reported stored survive its SIGKILL (connector never
        closed) for a persistent connector, read exactly here and in a third process; new
        sets still succeed."""
        caps = conn.capabilities
        if not (caps.shared_across_processes and caps.persistent):
            pytest.skip("optional capabilities shared_across_processes and persistent: not both declared")
        keys = _keys("kas", 12)
        proc, got = worker.start_held(self._worker(settings, namespace, "set", keys))
        proc.kill()
        proc.wait(timeout=60)
        assert got == [True] * 12, f"second process set -> {got}"
        assert conn.batch_exists(keys) == [True] * 12
        pages = Pages(conn, self.page_bytes, 12)
        assert conn.batch_get(keys, pages.pages) == [True] * 12
        assert pages.holds(keys), "WRONG BYTES after the writer's kill"
        assert self._spawn(settings, namespace, "verify", keys) == ["hit"] * 12
        self._store(conn, _keys("kas-more", 4))

    def test_fault_set_after_a_writer_killed_mid_set_is_true_only_when_stored(
            self, conn: Connector[Any], settings: dict[str, Any], namespace: Namespace) -> None:
        """After a second process setting the same keys is SIGKILLed mid-set, each True of
        this process's set means stored: exists says so, get returns exactly these bytes."""
        if not conn.capabilities.shared_across_processes:
            pytest.skip("optional capability shared_across_processes: not declared")
        for attempt, after_ms in enumerate((5, 15, 30, 60)):
            keys = _keys(f"kw{attempt}", 16)
            fillers = _keys(f"kw{attempt}-filler", 256)
            proc = worker.start_ready(self._worker(settings, namespace, "set", fillers + keys))
            try:
                proc.wait(timeout=after_ms / 1000)
            except subprocess.TimeoutExpired:
                proc.kill()
            proc.wait(timeout=60)
            pages = Pages(conn, self.page_bytes, len(keys))
            pages.fill(keys)
            stored = conn.batch_set(keys, pages.pages)
            exists = conn.batch_exists(keys)
            pages.wipe()
            got = conn.batch_get(keys, pages.pages)
            for i, key in enumerate(keys):
                if stored[i]:
                    assert exists[i], f"set({key}) was True after a killed writer, exists is False"
                    assert got[i] and pages.matches(i, key), (
                        f"set({key}) was True after a killed writer, get gave {got[i]} / other bytes")

    # ---- concurrency --------------------------------------------------------------------------
    def test_three_threads_query_get_set(self, conn: Connector[Any]) -> None:
        stored = _keys("thr", 64)
        self._store(conn, stored)
        errors: list[str] = []
        counts = {"query": 0, "get": 0, "set": 0}
        deadline = time.monotonic() + 1.5

        def query() -> None:
            while time.monotonic() < deadline:
                if conn.leading_hits(stored) != len(stored):
                    errors.append("leading_hits lost a stored key")
                counts["query"] += 1

        def get() -> None:
            pages = Pages(conn, self.page_bytes, 16)
            while time.monotonic() < deadline:
                batch = stored[(counts["get"] * 16) % 64 :][:16]
                if conn.batch_get(batch, pages.pages) != [True] * 16:
                    errors.append("get missed a stored key")
                if not all(pages.matches(i, k) for i, k in enumerate(batch)):
                    errors.append("get returned wrong bytes")
                counts["get"] += 1

        def put() -> None:
            pages = Pages(conn, self.page_bytes, 16)
            n = 0
            while time.monotonic() < deadline:
                batch = _keys(f"thr-new{n}", 16)
                pages.fill(batch)
                if conn.batch_set(batch, pages.pages) != [True] * 16:
                    errors.append("set failed")
                n += 1
                counts["set"] += 1

        threads = [threading.Thread(target=f) for f in (query, get, put)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors[:5]
        assert min(counts.values()) > 0, counts

    # ---- capacity -------------------------------------------------------------------------------
    def test_eviction_gives_misses_never_wrong_bytes(self, open_conn: Any,
                                                     settings: dict[str, Any]) -> None:
        probe = open_conn()
        if not probe.capabilities.evicts:
            pytest.skip("optional capability evicts: not declared")
        conn = open_conn(**self.eviction_settings(settings, 16))
        keys = _keys("ev", 64)
        pages = Pages(conn, self.page_bytes, 64)
        pages.fill(keys)
        for lo in range(0, 64, 8):
            assert conn.batch_set(keys[lo : lo + 8], pages.pages[lo : lo + 8]) == [True] * 8
        pages.wipe()
        got = conn.batch_get(keys, pages.pages)
        assert 0 < sum(got) <= 32, got
        assert got[-8:] == [True] * 8  # the newest pages are still there
        for i, (key, ok) in enumerate(zip(keys, got)):
            if ok:
                assert pages.matches(i, key)
        assert conn.batch_exists(keys) == got
