"""nixl file mode's checked get verified as it lands (``NixlTransport._read_hot``): a batch
whose pages carry checksums is cut in runs of about ``HOT_BYTES``, each moved by its own
NIXL transfer, then its marker records read, then its pages hashed, by the thread that
moved it, the lanes taking a share of the runs. With NIXL's real POSIX plugin: the same
Reason per key, bytes and index as the reference paths on the damaged batch of
test_nixl_plan, for any run size, with and without the lanes; a run's engine error
falls back to the reference's isolation on the caller's agent; a timeout in a later run
times the whole batch out, as one transfer of it does; and the cutting rules (runs and
parts) cover every page once."""

from __future__ import annotations

import os
import random
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_l3.common.errors import Reason
from hicache_l3.common.memory import HostBuffer
from hicache_l3.connectors.nixl import file as nixl_file
from hicache_l3.connectors.nixl.base import TransferError
from tests.nixl.test_nixl_plan import EXPECTED, P, _damaged_store, _get, _ns, _open

N = 16


def _spy_runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """The page ranges whose marker records a planned get reads (one per run)."""
    runs: list[tuple[int, int]] = []
    real = nixl_file.batch_lib.NixlBatchLib.plan_markers

    def plan_markers(self: Any, fds: Any, offs: Any, expect: Any, status: Any, lo: int = 0,
                     hi: int | None = None, scratch: Any = None) -> int:
        runs.append((lo, len(fds) if hi is None else hi))
        return real(self, fds, offs, expect, status, lo, hi, scratch)

    monkeypatch.setattr(nixl_file.batch_lib.NixlBatchLib, "plan_markers", plan_markers)
    return runs


def _spy_shared(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each get's pages were shared with the lanes (_share_read_pages' answers)."""
    shared: list[bool] = []
    real = nixl_file.NixlFileConnector._share_read_pages

    def share_pages(self: Any, *a: Any) -> bool:
        shared.append(real(self, *a))
        return shared[-1]

    monkeypatch.setattr(nixl_file.NixlFileConnector, "_share_read_pages", share_pages)
    return shared


@pytest.mark.parametrize("run_pages", [1, 3, 5, 64])
@pytest.mark.parametrize("lanes", [True, False])
@pytest.mark.parametrize("segments", [1, 4])
def test_a_get_verified_in_runs_agrees_with_the_reference(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          run_pages: int, lanes: bool, segments: int) -> None:
    """The damaged batch (misses, a flipped and a torn slot, a page without checksum, a
    size mismatch, a recycled slot) read in runs of ``run_pages`` pages, shared with the
    lanes or not: the reference's Reasons, bytes and index."""
    ns = _ns()
    keys, src = _damaged_store(tmp_path, ns)
    reference = _get(tmp_path, ns, keys, "python", "xxh3", segments)
    monkeypatch.setattr(nixl_file, "HOT_BYTES", run_pages * P)
    # lanes: share a batch this small (two parts of at least a page); else never
    monkeypatch.setattr(nixl_file, "SHARE_MIN_BYTES", P if lanes else 1 << 40)
    runs, shared = _spy_runs(monkeypatch), _spy_shared(monkeypatch)
    planned = _get(tmp_path, ns, keys, "planned", "xxh3", segments)
    assert planned[3:] == (1, 1)  # a plan, read by read_plan
    assert planned[0] == reference[0] == EXPECTED["xxh3"]
    assert planned[1] == reference[1] and planned[2] == reference[2]
    for i, r in enumerate(EXPECTED["xxh3"]):
        if r is Reason.OK:
            assert planned[1][i * P:(i + 1) * P] == src[i * P:(i + 1) * P], i
    count = sum(r is not Reason.MISS and r is not Reason.SIZE_MISMATCH and r is not Reason.UNVERIFIED
                for r in EXPECTED["xxh3"])  # the pages the plan reads
    ordered = sorted(runs)  # (the lanes' runs interleave with the caller's): every page once
    assert ordered[0][0] == 0 and ordered[-1][1] == count
    assert all(b == c for (_, b), (c, _) in pairwise(ordered))
    assert len(runs) >= (count + run_pages - 1) // (2 * run_pages)  # runs of about run_pages
    if lanes and len(os.sched_getaffinity(0)) > 1:  # (one CPU: no lanes)
        assert shared == [True]
    else:
        assert True not in shared


def _stored(root: Path, n: int = N, **extra: Any) -> tuple[Any, list[str], HostBuffer, list[Any], bytes]:
    """A connector with ``n`` pages stored with checksums, its keys, buffer, pages, bytes."""
    conn = _open(root, _ns(), **extra)
    buf = HostBuffer(n * P)
    buf.view()[:] = random.Random(7).randbytes(n * P)
    pages = [((buf.address + i * P, P),) for i in range(n)]
    keys = [f"hot-{i}" for i in range(n)]
    conn.register(buf)
    assert conn.batch_set(keys, pages) == [True] * n
    return conn, keys, buf, pages, bytes(buf.view())


