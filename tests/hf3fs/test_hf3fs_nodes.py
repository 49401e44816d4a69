"""What several hf3fs nodes sharing one mount need: concurrent writer processes on one
index (distinct simulated nodes, no flock, ``node_worker.py``), index restart, takeover of
a dead node's writer directory, capacity per namespace, and slot reuse under eviction
never returning another key's bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.pages import Pages
from hicache_l3.conformance.slab_backdoor import index_records, live_entries
from hicache_l3.slab.format import Geometry

WORKER = Path(__file__).resolve().parent / "node_worker.py"
PAGE = 16 << 10


def _namespace(tag: str) -> Namespace:
    return Namespace(model="hf3fs/multi", kv_dtype="bfloat16", layout="page_first",
                     page_size=16, tag=tag)


def _spec(settings: dict[str, Any], namespace: Namespace, **kw: Any) -> str:
    return json.dumps({"settings": settings, "namespace": namespace.fields(),
                       "page_bytes": PAGE, **kw})


def _popen(spec: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(WORKER), spec], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _result(proc: subprocess.Popen[str], timeout: float = 90) -> dict[str, Any]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


@contextlib.contextmanager
def _held(spec: str) -> Any:
    """A worker that stored its keys and stays alive (until killed) as the owner."""
    proc = _popen(spec)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "READY", proc.stderr.read() if proc.stderr else ""
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _pages(conn: Any, keys: list[str]) -> Pages:
    pages = Pages(conn, PAGE, len(keys))
    pages.fill(keys)
    return pages


def test_writer_processes_on_several_nodes_share_one_index(tmp_path: Path) -> None:
    """Four processes, each a different (simulated) node with no flock, write at once;
    no slot holds two keys, each owns its own writer directory, and every process reads
    every page with the right bytes."""
    root = tmp_path / "mount"
    ns = _namespace("multi")
    parties, per = 4, 96
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    all_keys = [f"n{n}-k{i}" for n in range(parties) for i in range(per)]
    procs = []
    for n in range(parties):
        settings = {"root": str(root), "capacity_bytes": "256MiB", "usrbio": "off",
                    "max_writers": parties, "node_id": f"node-{n}", "node_locks": False,
                    "lease_s": 30, "rescan_s": 0.05}
        keys = all_keys[n * per : (n + 1) * per]
        procs.append(_popen(_spec(settings, ns, op="write_read", keys=keys, read_keys=all_keys,
                                  barrier=str(barrier), name=f"p{n}", parties=parties)))
    results = [_result(p) for p in procs]
    for r in results:
        assert r["set_ok"] == per and r["set_failed"] == 0
        assert (r["ok"], r["wrong"], r["miss"]) == (len(all_keys), 0, 0), r
    assert sorted(r["stats"]["writer"] for r in results) == list(range(parties))
    live = live_entries(root, ns)
    assert set(live) == set(all_keys)
    slots = [v[:3] for v in live.values()]
    assert len(set(slots)) == len(slots), "two keys in one slot"
    claims = sorted(p.name for p in root.glob(f"ns-{ns.digest()}/writers/w*/claim.*"))
    assert len(claims) == parties  # one claim (epoch 1) per writer directory


def test_index_survives_restart_and_keeps_generations_unique(tmp_path: Path) -> None:
    ns = _namespace("restart")
    settings = {"root": str(tmp_path / "m"), "capacity_bytes": 8 * Geometry(PAGE).stride,
                "usrbio": "off", "max_writers": 1}
    first = [f"a{i}" for i in range(6)]
    with open_connector("hf3fs", ns, settings) as conn:
        assert conn.batch_set(first, _pages(conn, first).pages) == [True] * 6
    second = [f"b{i}" for i in range(6)]
    with open_connector("hf3fs", ns, settings) as conn:
        pages = Pages(conn, PAGE, 6)
        assert conn.batch_get(first, pages.pages) == [True] * 6
        assert all(pages.matches(i, k) for i, k in enumerate(first))
        assert conn.stats()["engine"]["epoch"] is None  # reading needs no claim
        assert conn.batch_set(second, _pages(conn, second).pages) == [True] * 6
        assert conn.stats()["engine"]["epoch"] == 2  # the released directory, adopted
        got = conn.batch_get(first + second, Pages(conn, PAGE, 12).pages)
        assert got[6:] == [True] * 6 and sum(got[:6]) == 2  # 8 slots: oldest evicted
    records = [r for r in index_records(Path(settings["root"]), ns) if r[0] == 1]
    gens = [r[5] for r in records]
    assert len(set(gens)) == len(gens)
    assert all(g >> 40 == 2 for r, g in zip(records, gens) if r[1].startswith("b"))
    slots = [v[:3] for v in live_entries(Path(settings["root"]), ns).values()]
    assert len(set(slots)) == len(slots) == 8


def test_crashed_writer_on_this_node_is_adopted_at_once(tmp_path: Path) -> None:
    ns = _namespace("crash-local")
    settings = {"root": str(tmp_path / "m"), "capacity_bytes": "64MiB", "usrbio": "off",
                "max_writers": 1, "lease_s": 30}
    keys = [f"c{i}" for i in range(8)]
    with _held(_spec(settings, ns, op="hold", keys=keys)) as proc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    with open_connector("hf3fs", ns, settings) as conn:
        t0 = time.monotonic()
        more = ["c-new"]
        assert conn.batch_set(more, _pages(conn, more).pages) == [True]
        assert time.monotonic() - t0 < 2.0  # no lease wait: the PID is gone
        pages = Pages(conn, PAGE, 8)
        assert conn.batch_get(keys, pages.pages) == [True] * 8
        assert all(pages.matches(i, k) for i, k in enumerate(keys))
        assert conn.stats()["engine"]["takeovers"] == 1


def test_dead_nodes_writer_is_adopted_after_its_lease(tmp_path: Path) -> None:
    """Another node's writer directory is adopted only after its lease expires: while
    the owner lives (heartbeating) a new writer gets nothing, within a bounded wait."""
    ns = _namespace("crash-remote")
    lease = 1.0
    base = {"root": str(tmp_path / "m"), "capacity_bytes": "64MiB", "usrbio": "off",
            "max_writers": 1, "lease_s": lease, "node_locks": False}
    keys = [f"r{i}" for i in range(8)]
    with _held(_spec({**base, "node_id": "node-a"}, ns, op="hold", keys=keys)) as proc:
        with open_connector("hf3fs", ns, {**base, "node_id": "node-b"}) as conn:
            pages = _pages(conn, ["blocked"])
            t0 = time.monotonic()
            assert conn.batch_set(["blocked"], pages.pages[:1]) == [False]
            waited = time.monotonic() - t0
            assert lease <= waited <= 2 * 1.25 * lease + 0.5, waited
            assert conn.stats()["ops"]["set"]["failed"] == {"no_space": 1}
            # its pages are readable meanwhile
            got = Pages(conn, PAGE, 8)
            assert conn.batch_get(keys, got.pages) == [True] * 8
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        with open_connector("hf3fs", ns, {**base, "node_id": "node-b"}) as conn:
            pages = _pages(conn, ["after"])
            t0 = time.monotonic()
            assert conn.batch_set(["after"], pages.pages) == [True]
            waited = time.monotonic() - t0
            assert lease * 0.9 <= waited <= 2 * 1.25 * lease + 0.5, waited
            assert conn.stats()["engine"]["epoch"] == 2
            got = Pages(conn, PAGE, 9)
            assert conn.batch_get([*keys, "after"], got.pages) == [True] * 9
            assert all(got.matches(i, k) for i, k in enumerate([*keys, "after"]))


def test_superseded_owner_stops_publishing(tmp_path: Path) -> None:
    """An owner whose directory was adopted (a higher claim exists) fails its sets."""
    ns = _namespace("fenced")
    settings = {"root": str(tmp_path / "m"), "capacity_bytes": "64MiB", "usrbio": "off",
                "max_writers": 1, "lease_s": 0.4}
    with open_connector("hf3fs", ns, settings) as conn:
        assert conn.batch_set(["f0"], _pages(conn, ["f0"]).pages) == [True]
        wdir = next(Path(settings["root"]).glob("ns-*/writers/w0000"))
        (wdir / "claim.00000002").write_text(json.dumps({"node": "intruder", "pid": 1}))
        time.sleep(0.4)  # > one heartbeat period (lease_s / 4)
        assert conn.batch_set(["f1"], _pages(conn, ["f1"]).pages) == [False]
        assert conn.batch_exists(["f0", "f1"]) == [True, False]
        assert conn.stats()["engine"]["lease_valid"] is False


def test_capacity_is_per_namespace_across_writers(tmp_path: Path) -> None:
    ns = _namespace("capacity")
    stride = Geometry(PAGE).stride
    settings = {"root": str(tmp_path / "m"), "capacity_bytes": 3 * 5 * stride, "usrbio": "off",
                "max_writers": 3}
    conns = [open_connector("hf3fs", ns, settings) for _ in range(3)]
    try:
        for n, conn in enumerate(conns):
            keys = [f"cap{n}-{i}" for i in range(12)]
            pages = _pages(conn, keys)
            for lo in range(0, 12, 4):  # a batch fits the writer's 5 slots; older pages go
                assert conn.batch_set(keys[lo : lo + 4], pages.pages[lo : lo + 4]) == [True] * 4
        fourth = open_connector("hf3fs", ns, settings)
        conns.append(fourth)
        t0 = time.monotonic()
        assert fourth.batch_set(["cap-x"], _pages(fourth, ["cap-x"]).pages) == [False]
        assert time.monotonic() - t0 < 1.0  # all holders live on this node: no wait
    finally:
        for conn in conns:
            conn.close()
    live = live_entries(Path(settings["root"]), ns)
    assert len(live) == 15
    for n in range(3):
        assert sum(k.startswith(f"cap{n}-") for k in live) == 5


def test_slot_reuse_under_eviction_never_returns_another_keys_bytes(tmp_path: Path) -> None:
    """A writer with 4 slots rewrites them continuously while another process reads the
    recent keys: every hit has exactly its key's bytes; evicted keys are misses."""
    ns = _namespace("reuse")
    root = tmp_path / "m"
    base = {"root": str(root), "usrbio": "off", "rescan_s": 0.01}
    writer_settings = {**base, "capacity_bytes": 4 * Geometry(PAGE).stride, "max_writers": 1}
    keys_file = tmp_path / "keys.txt"
    keys_file.write_text("")
    stop = threading.Event()
    written: list[str] = []

    with open_connector("hf3fs", ns, writer_settings) as writer:
        pages = Pages(writer, PAGE, 4)

        def write() -> None:
            n = 0
            while not stop.is_set():
                batch = [f"re-{n + i}" for i in range(4)]
                pages.fill(batch)
                assert writer.batch_set(batch, pages.pages) == [True] * 4
                written.extend(batch)
                with open(keys_file, "a") as f:
                    f.write(" ".join(batch) + " ")
                n += 4
                time.sleep(0.002)  # paced, so that the reader also hits pages before their reuse

        t = threading.Thread(target=write)
        t.start()
        try:
            reader = _popen(_spec({**base, "max_writers": 1}, ns, op="read_loop",
                                  keys_file=str(keys_file), seconds=2.0, batch=8))
            r = _result(reader)
        finally:
            stop.set()
            t.join(30)
    assert r["wrong"] == 0, r
    assert r["ok"] > 0 and r["miss"] > 0, r
    assert len(written) > 40


