"""hicache-l3 replay: chained page keys, the workload's shape, the simulated L1/L2, byte
verification of L3 hits, determinism, the no-L3 baseline and the command line, against
the real file connector."""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import statistics
from pathlib import Path

import pytest

from hicache_l3.bench.replay import HIT_FIELDS, ReplayConfig, check_baseline, replay, summarize
from hicache_l3.bench.tiers import InstanceCache, L3Tier, page_pattern
from hicache_l3.bench.workload import TOKEN_BYTES, Context, WorkloadParams, generate, iter_agents
from hicache_l3.cli import main
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector

PAGE_BYTES = 4096
SMALL = WorkloadParams(sessions=16, turns=8, instances=3, fork_p=0.3, pause_p=0.3)
SMALL_CONFIG = ReplayConfig(page_bytes=PAGE_BYTES, l1_pages=256, l2_pages=512, batch=32)


def _tokens(seed: int, n: int) -> bytes:
    return random.Random(seed).randbytes(n * TOKEN_BYTES)


def _l3(root: Path, instances: int, config: ReplayConfig = SMALL_CONFIG) -> L3Tier:
    ns = Namespace(model="replay-test", kv_dtype="bfloat16", layout="page_first",
                   page_size=config.page_tokens)
    conns = [open_connector("file", ns, {"root": str(root), "page_bytes": config.page_bytes})
             for _ in range(instances)]
    return L3Tier(conns, config.page_bytes, config.batch)


# ---- page keys -----------------------------------------------------------------------------
def test_page_key_depends_on_every_token_before_it() -> None:
    a, b = Context(16), Context(16)
    data = bytearray(_tokens(1, 100))
    a.append(bytes(data))
    b.append(bytes(data))
    assert a.keys == b.keys and len(a.keys) == 100 // 16  # the partial page has no key
    data[TOKEN_BYTES * 20] ^= 1  # one token of page 1 changes
    c = Context(16)
    c.append(bytes(data))
    assert c.keys[0] == a.keys[0]
    assert all(x != y for x, y in zip(c.keys[1:], a.keys[1:]))


def test_appending_in_pieces_gives_the_same_keys() -> None:
    whole, pieces = Context(8), Context(8)
    data = _tokens(2, 77)
    whole.append(data)
    for lo in range(0, len(data), 13 * TOKEN_BYTES):
        pieces.append(data[lo : lo + 13 * TOKEN_BYTES])
    assert pieces.keys == whole.keys
    fork = whole.fork()
    fork.append(_tokens(3, 40))
    assert fork.keys[: len(whole.keys)] == whole.keys and len(whole.keys) == 77 // 8


# ---- workload ------------------------------------------------------------------------------
def test_workload_is_deterministic_per_seed() -> None:
    one, two = generate(SMALL, 64, seed=5), generate(SMALL, 64, seed=5)
    assert one.requests == two.requests and one.counts == two.counts
    other = generate(SMALL, 64, seed=6)
    assert [r.keys for r in other.requests] != [r.keys for r in one.requests]


def test_workload_shape() -> None:
    w = generate(SMALL, 64, seed=1)
    events = {r.event for r in w.requests}
    assert {"start", "turn", "resume", "fork", "join"} <= events
    assert w.counts["subagents"] > 0 and w.counts["pauses"] > 0
    assert [r.time for r in w.requests] == sorted(r.time for r in w.requests)
    growth = []
    for _, reqs in iter_agents(w):
        for prev, cur in itertools.pairwise(reqs):
            # contexts only grow: the previous prompt and its output are a prefix
            assert cur.keys[: len(prev.keys) + len(prev.out_keys)] == prev.keys + prev.out_keys
            growth.append(cur.prompt_tokens - prev.prompt_tokens)
    assert 100 <= statistics.median(growth) <= 2000  # a few hundred tokens per turn
    starts = [r for r in w.requests if r.event == "start"]
    shared = sum(1 for a in starts for b in starts if a is not b and a.keys[:16] == b.keys[:16])
    assert shared > 0  # sessions of one profile share system prompt and tool schemas
    by_agent = {name: reqs for name, reqs in iter_agents(w)}
    for r in w.requests:
        if r.event == "fork":  # a sub-agent starts from its parent's whole context
            parent = [p for p in by_agent[r.agent.rsplit(".", 2)[0]] if p.time < r.time][-1]
            assert r.keys[: len(parent.keys) + len(parent.out_keys)] == parent.keys + parent.out_keys
    assert len({r.instance for r in w.requests}) == SMALL.instances


def test_workload_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="pause_p"):
        generate(dataclasses.replace(SMALL, pause_p=1.5))
    with pytest.raises(ValueError, match="sessions"):
        generate(dataclasses.replace(SMALL, sessions=0))


# ---- simulated L1/L2 -----------------------------------------------------------------------
def test_l1_l2_evict_leaves_first() -> None:
    cache = InstanceCache(4, 8)
    a, b, c = ["a0", "a1", "a2", "a3"], ["b0", "b1", "b2", "b3"], ["c0", "c1"]
    cache.insert(a)
    cache.insert(b)
    assert cache.match(a) == (0, 4) and cache.match(b) == (4, 0)
    cache.insert(c)  # evicts b's last pages from L1, not its first
    assert cache.match(b) == (2, 2)
    assert cache.match(["b0", "x", "b2"]) == (1, 0)  # the match stops at the first miss