def _fail(agent: Any, reason: Reason, at_call: int) -> list[int]:
    """Make ``agent``'s ``at_call``-th transfer from now (1: the next) fail with ``reason``
    (a timeout poisons it, as a real one does); the list counts its transfers."""
    real = agent.transfer
    calls: list[int] = []

    def transfer(*a: Any) -> None:
        calls.append(1)
        if len(calls) == at_call:
            if reason is Reason.TIMEOUT:
                agent.poisoned = True
            raise TransferError("injected", reason)
        real(*a)

    agent.transfer = transfer
    return calls


def test_a_run_engine_error_isolates_pages_on_the_callers_agent(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A lane's run fails (engine error) after others landed: the batch is read again as
    the reference reads it after its joined transfer failed (rows one per segment, on the
    caller's agent): every page, byte exact; the lane's agent is not called again."""
    monkeypatch.setattr(nixl_file, "HOT_BYTES", 2 * P)
    monkeypatch.setattr(nixl_file, "SHARE_MIN_BYTES", P)
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        assert conn._lanes, "lanes need two CPUs (the test set-up's machines have them)"
        calls = _fail(conn._lanes.agents[0], Reason.ENGINE_ERROR, 2)  # its second run
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        assert calls == [1, 1]
        assert conn._read_balance.observed == 0  # a failed part's time teaches nothing


@pytest.mark.parametrize("lanes", [True, False])
def test_a_timeout_in_a_later_run_times_the_batch_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      lanes: bool) -> None:
    """The caller's second run times out after its first landed and was verified: every
    page of the batch TIMEOUT, as when one transfer of the batch times out; the next get
    (a renewed agent) is exact."""
    monkeypatch.setattr(nixl_file, "HOT_BYTES", 2 * P)
    monkeypatch.setattr(nixl_file, "SHARE_MIN_BYTES", P if lanes else 1 << 40)
    conn, keys, buf, pages, want = _stored(tmp_path)
    with conn:
        calls = _fail(conn.agent, Reason.TIMEOUT, 2)
        assert conn.batch_reasons("get", keys, pages) == [Reason.TIMEOUT] * N
        assert calls == [1, 1]  # nothing more on the timed-out agent
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        assert conn.stats()["engine"]["agent_renewals"] == 1


def test_a_get_without_checksums_is_one_transfer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages stored without a checksum are read as before: one transfer of the batch (the
    marker records after it), not in runs."""
    monkeypatch.setattr(nixl_file, "HOT_BYTES", 2 * P)
    conn, keys, buf, pages, want = _stored(tmp_path, checksum="none")
    with conn:
        runs = _spy_runs(monkeypatch)
        buf.view()[:] = bytes(N * P)
        assert conn.batch_get(keys, pages) == [True] * N
        assert bytes(buf.view()) == want
        assert runs == [(0, N)]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(1, 300), st.sampled_from([1, 4096, 64 << 10, 1 << 20, 8 << 20]),
       st.integers(1, 5), st.integers(1, 2048))
def test_runs_cover_every_page_once_in_about_hot_bytes(lo: int, count: int, size: int, per: int,
                                                        max_descs: int) -> None:
    """Runs of consecutive pages, none empty, every page in one; of about HOT_BYTES (2/3 to
    2 times) unless one page is more, or more runs keep a run's segments within max_descs
    (pages of ``per`` segments each)."""
    at = range(0, per * (lo + count) + 1, per)
    hot = nixl_file.HOT_BYTES
    runs = nixl_file._runs(lo, lo + count, size, at, max_descs)
    assert runs[0][0] == lo and runs[-1][1] == lo + count
    assert all(a < b for a, b in runs) and all(b == c for (_, b), (c, _) in pairwise(runs))
    rows_fit = max(1, max_descs // per)  # pages whose rows fit one transfer
    for a, b in runs:
        assert b - a <= rows_fit
        assert b - a == 1 or (b - a) * size <= 2 * hot
    if count * size >= hot and rows_fit * size >= 2 * hot:  # bytes alone cut the runs
        assert all(3 * (b - a) * size >= 2 * hot - 3 * size for a, b in runs)
    assert nixl_file._runs(lo, lo, size, at, max_descs) == []


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 300), st.integers(1, 8), st.floats(0.0, 1.0))
def test_page_parts_cover_every_page_once(n: int, parts: int, first: float) -> None:
    parts = min(parts, n)
    bounds = nixl_file._page_bounds(n, parts, first)
    assert len(bounds) == parts + 1 and bounds[0] == 0 and bounds[-1] == n
    assert all(a < b for a, b in pairwise(bounds))
    if parts > 1:
        assert abs(bounds[1] - n * first) <= max(1, parts) or bounds[1] in (1, n - parts + 1)
        rest = [b - a for a, b in pairwise(bounds[1:])]
        assert max(rest) - min(rest) <= 1
