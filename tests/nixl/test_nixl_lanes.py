"""nixl file mode's lanes (connectors/nixl/lanes.py): a batch's bytes split between the
caller's agent and lane agents on their own threads, with NIXL's real POSIX plugin. A
get's split moves exactly the rows' bytes (the caller's part of the share asked) and a
shared get is byte-exact, at any share; the caller's share follows the parts' times
until they end together; a set at
capacity, its slots in two slab files, is written by two agents; a lane's engine error
falls back to one agent, a lane's timeout times the batch out (a set's slots held) and
the lane gets a fresh agent; taken lanes, one agent, an interrupted get."""

from __future__ import annotations

import os
import random
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3 import open_connector
from hicache_l3.common.errors import ConfigError, Reason
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.conformance import ConnectorTests
from hicache_l3.conformance.suite import Pages, _sigint_raises
from hicache_l3.connectors.nixl.base import TransferError
from hicache_l3.connectors.nixl.lanes import SHARE_MIN_BYTES, Balance, Lanes, by_file, split_rows
from hicache_l3.slab.format import Geometry
from hicache_l3.slab.store import split_min_slots

P = 64 << 10
N = 128  # 8 MiB: two shares of SHARE_MIN_BYTES or more


def _ns() -> Namespace:
    return Namespace(model="lanes/m", kv_dtype="bf16", layout="page_first", page_size=16,
                     tag=f"l{uuid.uuid4().hex[:10]}")


def _stored(root: Path, backwards: bool = False,
            **extra: Any) -> tuple[Any, list[str], HostBuffer, list[Any], bytes]:
    """A connector with N pages stored (backwards: no two rows of a get join), its keys,
    buffer, pages and the bytes set."""
    conn = open_connector("nixl", _ns(), {"root": str(root), **extra})
    buf = HostBuffer(N * P)
    buf.view()[:] = random.Random(3).randbytes(N * P)
    order = range(N - 1, -1, -1) if backwards else range(N)
    pages = [((buf.address + i * P, P),) for i in order]
    keys = [f"lane-{i}" for i in range(N)]
    conn.register(buf)
    assert conn.batch_set(keys, pages) == [True] * N
    return conn, keys, buf, pages, bytes(buf.view())


def _listed(rows: Any) -> list[Any]:
    """Rows as a list (of lists from a numpy array, of tuples as given)."""
    return rows.tolist() if hasattr(rows, "shape") else list(rows)


def _as_kind(rows: list[tuple[int, int, int]], kind: str) -> Any:
    """Rows as the C helpers may hand them: an m x 3 uint64 array, or a list of tuples."""
    return numpy.array(rows, dtype=numpy.uint64) if kind == "array" else rows


def _kind_of(rows: Any) -> str:
    return "array" if isinstance(rows, numpy.ndarray) else "list" if all(
        isinstance(r, tuple) for r in rows) else "?"


def _bytes_of(local: Any, remote: Any) -> list[tuple[int, int, int]]:
    """Every byte a transfer moves: (local address, remote offset, device)."""
    out = []
    for (addr, n, _), (off, m, dev) in zip(_listed(local), _listed(remote)):
        assert n == m > 0
        out += [(addr + k, off + k, dev) for k in range(n)]
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(1, 40), st.integers(0, 1 << 20),
                          st.integers(3, 5)), min_size=1, max_size=12),
       st.integers(1, 5), st.integers(1, 8), st.one_of(st.none(), st.floats(0.05, 0.95)),
       st.sampled_from(["array", "list"]))
