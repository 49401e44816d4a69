"""Integration with real SGLang 0.5.23 (in .venv-sglang, built by `make setup-sglang`).

Every connector below is driven through SGLang's own objects: the backend is built by
StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig(...), host_pool) on real
MHA and MLA host pools (CPU), in page_first and layer_first layouts; pages go out of one pool
with batch_set_v1 and into another with batch_get_v1, and bytes are compared with SGLang's
get_data_page (tests/integration/sglang_roundtrip.py, run with .venv-sglang/bin/python, once
for all connectors so that SGLang's ~12 s import is paid once). Engines are started here.
A missing .venv-sglang fails these tests; it never skips them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.engines import MooncakeEngine, S3Engine
from hicache_l3.sglang.cli import check_config
from hicache_l3.sglang.config import (
    AdapterConfig,
    build_namespace,
    extra_config_for,
    load_config_file,
)
from hicache_l3.sglang.metrics import ReasonCounts

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
SCRIPT = REPO / "tests" / "integration" / "sglang_roundtrip.py"
BENCH = REPO / "benchmarks" / "sglang_controller.py"

# Every connector of the package, explicitly; a connector missing here is a failing test.
CONNECTORS = ["file", "mooncake", "nixl-file", "nixl-obj", "hf3fs"]
# The other layouts SGLang describes page by page, once (the connector does not matter there).
EXTRA_CASES = {"file": [["mha", "page_first_direct"], ["mha", "page_head"], ["mla", "page_first_direct"]]}
ROUNDTRIP_TIMEOUT = 600.0  # a hang bound: SGLang's import alone took 95 s on this shared machine


def require_sglang_venv() -> Path:
    """The SGLang venv's python; fails (never skips) when the venv was not built."""
    assert SGLANG_PY.exists(), (
        f"{SGLANG_PY} is missing: run `make setup-sglang` (scripts/setup-sglang.sh) to build the "
        "SGLang 0.5.23 venv these tests run against"
    )
    return SGLANG_PY


@pytest.fixture(scope="module")
def mooncake() -> Iterator[MooncakeEngine]:
    with MooncakeEngine(holder=True, segment_size="512 MB") as engine:
        yield engine


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Engine]:
    with S3Engine() as engine:
        yield engine


@pytest.fixture(scope="module")
def settings(mooncake: MooncakeEngine, s3: S3Engine, tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, tuple[str, dict[str, Any]]]:
    """label -> (connector, settings reaching the engine started here)."""
    root = tmp_path_factory.mktemp("sglang")
    return {
        "file": ("file", {"root": str(root / "file")}),
        "mooncake": ("mooncake", mooncake.settings),
        "nixl-file": ("nixl", {"mode": "file", "root": str(root / "nixl")}),
        "nixl-obj": ("nixl", {**s3.settings, "capacity_bytes": "256MiB"}),
        "hf3fs": ("hf3fs", {"root": str(root / "hf3fs")}),
    }