def test_l1_stays_inside_l2() -> None:
    cache = InstanceCache(16, 40)
    rng = random.Random(0)
    for _ in range(300):
        start = rng.randrange(100)
        cache.insert([f"k{i}" for i in range(start, start + rng.randrange(1, 20))])
        assert all(k in cache.l2 for k in cache.l1._pages)
    assert len(cache.l1) == 16 and len(cache.l2) == 40
    with pytest.raises(ValueError, match="l2_pages"):
        InstanceCache(8, 4)


# ---- L3 tier -------------------------------------------------------------------------------
def test_l3_hits_are_verified_byte_for_byte(tmp_path: Path) -> None:
    tier = _l3(tmp_path / "l3", 2)
    try:
        assert tier.store(0, ["good0", "good1", "good2"])[0] == 3
        res = tier.load(1, ["good0", "good1", "missing", "good2"])  # another instance reads
        assert (res.hits, res.verify_failures, res.get_failures) == (2, 0, 0)
        assert res.get_s > 0 and res.exists_s > 0
        # a page stored under a key with someone else's bytes must not count as a hit
        conn = tier.connector(0)
        view = tier.buffer.view()
        view[:PAGE_BYTES] = page_pattern("good0", PAGE_BYTES)
        assert conn.batch_set(["liar"], tier.pages[:1]) == [True]
        view.release()
        res = tier.load(0, ["good0", "liar", "good1"])
        assert (res.hits, res.verify_failures) == (1, 1)
    finally:
        tier.close()


def test_config_errors_name_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--l2-pages"):
        ReplayConfig(l1_pages=10, l2_pages=5).validate()
    with pytest.raises(ConfigError, match="--page-bytes"):
        ReplayConfig(page_bytes=1000).validate()
    assert main(["replay", "--quiet", "--set", "mooncake.x=1", "--workdir", str(tmp_path)]) == 1


# ---- the replay ----------------------------------------------------------------------------
def _hits(rows: list[dict]) -> list[tuple]:
    return [tuple(r[f] for f in HIT_FIELDS) for r in rows]


def test_replay_is_deterministic_shares_l3_across_instances_and_matches_baseline(tmp_path: Path) -> None:
    workload = generate(SMALL, SMALL_CONFIG.page_tokens, seed=3)
    runs = []
    for attempt in range(2):
        tier = _l3(tmp_path / f"l3-{attempt}", SMALL.instances)
        try:
            runs.append(replay(generate(SMALL, SMALL_CONFIG.page_tokens, seed=3), SMALL_CONFIG, tier))
        finally:
            tier.close()
    first, second = runs
    assert _hits(first.rows) == _hits(second.rows)
    summary = summarize(first.rows, SMALL_CONFIG, first.caches)
    assert summary["l3_hits"] > 0
    assert summary["l3_hits_cross_instance"] > 0
    assert summary["l3_verify_failures"] == 0 and summary["l3_get_failures"] == 0
    assert summary["l3_pages_verified"] == summary["l3_hits"]
    assert summary["hit_rate_with_l3"] > summary["hit_rate_no_l3"]
    assert summary["working_set_pages"] > SMALL_CONFIG.l2_pages  # caches smaller than the working set
    baseline = replay(workload, SMALL_CONFIG, None)
    check_baseline(first.rows, baseline.rows)
    assert all(r["l3_hits"] == 0 and r["ttft_s"] == r["ttft_no_l3_s"] for r in baseline.rows)
    for r in first.rows:
        hits = r["l1_hits"] + r["l2_hits"] + r["l3_hits"]
        assert r["recompute_tokens"] == r["prompt_tokens"] - hits * SMALL_CONFIG.page_tokens
        assert r["ttft_s"] == pytest.approx(r["l3_exists_s"] + r["l3_get_s"]
                                            + r["recompute_tokens"] / SMALL_CONFIG.prefill_tps)


def test_cli_writes_json_and_plot_and_repeats_exactly(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    args = ["replay", "--backend", "file", "--sessions", "12", "--turns", "6", "--seed", "7",
            "--page-bytes", "4KiB", "--l1-pages", "128", "--l2-pages", "256", "--quiet"]
    out1, out2, png = tmp_path / "r1.json", tmp_path / "r2.json", tmp_path / "r.png"
    assert main([*args, "--json", str(out1), "--plot", str(png), "--workdir", str(tmp_path / "w1")]) == 0
    report = capsys.readouterr().out
    assert "page hit rate" in report and "TTFT reduction" in report and "L1 128 pages" in report
    assert main([*args, "--json", str(out2), "--workdir", str(tmp_path / "w2")]) == 0
    one, two = json.loads(out1.read_text()), json.loads(out2.read_text())
    assert len(one["per_turn"]) == one["summary"]["requests"] > 0
    assert _hits(one["per_turn"]) == _hits(two["per_turn"])
    assert one["config"]["replay"]["prefill_tps"] == ReplayConfig().prefill_tps
    assert one["config"]["replay"]["l1_pages"] == 128
    assert one["config"]["workload"]["sessions"] == 12
    assert {"ttft_mean_s", "ttft_mean_no_l3_s", "l3_hit_rate"} <= set(one["summary"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