def test_split_rows_moves_exactly_the_rows_bytes(rows: list[tuple[int, int, int, int]], parts: int,
                                                 align: int, first: float | None, kind: str) -> None:
    local = _as_kind([(a, n, 0) for a, n, _, _ in rows], kind)
    remote = _as_kind([(o, n, d) for _, n, o, d in rows], kind)
    pieces = split_rows(local, remote, parts, align, first=first)
    assert 1 <= len(pieces) <= parts
    assert all(_kind_of(lo) == _kind_of(ro) == kind for lo, ro in pieces)  # NIXL takes either
    moved = [b for lo, ro in pieces for b in _bytes_of(lo, ro)]
    assert moved == _bytes_of(local, remote)  # the same bytes, in order, each once
    total = sum(n for _, n, _, _ in rows)
    for lo, _ in pieces[:-1]:  # each cut on the alignment
        assert sum(r[1] for r in _listed(lo)) % align == 0 or total < align
    if first is not None and len(pieces) == parts >= 2:  # the first part: the share asked, cut down
        head = int(total * first)
        assert head - align < sum(r[1] for r in _listed(pieces[0][0])) <= head
    assert [list(r) for r in _listed(local)] == [[a, n, 0] for a, n, _, _ in rows]  # input left as it was


def _parts_times(share: float, own_rate: float, lane_rate: float, wake: float) -> tuple[float, float]:
    """How long the caller's part and the lanes take for one byte split at ``share``."""
    return share / own_rate, wake + (1 - share) / lane_rate


@pytest.mark.parametrize(("own_rate", "lane_rate", "wake"), [(1.0, 1.0, 0.0), (1.0, 0.8, 0.05),
                                                            (0.7, 1.0, 0.1), (1.0, 1.0, 0.3)])
def test_the_callers_share_moves_until_both_parts_end_together(own_rate: float, lane_rate: float,
                                                               wake: float) -> None:
    balance = Balance(2)
    assert balance.share == 0.5
    for _ in range(60):
        balance.observe(*_parts_times(balance.share, own_rate, lane_rate, wake))
    own_s, lanes_s = _parts_times(balance.share, own_rate, lane_rate, wake)
    assert abs(own_s - lanes_s) < 0.01 * max(own_s, lanes_s)  # they end together
    assert balance.observed == 60


def _get_times(balance: Balance | None, rounds: int, handoff: float,
               plain: Balance | None = None) -> tuple[list[float], int]:
    """``rounds`` modelled shared gets (equal rates, parts of ~250 us, a lane woken 20 us
    late): each get's time for the caller -- its part, or the lane's end plus ``handoff``
    when it had to wait -- and how many waits; ``balance`` is told the waits (None: a
    balance that only observes, ``plain``)."""
    b = balance if balance is not None else plain
    assert b is not None
    times, waits = [], 0
    for _ in range(rounds):
        own_s, lanes_s = _parts_times(b.share, 2000.0, 2000.0, 20e-6)
        waited = lanes_s > own_s
        waits += waited
        times.append(lanes_s + handoff if waited else own_s)
        if balance is not None:
            balance.waited(handoff if waited else None)
        b.observe(own_s, lanes_s)
    return times, waits


def test_the_lanes_learn_to_end_before_the_caller_by_its_hand_back() -> None:
    """A caller that waits for a lane gets on a hand-back after the lane's end (a futex
    wake, then the GIL): the balance learns it from the waits and shifts bytes to the
    caller so that it mostly finds the lanes done; its gets end sooner than with a
    balance that only aims at equal parts."""
    handoff = 40e-6
    learnt, plain = Balance(2), Balance(2)
    _get_times(learnt, 100, handoff)
    _get_times(None, 100, handoff, plain=plain)
    times, waits = _get_times(learnt, 200, handoff)
    plain_times, plain_waits = _get_times(None, 200, handoff, plain=plain)
    assert 0 < learnt.handoff <= handoff
    assert waits < 100 and plain_waits > 190  # mostly no wait, against nearly always
    assert sum(times) < sum(plain_times) - 200 * handoff / 4


def test_a_hand_back_learnt_too_big_shrinks_again() -> None:
    """One preempted caller's long wait is capped, and a hand-back estimate grown too
    big decays while the caller finds its lanes done, until it waits again: the
    estimate is not a ratchet."""
    balance, handoff = Balance(2), 40e-6
    for _ in range(30):
        balance.waited(1.0)  # a preempted caller, many times over
    assert balance.handoff == pytest.approx(Balance.HANDOFF_MAX, rel=0.01)
    _get_times(balance, 300, handoff)
    assert balance.handoff <= handoff
    balance.waited(-1.0)  # a clock read out of order: no hand-back
    assert 0 < balance.handoff <= handoff