@pytest.fixture(scope="module")
def report(settings: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """Run the round trips of every connector in one SGLang process; the parsed report."""
    python = require_sglang_venv()
    spec = {
        "api_checks": True,
        "connectors": [{"label": label, "connector": settings[label][0], "settings": settings[label][1],
                        "extra_cases": EXTRA_CASES.get(label, [])} for label in CONNECTORS],
    }
    proc = subprocess.run([str(python), str(SCRIPT), json.dumps(spec)], capture_output=True, text=True,
                          timeout=ROUNDTRIP_TIMEOUT, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"round-trip script gave no report (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    parsed: dict[str, Any] = json.loads(lines[-1][len("REPORT "):])
    parsed["_stderr"] = proc.stderr[-4000:]
    return parsed


@pytest.mark.parametrize("label", CONNECTORS)
def test_roundtrip_through_sglang(report: dict[str, Any], label: str) -> None:
    """v1 zero-copy set/get between two real SGLang host pools, MHA and MLA, page_first and
    layer_first; no rewrite of stored pages; leading hits; legacy path; namespaces; clear.
    Hybrid models (tests/integration/sglang_hybrid.py): v2 set/get/exists of real Mamba and
    sliding-window host pools beside the KV pool, bytes compared, per-pool results, hit
    policies, namespaces per pool kind, MLA writer rules. Heterogeneous TP
    (tests/integration/sglang_hetero_tp.py): TP=1, 2 and 4 instances with tp_lcm_size read
    each other's page_head pages per head group; MLA shares across TP sizes. Draft pools
    (tests/integration/sglang_draft.py): draft, draft-indexer and draft-SWA host pools through
    v2, an MHA draft per TP rank beside an MLA target."""
    assert label in report, f"{label}: not run ({report.get('_stderr')})"
    entry = report[label]
    assert entry["failures"] == [], "\n".join(entry["failures"])
    cases = sorted(c["case"].split("/", 1)[1] for c in entry["cases"])
    want = ["draft", "hetero-tp", "hybrid", "mha/layer_first", "mha/page_first", "mla/layer_first",
            "mla/page_first"]
    want += ["/".join(c) for c in EXTRA_CASES.get(label, [])]
    assert cases == sorted(want)


def test_startup_refusals_and_engine_errors(report: dict[str, Any]) -> None:
    """No model and no tag, unknown keys, a host pool without dtype, page_unified are refused
    naming the cause; file_storage_path is accepted; engine errors become misses. And
    (tests/integration/sglang_api.py): prefix_keys change no answer; attention-DP replicas
    share their shard's pages; pool classes under either host-pool module; SGLang's clear
    path removes exactly our namespace; get_stats carries per-reason counts and feeds the
    Prometheus counter."""
    assert report["api"]["failures"] == [], "\n".join(report["api"]["failures"])


def test_controller_paths_bench_runs() -> None:
    """The controller benchmark runs (small): SGLang's file backend through
    _generic_page_set/_get and ours through _page_set/_get_zero_copy, bytes verified; the raw
    contenders (raw-2t-batch too), the steady-state store, the checksum-less store and the
    per-stage breakdown are reported; our pointer lists come from the learned pointer model
    (no get_page_buffer_meta call on our path), or from SGLang's function with
    --sglang-pointers."""
    python = require_sglang_venv()
    proc = subprocess.run([str(python), str(BENCH), "--pages", "64", "--reps", "1", "--steady-state",
                           "--no-checksum", "--json"],
                          capture_output=True, text=True, timeout=ROUNDTRIP_TIMEOUT, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    models = result["pointer_models"]
    assert models and all(m.startswith("PointerModel(") for m in models.values()), models
    assert result["verified"] is True
    assert result["set_ratio_median"] > 0 and result["get_ratio_median"] > 0
    assert result["cpu"]["model"] and "cpu: " in proc.stderr
    assert result["first_touch_gbps"] > 0 and "guest memory, first touch: " in proc.stderr
    ratios = result["ratios"]  # ours / raw (same pointers), fresh store and at capacity, 1 and 2 threads
    for raw in ("raw-1t", "raw-2t", "raw-2t-batch"):
        for key in (f"set_vs_{raw}_fresh", f"get_vs_{raw}", f"steady_set_vs_{raw}_overwrite",
                    f"steady_get_vs_{raw}", f"nocsum_set_vs_{raw}_fresh", f"nocsum_get_vs_{raw}"):
            assert ratios[key] > 0, key
            low, high = result["ratio_spreads"][key]  # the lowest and highest repetition
            assert 0 < low <= ratios[key] <= high, (key, low, ratios[key], high)
    assert result["evictions"]["hicache-l3-file-steady"] >= 64 and result["evictions"]["hicache-l3-file"] == 0
    stages = result["stages_ms_per_1024_pages"]
    assert set(stages) == {"hicache-l3-file", "hicache-l3-file-steady", "hicache-l3-file-nocsum"}
    for op in ("set", "get"):
        st = stages["hicache-l3-file"][op]
        assert st["io"] > 0 and st["sglang pointer lists"] == 0 and st["validation"] > 0
        parts = sum(v for k, v in st.items() if k != "total")
        assert parts <= st["total"] * 1.01  # exclusive stage times add up to at most the wall time
    ref = subprocess.run([str(python), str(BENCH), "--pages", "16", "--reps", "1", "--no-raw",
                          "--sglang-pointers", "--json"],
                         capture_output=True, text=True, timeout=ROUNDTRIP_TIMEOUT, cwd=REPO)
    assert ref.returncode == 0, ref.stderr[-4000:]
    result = json.loads(ref.stdout.strip().splitlines()[-1])
    assert result["verified"] is True and result["pointer_models"] == {"hicache-l3-file": "None"}
    for op in ("set", "get"):
        assert result["stages_ms_per_1024_pages"]["hicache-l3-file"][op]["sglang pointer lists"] > 0


def test_controller_bench_beyond_memory_runs() -> None:
    """The controller benchmark's --beyond-memory mode runs (small: stores of 96 MiB, the cgroup
    made and left): ours buffered and o_direct and raw O_DIRECT, every page read verified (a
    wrong page fails the run), GB/s, batch p50/p99 and the ratio to raw per op."""
    python = require_sglang_venv()
    proc = subprocess.Popen([str(python), str(BENCH), "--beyond-memory", "--beyond-cache", "64MiB",
                             "--beyond-store", "96MiB", "--reps", "1", "--beyond-batches", "2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        out, err = proc.communicate(timeout=ROUNDTRIP_TIMEOUT)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-4000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["meta"]["cgroup"] is True, report["meta"]["cgroup_why_not"]
    assert report["meta"]["store_bytes"] >= 96 << 20 and "break-even against recompute" in err
    for cgroups in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/memory")):  # v2, v1: removed again
        assert not (cgroups / f"hicache-l3-sgbench-{proc.pid}").exists()
    rows = {(r["contender"], r["op"]): r for r in report["results"]}
    for name in ("hicache-l3-file", "hicache-l3-file+o_direct", "raw-direct-16t"):
        for op in ("get", "set"):
            row = rows[(name, op)]
            assert row["gb_s"] > 0 and 0 < row["p50_ms"] <= row["p99_ms"] and row["x_raw"] > 0, row
    assert rows[("raw-direct-16t", "get")]["x_raw"] == 1.0

# ---- configuration and CLI (no SGLang needed) -------------------------------------------------
def test_extra_config_parsing() -> None:
    extra = extra_config_for("file", {"root": "/x"}, tag="t")
    cfg = AdapterConfig.from_extra_config(extra)
    assert (cfg.connector, cfg.settings, cfg.tag, cfg.interface_v1) == ("file", {"root": "/x"}, "t", True)
    assert AdapterConfig.from_extra_config({"connector": "3fs"}).connector == "hf3fs"
    for bad, word in [({}, "empty"), ({"backend_name": "x"}, "connector"),
                      ({"connector": "nope"}, "nope"), ({"connector": "file", "rot": 1}, "rot"),
                      ({"connector": "file", "interface_v1": "yes"}, "interface_v1")]:
        with pytest.raises(ValueError, match=word):
            AdapterConfig.from_extra_config(bad)
    with pytest.raises(ValueError, match="root"):
        AdapterConfig.from_extra_config({"connector": "file", "file": {}}).validate_settings()
    with pytest.raises(ValueError, match="extra_backend_tag"):
        build_namespace(model_name=None, tag="", kv_dtype="bfloat16", layout="page_first", page_size=64)
    a = build_namespace(model_name="m", tag="", kv_dtype="bfloat16", layout="page_first", page_size=64,
                        tp_rank=1, tp_size=2, mla_shared=True)
    b = build_namespace(model_name="m", tag="", kv_dtype="bfloat16", layout="page_first", page_size=64,
                        tp_rank=0, tp_size=2, mla_shared=True)
    assert a.digest() == b.digest()  # MLA: one copy for every TP rank


def test_reason_counts_are_deltas_per_pool_op_and_reason() -> None:
    """get_stats' per-reason counts: what moved since the previous call, per pool, op and
    result; a counter that went back (a reopened connector) counts from zero."""
    counts = ReasonCounts()
    snap = {"get": {"ok": 5, "failed": {"miss": 2}}, "set": {"ok": 3, "failed": {}}, "exists": {}}
    assert counts.delta({"kv": snap, "draft": {"get": {"ok": 1}}}) == {
        "kv": {"get": {"ok": 5, "miss": 2}, "set": {"ok": 3}}, "draft": {"get": {"ok": 1}}}
    assert counts.delta({"kv": snap, "draft": {"get": {"ok": 1}}}) == {}
    later = {"get": {"ok": 6, "failed": {"miss": 2, "corrupt": 1}}, "set": {"ok": 3}}
    assert counts.delta({"kv": later, "draft": {"get": {"ok": 0}}}) == {
        "kv": {"get": {"ok": 1, "corrupt": 1}}}
    assert counts.delta({"kv": later, "draft": {"get": {"ok": 4}}}) == {"draft": {"get": {"ok": 4}}}
    restarted = {"get": {"ok": 2}}
    assert counts.delta({"kv": restarted}) == {"kv": {"get": {"ok": 2}}}


@pytest.mark.parametrize("ext", ["toml", "json", "yaml"])
def test_sglang_args_writes_a_config_that_checks(tmp_path: Path, ext: str) -> None:
    path = tmp_path / f"hicache.{ext}"
    out = subprocess.run(
        [sys.executable, "-m", "hicache_l3.cli", "sglang-args", "--backend", "file", "--config", str(path),
         "--set", f"root={tmp_path / 'pages'}", "--tag", "demo"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert "--hicache-storage-backend dynamic" in out and f"@{path}" in out
    extra = load_config_file(path)
    assert extra["interface_v1"] == 1 and extra["file"]["root"] == str(tmp_path / "pages")
    assert check_config(path, pages=4).startswith("ok: file connector")
    proc = subprocess.run([sys.executable, "-m", "hicache_l3.cli", "check", "--config", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("ok:")


@pytest.mark.parametrize("label", CONNECTORS)
def test_check_round_trips_on_every_engine(settings: dict[str, tuple[str, dict[str, Any]]], label: str,
                                           tmp_path: Path) -> None:
    """`hicache-l3 check` passes on a config file reaching each engine started here."""
    connector, values = settings[label]
    path = tmp_path / "hicache.json"
    path.write_text(json.dumps(extra_config_for(connector, values)))
    assert check_config(path, pages=4).startswith(f"ok: {connector} connector")


def test_check_names_what_is_wrong(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**extra_config_for("mooncake", {}), "module_path": "x"}))
    proc = subprocess.run([sys.executable, "-m", "hicache_l3.cli", "check", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "module_path" in proc.stderr
    bad.write_text(json.dumps(extra_config_for("mooncake", {"master_address": ""})))
    proc = subprocess.run([sys.executable, "-m", "hicache_l3.cli", "check", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "master_address" in proc.stderr
