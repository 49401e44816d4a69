"""``CrossNodeTests``: two nodes on one distributed filesystem, for every connector whose
store several nodes share (file, hf3fs in POSIX mode, nixl in file mode).

A node is a mount with its own page cache: the ``node_roots`` fixture gives two paths that
are one directory seen through two mounts (:class:`~hicache_l3.engines.GlusterEngine`).
A subclass sets ``connector_name`` and ``node_settings(root)``. What must hold: a page set
on one node is a hit on the other within a bounded number of tries, and no get anywhere
returns bytes other than the ones set under its key.
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance import worker
from hicache_l3.conformance.compression import kv_pattern
from hicache_l3.conformance.pages import Pages, Pattern, page_pattern, store_pages
from hicache_l3.conformance.pages import numbered_keys as _keys
from hicache_l3.slab.format import Geometry

TRIES = 40  # a page another node stored is a hit within this many gets ...
TRY_GAP_S = 0.25  # ... this far apart


@pytest.mark.conformance
class CrossNodeTests:
    """Two nodes sharing one store (see the module docstring)."""

    connector_name: ClassVar[str]
    page_bytes: ClassVar[int] = 16 << 10

    # ---- what a subclass provides ----------------------------------------------------
    def node_settings(self, root: str) -> dict[str, Any]:
        """The connector's settings on a node whose view of the store is ``root``."""
        raise NotImplementedError("a CrossNodeTests subclass must define node_settings")

    def capacity_settings(self, pages: int) -> dict[str, Any]:
        """Settings bounding one writer to about ``pages`` pages (slab connectors: slots)."""
        return {"capacity_bytes": pages * Geometry(self.page_bytes).stride}

    # ---- fixtures ----------------------------------------------------------------------
    @pytest.fixture
    def namespace(self) -> Namespace:
        """A namespace unique to the test."""
        return Namespace(model="conformance/model", kv_dtype="bfloat16", layout="page_first",
                         page_size=16, tag=f"x{uuid.uuid4().hex[:12]}")

    @pytest.fixture
    def roots(self, node_roots: tuple[Path, Path]) -> tuple[str, str]:
        """One fresh store directory, as node A and node B see it."""
        name = f"store-{uuid.uuid4().hex[:12]}"
        a, b = (str(Path(root) / name) for root in node_roots)
        return a, b

    @pytest.fixture
    def node(self, roots: tuple[str, str], namespace: Namespace) -> Iterator[Callable[..., Connector[Any]]]:
        """``node("a" | "b", **overrides)``: a connector opened on that node (closed at teardown)."""
        opened: list[Connector[Any]] = []

        def factory(which: str, **overrides: Any) -> Connector[Any]:
            conn = open_connector(self.connector_name, namespace, self._settings(roots, which, overrides))
            opened.append(conn)
            return conn

        yield factory
        for conn in opened:
            conn.close()

    def _settings(self, roots: tuple[str, str], which: str, overrides: dict[str, Any]) -> dict[str, Any]:
        return {**self.node_settings(roots[0 if which == "a" else 1]), **overrides}

    # ---- other processes ----------------------------------------------------------------
    def _command(self, settings: dict[str, Any], namespace: Namespace, op: str, keys: list[str]) -> list[str]:
        return worker.command(self.connector_name, settings, namespace, op, keys, self.page_bytes)

    def _run(self, settings: dict[str, Any], namespace: Namespace, op: str, keys: list[str]) -> list[Any]:
        """``op`` on ``keys`` in a new process; its per-key results."""
        return worker.run(self._command(settings, namespace, op, keys), timeout=180)

    def _verify_until_hit(self, settings: dict[str, Any], namespace: Namespace, keys: list[str]) -> list[str]:
        """Read ``keys`` in a new process each try until all hit or the tries run out,
        asserting no wrong page; the last outcomes."""
        outcomes: list[str] = []
        for _ in range(TRIES):
            outcomes = self._run(settings, namespace, "verify", keys)
            assert "wrong" not in outcomes, f"WRONG BYTES across nodes: {_summary(keys, outcomes)}"
            if all(o == "hit" for o in outcomes):
                return outcomes
            time.sleep(TRY_GAP_S)
        return outcomes

    # ---- the tests -----------------------------------------------------------------------
    def test_cross_node_pages_are_seen_on_the_other_node(self, node: Callable[..., Connector[Any]],
                                                        roots: tuple[str, str], namespace: Namespace) -> None:
        """Set on A, hit on B (a live connector and a new process); set on B, hit on A."""
        a, b = node("a"), node("b")
        keys = _keys("vis-a", 32)
        store_pages(a, self.page_bytes, keys)
        assert _hits_within(b, keys, self.page_bytes) == [True] * 32
        assert self._verify_until_hit(self._settings(roots, "b", {}), namespace, keys) == ["hit"] * 32
        theirs = _keys("vis-b", 16)
        assert self._run(self._settings(roots, "b", {}), namespace, "set", theirs) == [True] * 16
        assert _hits_within(a, theirs, self.page_bytes) == [True] * 16

    def test_cross_node_stale_cache_never_wrong_bytes_never_lost(
            self, node: Callable[..., Connector[Any]]) -> None:
        """A rewrites slots B has read (eviction at capacity): B hits every new page within
        the tries and never reads other bytes, whatever its page cache holds."""
        n = 64
        a, b = node("a", **self.capacity_settings(n)), node("b")
        pages = Pages(a, self.page_bytes, n)
        previous: list[str] = []
        for round_ in range(6):
            keys = _keys(f"stale{round_}", n)
            pages.fill(keys)
            assert a.batch_set(keys, pages.pages) == [True] * n
            for _ in range(TRIES * 10):  # B indexes them (ms on GlusterFS)
                if all(b.batch_exists(keys)):
                    break
                time.sleep(TRY_GAP_S / 10)
            got = _hits_within(b, keys, self.page_bytes)
            lost = [k for k, ok in zip(keys, got) if not ok]
            assert not lost, f"round {round_}: {len(lost)} of {n} pages set on A never a hit on B: {lost[:4]}"
            if previous:  # evicted by this round's set: a miss or (not yet seen) a hit, never wrong
                _hits_within(b, previous, self.page_bytes, tries=1)
            previous = keys

    def test_cross_node_stale_cache_compressed_frames(self, node: Callable[..., Connector[Any]]) -> None:
        """The same with ``compression="zstd"`` and pages of both kinds: slots B has read
        are rewritten with frames of other lengths or whole pages; B never decodes other
        bytes and hits every new page within the tries."""
        n = 48
        a = node("a", compression="zstd", **self.capacity_settings(n))
        b = node("b", compression="zstd")
        pages = Pages(a, self.page_bytes, n)
        for round_ in range(4):
            keys = _keys(f"zstale{round_}", n)
            pages.fill(keys, _mixed)
            assert a.batch_set(keys, pages.pages) == [True] * n
            got = _hits_within(b, keys, self.page_bytes, pattern=_mixed)
            lost = [k for k, ok in zip(keys, got) if not ok]
            assert not lost, f"round {round_}: {len(lost)} of {n} pages set on A never a hit on B: {lost[:4]}"
        assert a.stats()["ops"]["counters"].get("frames_written", 0) > 0

    def test_cross_node_stale_cache_in_new_processes(self, roots: tuple[str, str],
                                                     namespace: Namespace) -> None:
        """The same with a new process for every set on A and every read on B."""
        n = 64
        on_a = self._settings(roots, "a", self.capacity_settings(n))
        on_b = self._settings(roots, "b", {})
        for round_ in range(3):
            keys = _keys(f"pstale{round_}", n)
            assert self._run(on_a, namespace, "set", keys) == [True] * n
            got = self._verify_until_hit(on_b, namespace, keys)
            assert got == ["hit"] * n, f"round {round_}: stored on A, lost on B: {_summary(keys, got)}"

    def test_cross_node_concurrent_writers_and_readers(self, node: Callable[..., Connector[Any]]) -> None:
        """A writer and a reader on each node, writers evicting all the time: no get returns
        wrong bytes, and every page a writer still holds is then a hit on the other node."""
        cap = 96
        writers = {w: node(w, **self.capacity_settings(cap)) for w in "ab"}
        readers = {w: node(w) for w in "ab"}
        written: dict[str, list[str]] = {"a": [], "b": []}
        errors: list[str] = []
        stop = time.monotonic() + 4.0
        lock = threading.Lock()

        def write(w: str) -> None:
            conn, batch, r = writers[w], 16, 0
            pages = Pages(conn, self.page_bytes, batch)
            while time.monotonic() < stop:
                keys = _keys(f"cc-{w}{r}", batch)
                pages.fill(keys)
                ok = conn.batch_set(keys, pages.pages)
                with lock:
                    written[w].extend(k for k, good in zip(keys, ok) if good)
                r += 1

        def read(w: str) -> None:
            conn, r = readers[w], 0
            pages = Pages(conn, self.page_bytes, 32)
            while time.monotonic() < stop:
                with lock:
                    pool = written["b" if w == "a" else "a"][-3 * cap:] + written[w][-cap:]
                keys = pool[r % max(1, len(pool) - 32):][:32]
                r += 7
                if not keys:
                    time.sleep(0.01)
                    continue
                ok = conn.batch_get(keys, pages.pages[:len(keys)])
                errors.extend(f"{w} read {k}: wrong bytes" for i, (k, good) in enumerate(zip(keys, ok))
                              if good and not pages.matches(i, k))

        threads = [threading.Thread(target=write, args=(w,)) for w in "ab"]
        threads += [threading.Thread(target=read, args=(w,)) for w in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[:5]
        assert written["a"] and written["b"]
        for w, other in (("a", "b"), ("b", "a")):
            held = [k for k, ok in zip(written[w], writers[w].batch_exists(written[w])) if ok]
            assert held, f"writer {w} holds nothing"
            got = _hits_within(node(other), held, self.page_bytes)
            lost = [k for k, ok in zip(held, got) if not ok]
            assert not lost, f"{len(lost)} of {len(held)} held by {w}, never a hit on {other}: {lost[:5]}"

    def test_cross_node_writer_killed_mid_batch_then_adopted(self, roots: tuple[str, str],
                                                            namespace: Namespace) -> None:
        """A process on A SIGKILLed mid-set: B never reads wrong bytes of its batch; a new
        process on A stores the batch again, and B then hits every page."""
        on_a, on_b = self._settings(roots, "a", {}), self._settings(roots, "b", {})
        for attempt, after_ms in enumerate((10, 40)):
            keys = _keys(f"kill{attempt}", 192)
            proc = worker.start_ready(self._command(on_a, namespace, "set", keys))
            time.sleep(after_ms / 1000)
            proc.kill()
            proc.wait(timeout=60)
            seen = self._run(on_b, namespace, "verify", keys)
            assert "wrong" not in seen, f"WRONG BYTES of a killed writer's batch: {_summary(keys, seen)}"
            assert self._run(on_a, namespace, "set", keys) == [True] * len(keys)
            got = self._verify_until_hit(on_b, namespace, keys)
            assert got == ["hit"] * len(keys), _summary(keys, got)

    def test_cross_node_eviction_is_seen_on_the_other_node(self, node: Callable[..., Connector[Any]]) -> None:
        """A writer at capacity evicts; on B the newest pages hit, evicted ones leave its
        index within the tries, and nothing reads back wrong."""
        cap = 32
        a, b = node("a", **self.capacity_settings(cap)), node("b")
        keys = _keys("ev", 4 * cap)
        pages = Pages(a, self.page_bytes, 8)
        for lo in range(0, len(keys), 8):
            pages.fill(keys[lo:lo + 8])
            assert a.batch_set(keys[lo:lo + 8], pages.pages) == [True] * 8
        kept = a.batch_exists(keys)
        assert 0 < sum(kept) <= cap + 8 and kept[-8:] == [True] * 8
        held = [k for k, ok in zip(keys, kept) if ok]
        assert _hits_within(b, held, self.page_bytes) == [True] * len(held)
        gone = [k for k, ok in zip(keys, kept) if not ok]
        for _ in range(TRIES):
            if not any(b.batch_exists(gone)):
                break
            time.sleep(TRY_GAP_S)
        assert not any(b.batch_exists(gone)), "evicted pages still indexed on the other node"
        rpages = Pages(b, self.page_bytes, len(gone))
        got = b.batch_get(gone, rpages.pages)
        assert not any(ok and not rpages.matches(i, k) for i, (k, ok) in enumerate(zip(gone, got)))

    def test_cross_node_unchecked_pages_refused(self, node: Callable[..., Connector[Any]],
                                                caplog: pytest.LogCaptureFixture) -> None:
        """``checksum=none`` on a shared root is refused, naming both settings; with
        ``multi_node=false`` it opens with a warning saying pages are not checked."""
        with pytest.raises(ConfigError, match=r"checksum=none.*multi_node"):
            node("a", checksum="none")
        with caplog.at_level("WARNING"):
            conn = node("a", checksum="none", multi_node="false")
        assert conn.capabilities.detects_corruption is False
        assert any("checksum=none" in r.getMessage() and "not checked" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]


def _mixed(key: str, nbytes: int) -> bytes:
    """KV-like (compressible) bytes for about half the keys, random bytes for the others."""
    return (kv_pattern if zlib.crc32(key.encode()) % 2 else page_pattern)(key, nbytes)


def _hits_within(conn: Connector[Any], keys: list[str], page_bytes: int, tries: int = TRIES,
                 pattern: Pattern = page_pattern) -> list[bool]:
    """Get ``keys`` on ``conn`` until all hit or ``tries`` run out, asserting no wrong
    bytes (``pattern``'s); the per-key hits."""
    pages = Pages(conn, page_bytes, len(keys))
    todo = list(range(len(keys)))
    hit = [False] * len(keys)
    for _ in range(tries):
        batch = [keys[i] for i in todo]
        got = conn.batch_get(batch, pages.pages[:len(batch)])
        for j, (i, ok) in enumerate(zip(todo, got)):
            if ok:
                assert pages.matches(j, keys[i], pattern), f"WRONG BYTES for {keys[i]}"
                hit[i] = True
        todo = [i for i in todo if not hit[i]]
        if not todo or tries == 1:
            break
        time.sleep(TRY_GAP_S)
    return hit


def _summary(keys: list[str], outcomes: list[Any]) -> str:
    counts = {o: outcomes.count(o) for o in set(outcomes)}
    odd = [(k, o) for k, o in zip(keys, outcomes) if o != "hit"][:5]
    return f"{counts} e.g. {odd}"