def test_a_caller_that_waited_for_a_lane_teaches_the_balance_its_hand_back() -> None:
    """Lanes.run, on real threads (stand-in agents: the shares here move no bytes): a
    caller that waited for its lane feeds the balance the time it took to get on after
    the lane's end; one whose lane had long ended tells it there was no wait."""
    agent: Any = SimpleNamespace(poisoned=False, close=lambda: None)
    lanes = Lanes([agent], renew=lambda a: a)
    balance = Balance(2)
    try:
        assert lanes.run(lambda: None, [lambda _agent: time.sleep(0.02)], balance)  # the caller waits
        assert 0 < balance.handoff <= Balance.STEP * Balance.HANDOFF_MAX and balance.observed == 1
        learnt = balance.handoff
        assert lanes.run(lambda: time.sleep(0.02), [lambda _agent: None], balance)  # the lane long done
        assert balance.handoff == pytest.approx(learnt * (1 - Balance.DECAY)) and balance.observed == 2
    finally:
        lanes.close()


def test_the_callers_share_stays_within_bounds_and_ignores_empty_times() -> None:
    balance = Balance(2)
    for _ in range(100):
        balance.observe(*_parts_times(balance.share, 1.0, 0.01, 0.0))  # a lane 100x slower
    assert balance.share == Balance.HIGH
    for _ in range(100):
        balance.observe(*_parts_times(balance.share, 0.01, 1.0, 0.0))  # the caller 100x slower
    assert balance.share == Balance.LOW
    balance.observe(0.0, 1.0)
    balance.observe(1.0, -1.0)
    assert balance.share == Balance.LOW and balance.observed == 200


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 1 << 20), st.integers(3, 6)), min_size=1, max_size=16),
       st.integers(1, 4), st.sampled_from(["array", "list"]))
def test_by_file_deals_each_file_whole_to_one_part(rows: list[tuple[int, int]], parts: int,
                                                   kind: str) -> None:
    local = _as_kind([(0x1000 * k, n, 0) for k, (n, _) in enumerate(rows)], kind)
    remote = _as_kind([(0x2000 * k, n, fd) for k, (n, fd) in enumerate(rows)], kind)
    pieces = by_file(local, remote, parts)
    files = {fd for _, fd in rows}
    assert len(pieces) == min(parts, len(files))
    seen: list[int] = []
    for lo, ro in pieces:
        assert _kind_of(lo) == _kind_of(ro) == kind
        lo, ro = _listed(lo), _listed(ro)
        assert len(lo) == len(ro) > 0 and [r[1] for r in lo] == [r[1] for r in ro]
        assert [r[0] // 0x1000 for r in lo] == [r[0] // 0x2000 for r in ro]  # rows kept in pairs
        here = {int(r[2]) for r in ro}
        assert not here & set(seen)  # a file in one part only
        seen += here
        assert [r[0] for r in ro] == sorted(r[0] for r in ro)  # each file's rows in their order
    dealt = sorted(int(r[0]) for _, ro in pieces for r in _listed(ro))
    assert dealt == [0x2000 * k for k in range(len(rows))]


@pytest.mark.parametrize("backwards", [False, True])
def test_a_big_get_is_shared_by_the_lanes_byte_exact(tmp_path: Path, backwards: bool) -> None:
    conn, keys, buf, pages, want = _stored(tmp_path, backwards)
    with conn:
        assert conn.stats()["engine"]["lanes"] == 1
        for _ in range(3):
            buf.view()[:] = bytes(N * P)
            assert conn.batch_get(keys, pages) == [True] * N
            assert bytes(buf.view()) == want
        assert conn.stats()["engine"]["lane_shared_batches"] == 3
        assert conn._read_balance.observed == 3  # each shared get's times taken


def _lane_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("hicache-nixl-lane-")]