def test_stale_entry_after_takeover_is_a_miss(tmp_path: Path) -> None:
    """A reader whose index still points at a slot that a new owner (new epoch) reused
    gets a miss, never the new occupant's bytes (the generation check)."""
    ns = _namespace("stale")
    settings = {"root": str(tmp_path / "m"), "capacity_bytes": 2 * Geometry(PAGE).stride,
                "usrbio": "off", "max_writers": 1}
    with open_connector("hf3fs", ns, settings) as first:
        assert first.batch_set(["old-0", "old-1"], _pages(first, ["old-0", "old-1"]).pages) == [True] * 2
    reader = open_connector("hf3fs", ns, settings)
    try:
        assert reader.batch_exists(["old-0", "old-1"]) == [True, True]
        store = reader._store
        assert store is not None
        frozen = store.index.table.export()
        with open_connector("hf3fs", ns, settings) as second:  # adopts w0000, epoch 2
            new = ["new-0", "new-1"]
            assert second.batch_set(new, _pages(second, new).pages) == [True, True]
            assert second.stats()["engine"]["evictions"] == 2
        store.index.table.load(*frozen)  # the stale pages back in their slots
        store.refresh = lambda: None  # type: ignore[method-assign]
        got = Pages(reader, PAGE, 2)
        assert reader.batch_get(["old-0", "old-1"], got.pages) == [False, False]
        assert reader.stats()["ops"]["get"]["failed"] == {"corrupt": 2}
    finally:
        reader.close()
