"""The bench CLI produces the documented JSON/CSV shape (speed is never asserted here)."""

from __future__ import annotations

import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_l3.bench.runner import balanced_ratio
from hicache_l3.cli import main

FIELDS = {"backend", "op", "page_size", "batch", "pages", "gib_per_s", "pages_per_s", "p50_ms", "p99_ms"}


def test_bench_json_and_csv(tmp_path: Path, capsys) -> None:
    out, table = tmp_path / "out.json", tmp_path / "out.csv"
    code = main(["bench", "--page-size", "16KiB", "--pages", "96", "--batch", "32", "--reps", "2",
                 "--json", str(out), "--csv", str(table), "--quiet", "--workdir", str(tmp_path / "w")])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    by = {(r["backend"], r["op"]): r for r in rows}
    assert set(by) == {("file", "set"), ("file", "get"), ("file", "exists"),
                       ("raw-posix", "set"), ("raw-posix", "get")}
    for row in rows:
        assert set(row) >= FIELDS
        assert row["page_size"] == 16384 and row["pages"] == 96 and row["batch"] == 32
        assert row["pages_per_s"] > 0
    assert by[("file", "get")]["ratio_to_raw"] > 0 and by[("file", "get")]["raw_backend"] == "raw-posix"
    assert "ratio_to_raw" not in by[("raw-posix", "get")]
    with open(table) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    printed = capsys.readouterr().out
    assert "raw-posix" in printed and "ratio_to_raw" in printed
    cpu = json.loads(out.read_text())["meta"]["cpu"]
    assert cpu["model"] and isinstance(cpu["avx2"], bool) and isinstance(cpu["avx512f"], bool)
    assert f"cpu: {cpu['model']}" in printed.splitlines()[0]


def test_cpu_info_reads_model_and_flags(tmp_path: Path) -> None:
    """The first processor's model name and whether avx2 / avx512f are among its flags."""
    from hicache_l3.bench.runner import cpu_info, describe_cpu

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Test CPU @ 2.0GHz\nflags\t\t: fpu sse avx2 bmi2\n\n"
                    "processor\t: 1\nmodel name\t: Other\nflags\t\t: avx512f\n")
    info = cpu_info(fake)
    assert info["model"] == "Test CPU @ 2.0GHz" and info["avx2"] is True and info["avx512f"] is False
    line = describe_cpu(info)
    assert line.startswith("cpu: Test CPU @ 2.0GHz (") and line.endswith("avx2, no avx512f)")
    assert cpu_info(tmp_path / "missing")["model"]  # no /proc: the platform's name, never empty


def test_bench_help_and_bad_arguments() -> None:
    help_text = subprocess.run([sys.executable, "-m", "hicache_l3.cli", "bench", "--help"],
                               capture_output=True, text=True, timeout=60)
    assert help_text.returncode == 0 and "--page-size" in help_text.stdout and "raw" in help_text.stdout
    bad = subprocess.run([sys.executable, "-m", "hicache_l3.cli", "bench", "--page-size", "huge"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "'huge' is not a size" in bad.stderr
    unknown = subprocess.run([sys.executable, "-m", "hicache_l3.cli", "bench", "--backend", "ftp",
                              "--pages", "8", "--reps", "1", "--quiet"],
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 1 and "unknown connector 'ftp'" in unknown.stderr


def test_bench_mixed_and_cold_rows(tmp_path: Path) -> None:
    out = tmp_path / "mixed.json"
    code = main(["bench", "--page-size", "16KiB", "--pages", "64", "--batch", "16", "--reps", "1",
                 "--ops", "mixed", "--cache", "both", "--read-fraction", "0.5", "--quiet",
                 "--json", str(out)])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["backend"], r["cache"]) for r in rows} == {
        ("file", "warm"), ("file", "cold"), ("raw-posix", "warm"), ("raw-posix", "cold")}
    assert all(r["op"] == "mixed" and r["read_fraction"] == 0.5 for r in rows)


def test_bench_plot_is_a_png(tmp_path: Path) -> None:
    png = tmp_path / "out.png"
    assert main(["bench", "--page-size", "16KiB", "--pages", "32", "--batch", "16", "--reps", "1",
                 "--ops", "get", "--quiet", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_memory_backend(tmp_path: Path) -> None:
    """The reference connector's bench backend: the connector and raw-dict, every op."""
    out = tmp_path / "memory.json"
    code = main(["bench", "--backend", "memory", "--page-size", "16KiB", "--pages", "64", "--batch", "16",
                 "--reps", "1", "--quiet", "--json", str(out), "--workdir", str(tmp_path / "w")])
    assert code == 0
    rows = json.loads(out.read_text())["results"]
    assert {(r["backend"], r["op"]) for r in rows} == {
        (b, op) for b in ("memory", "raw-dict") for op in ("set", "get", "exists")}
    assert all(r["raw_backend"] == "raw-dict" for r in rows if r["backend"] == "memory")


def test_ratio_balances_the_order_of_the_targets() -> None:
    """Repetitions alternate who goes first; a first-runner penalty of 30% (connector first:
    0.7, raw first: 1/0.7) cancels in the reported ratio, where a plain median of the seven
    would land on 0.7."""
    first, second = 0.7, 1 / 0.7
    ratios = [first, second] * 3 + [first]
    assert statistics.median(ratios) == first
    assert balanced_ratio(ratios) == pytest.approx(1.0)
    assert balanced_ratio([0.9, 1.6, 0.8, 1.25]) == pytest.approx((1.2 + 1.0) / 2)
    assert balanced_ratio([0.8]) == 0.8
    with pytest.raises(ValueError):
        balanced_ratio([])


def test_bench_idle_sleeps_before_every_timed_op_off_the_clock(tmp_path: Path) -> None:
    """--idle-ms: a sleep before each timed op of each target (2 reps x 2 targets = 4 here),
    none of it inside the timed op, and the rows say so."""

    def bench(idle_ms: int) -> tuple[float, list[dict]]:
        out = tmp_path / f"idle-{idle_ms}.json"
        start = time.monotonic()
        code = main(["bench", "--page-size", "16KiB", "--pages", "32", "--batch", "16", "--reps", "2",
                     "--ops", "get", "--idle-ms", str(idle_ms), "--quiet", "--json", str(out)])
        assert code == 0
        return time.monotonic() - start, json.loads(out.read_text())["results"]

    bench(0)  # the process's first bench pays one-time costs (imports, engines): not compared
    back_to_back, plain = bench(0)
    idle, rows = bench(400)
    assert idle - back_to_back >= 3 * 0.4  # four sleeps of 0.4 s, with a margin for noise
    assert all("idle_ms" not in r for r in plain)
    assert {r["backend"] for r in rows} == {"file", "raw-posix"}
    assert all(r["idle_ms"] == 400 for r in rows)
    assert all(r["p99_ms"] < 400 for r in rows)  # the sleep is off the clock


def test_bench_rejects_a_negative_idle() -> None:
    bad = subprocess.run([sys.executable, "-m", "hicache_l3.cli", "bench", "--idle-ms", "-5"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--idle-ms must lie in [0, 60000], got -5" in bad.stderr