def test_lanes_sleep_between_batches_on_the_cpus_they_started_with(tmp_path: Path) -> None:
    """After shared gets, every lane thread sleeps, blocked on its semaphore, until the next
    batch (none spins between calls), and no lane's CPU affinity was changed."""
    allowed = os.sched_getaffinity(0)
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        lanes = {t.native_id: t.name for t in _lane_threads() if t.native_id is not None}
        assert lanes, "no lane thread started"
        for _ in range(3):
            buf.view()[:] = bytes(N * P)
            assert conn.batch_get(keys, pages) == [True] * N
            assert bytes(buf.view()) == want
        assert conn.stats()["engine"]["lane_shared_batches"] == 3
        time.sleep(0.05)
        for _ in range(5):
            running = {name: _state(tid) for tid, name in lanes.items() if _state(tid) not in "SD"}
            assert not running, running
            time.sleep(0.01)
        assert all(os.sched_getaffinity(tid) == allowed for tid in lanes), allowed


def _state(tid: int) -> str:
    """The scheduler state of thread ``tid`` of this process (R running, S sleeping...)."""
    stat = Path(f"/proc/self/task/{tid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


@pytest.mark.parametrize("share", [Balance.LOW, 0.5, Balance.HIGH])
def test_a_shared_get_is_byte_exact_at_any_share(tmp_path: Path, share: float) -> None:
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        balance = conn._read_balance
        balance.observe = lambda own_s, lanes_s: None  # the share stays where the test put it
        balance.share = share
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        assert conn.stats()["engine"]["lane_shared_batches"] == 1


def test_a_small_get_goes_alone(tmp_path: Path) -> None:
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        small = SHARE_MIN_BYTES // P  # half of what two shares need
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys[:small], pages[:small]) == [True] * small
        assert bytes(buf.view())[:small * P] == want[:small * P]
        assert conn.stats()["engine"]["lane_shared_batches"] == 0


def _break_lane(conn: Any, reason: Reason) -> list[int]:
    """Make the lane's agent fail its next transfers with ``reason`` (a timeout poisons it,
    as a real one does); the list counts the failed calls."""
    agent = conn._lanes.agents[0]
    calls: list[int] = []

    def transfer(*_: Any) -> None:
        calls.append(1)
        if reason is Reason.TIMEOUT:
            agent.poisoned = True
        raise TransferError("injected", reason)

    agent.transfer = transfer
    return calls


def test_a_lane_engine_error_falls_back_to_one_agent(tmp_path: Path) -> None:
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        calls = _break_lane(conn, Reason.ENGINE_ERROR)
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        assert calls == [1]
        assert conn._read_balance.observed == 0  # a failed part's time teaches nothing


def test_a_lane_timeout_times_out_the_batch_and_renews_the_lane(tmp_path: Path) -> None:
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        old = conn._lanes.agents[0]
        _break_lane(conn, Reason.TIMEOUT)
        assert conn.batch_reasons("get", keys, pages) == [Reason.TIMEOUT] * N
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        engine = conn.stats()["engine"]
        assert engine["lane_renewals"] == 1 and engine["agent_renewals"] == 0
        assert conn._lanes.agents[0] is not old


def test_taken_lanes_leave_the_get_to_its_caller(tmp_path: Path) -> None:
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        with conn._lanes._taken:  # another caller's get holds them
            buf.view()[:] = bytes(N * P)
            assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        assert conn.stats()["engine"]["lane_shared_batches"] == 0


def test_concurrent_gets_are_each_byte_exact(tmp_path: Path) -> None:
    conn, keys, _, _, want = _stored(tmp_path)
    with conn:
        half = N // 2
        dst = [HostBuffer(half * P) for _ in range(2)]
        for d in dst:
            conn.register(d)
        errors: list[str] = []

        def reader(k: int) -> None:
            mine = [((dst[k].address + i * P, P),) for i in range(half)]
            for _ in range(20):
                dst[k].view()[:] = bytes(half * P)
                if conn.batch_get(keys[k * half:(k + 1) * half], mine) != [True] * half \
                        or bytes(dst[k].view()) != want[k * half * P:(k + 1) * half * P]:
                    errors.append(f"reader {k}")

        threads = [threading.Thread(target=reader, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []


def test_one_read_agent_means_no_lanes_and_bad_counts_are_refused(tmp_path: Path) -> None:
    conn, keys, buf, pages, want = _stored(tmp_path, transfer_agents=1)
    with conn:
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        assert conn.stats()["engine"]["lanes"] == 0
    with pytest.raises(ConfigError, match="transfer_agents"):
        open_connector("nixl", _ns(), {"root": str(tmp_path / "x"), "transfer_agents": 0})


# (the injected interrupt may land in a finalizer the garbage collector runs: see the suite's test)
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupted_shared_get_leaves_no_lane_writing(tmp_path: Path) -> None:
    """The conformance suite's interrupted-get check on gets the lanes share: once the
    interrupt reaches the caller, no lane still writes into its pages."""
    import _thread

    conn = open_connector("nixl", _ns(), {"root": str(tmp_path)})
    with conn:
        keys = [f"intr-{i}" for i in range(N)]
        pages = Pages(conn, P, N)
        pages.fill(keys)
        assert conn.batch_set(keys, pages.pages) == [True] * N
        with _sigint_raises():
            interrupted = ConnectorTests._interrupt_gets(conn, keys, pages, _thread.interrupt_main)
        assert interrupted > 0, "no interrupt landed: the test saw nothing"
        assert conn.stats()["engine"]["lane_shared_batches"] > 0
        pages.wipe()
        assert conn.batch_get(keys, pages.pages) == [True] * N
        assert all(pages.matches(i, k) for i, k in enumerate(keys))


# ---- sets: a batch's slots in two slab files, written by two agents at once ----------------
def _full(root: Path) -> tuple[Any, HostBuffer, list[Any]]:
    """A connector whose store (two slabs) is at capacity: the next batch evicts from both."""
    stride = Geometry(P).stride
    slots = 2 * split_min_slots(stride)
    conn = open_connector("nixl", _ns(), {"root": str(root), "capacity_bytes": slots * stride})
    buf = HostBuffer(N * P)
    buf.view()[:] = random.Random(4).randbytes(N * P)
    pages = [((buf.address + i * P, P),) for i in range(N)]
    conn.register(buf)
    for lo in range(0, slots, N):
        assert conn.batch_set([f"fill-{lo + i}" for i in range(N)], pages) == [True] * N
    return conn, buf, pages


def test_a_set_at_capacity_is_written_by_two_agents_byte_exact(tmp_path: Path) -> None:
    conn, buf, pages = _full(tmp_path)
    with conn:
        want = bytes(buf.view())
        shared = conn.stats()["engine"]["lane_shared_batches"]
        keys = [f"new-{i}" for i in range(N)]
        assert conn.batch_set(keys, pages) == [True] * N
        assert conn.stats()["engine"]["lane_shared_batches"] == shared + 1
        assert {e.slab for e in (conn._store.lookup(keys)[i].entry for i in (0, N - 1))} == {0, 1}
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want


def test_a_lane_write_timeout_holds_every_slot_of_the_batch(tmp_path: Path) -> None:
    conn, buf, pages = _full(tmp_path)
    with conn:
        want = bytes(buf.view())
        _break_lane(conn, Reason.TIMEOUT)
        keys = [f"late-{i}" for i in range(N)]
        assert conn.batch_reasons("set", keys, pages) == [Reason.TIMEOUT] * N
        assert conn.batch_exists(keys) == [False] * N
        assert conn.stats()["engine"]["quarantined_slots"] == N  # never reused: a write may land
        assert conn.batch_set(keys, pages) == [True] * N  # a fresh lane agent
        assert conn.stats()["engine"]["lane_renewals"] == 1
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want


def test_a_lane_write_error_falls_back_to_one_agent(tmp_path: Path) -> None:
    conn, buf, pages = _full(tmp_path)
    with conn:
        want = bytes(buf.view())
        calls = _break_lane(conn, Reason.ENGINE_ERROR)
        keys = [f"retry-{i}" for i in range(N)]
        assert conn.batch_set(keys, pages) == [True] * N
        assert calls == [1]
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
