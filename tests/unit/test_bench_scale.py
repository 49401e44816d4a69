"""``hicache-l3 bench --scale`` produces the documented JSON shape at tiny sizes (speed is
never asserted here), evicts one page per set at capacity, and refuses bad input clearly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_l3.bench.scale import (
    INDEX_ONLY_MEASURES,
    MEASURES,
    RAW_MEASURES,
    check_disk,
    disk_needed,
    parse_counts,
)
from hicache_l3.cli import main
from hicache_l3.common.errors import ConfigError


def test_scale_sweep_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    code = main(["bench", "--scale", "--scale-sizes", "1e3,3e3", "--quiet", "--json", str(out),
                 "--plot", str(png), "--workdir", str(tmp_path / "w")])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["mode"] == "scale" and doc["meta"]["page_bytes"] == 256
    rows = doc["results"]
    assert [r["pages"] for r in rows] == [1000, 3000]
    for row in rows:
        assert set(row) >= set(MEASURES) | {"pages", "page_bytes", "evictions", "open_s_all"}
        for measure in MEASURES:
            if measure == "index_shared_bytes_per_page":  # the checkpoint's image, mapped
                assert (row[measure] > 0) == (row["open_checkpoint_pages"] > 0), row
            elif measure != "index_rss_bytes_per_page":  # (private: can be ~0 over a base)
                assert row[measure] > 0, (measure, row)
        assert row["evictions"] == row["sample"] and len(row["open_s_all"]) == 3
        for raw in RAW_MEASURES.values():  # the raw preadv contender of each get pass
            assert row[raw] > 0, (raw, row)
        for name in ("exists", "get", "get_warm", "raw_get", "raw_get_warm", "set", "evict_set"):
            ms = row[f"{name}_batch_ms"]
            assert 0 < ms["p50"] <= ms["p99"] <= ms["max"], (name, ms)
        # exists is timed over whole passes of its sample for at least EXISTS_SECONDS
        assert row["exists_passes"] >= 1 and row["get_passes"] == 1
        assert row["settle_s"] >= 0  # the fill's index work let end before the measures
        # the open built every page: from the checkpoint (-1: none) or by replaying the log
        assert max(row["open_checkpoint_pages"], 0) + row["open_replayed_records"] >= row["pages"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(doc["meta"]["cpu"]) >= {"model", "cores"} and len(doc["meta"]["loadavg"]) == 3
    printed = capsys.readouterr().out
    assert "index_rss_bytes_per_page" in printed and "raw_get_warm_pages_per_s" in printed
    assert "cpu: " in printed and "load average: " in printed
    assert list((tmp_path / "w").iterdir()) == []  # the stores are removed after measuring


def test_scale_index_only_opens_from_the_checkpoint(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """--scale-index-only: a log-only store; the opens load the whole index from the
    checkpoint (no record replayed), the full-replay open is measured too; no get/set."""
    out = tmp_path / "scale.json"
    code = main(["bench", "--scale", "--scale-index-only", "--scale-sizes", "2e3", "--quiet",
                 "--json", str(out), "--workdir", str(tmp_path / "w")])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["index_only"] is True
    (row,) = doc["results"]
    assert row["open_checkpoint_pages"] == 2000 and row["open_replayed_records"] == 0
    for measure in INDEX_ONLY_MEASURES:
        if measure != "index_rss_bytes_per_page":
            assert row[measure] > 0, (measure, row)
    # the opens map the checkpoint's table image: at most ~60 B a page once per node
    assert 20 < row["index_shared_bytes_per_page"] < 200, row
    assert row["checkpoint_write_s"] > 0
    assert [row[m] for m in MEASURES if m not in INDEX_ONLY_MEASURES] == [None] * 4
    assert [row[m] for m in RAW_MEASURES.values()] == [None, None]
    assert " - " in capsys.readouterr().out  # unmeasured columns print as "-"


def test_scale_refuses_bad_sizes_and_settings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_counts("1e4, 100000") == [10_000, 100_000]
    for bad in ("", "ten", "1.5", "0", "-1e3"):
        with pytest.raises(ConfigError, match="--scale-sizes"):
            parse_counts(bad)
    assert main(["bench", "--scale", "--scale-sizes", "lots", "--quiet"]) == 2
    assert "'lots' is not a number" in capsys.readouterr().err
    assert main(["bench", "--scale", "--scale-sizes", "1e3", "--quiet",
                 "--set", "file.root=/tmp/x", "--workdir", str(tmp_path)]) == 1
    assert "use --workdir" in capsys.readouterr().err


def test_scale_refuses_when_the_disk_is_too_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    huge = 10**15  # pages: more disk than any test machine has
    with pytest.raises(ConfigError, match=r"need .* GiB free"):
        check_disk(tmp_path, [1000, huge], 4096)
    assert disk_needed(huge, 4096) > disk_needed(1000, 4096) > 1000 * 4096
    assert main(["bench", "--scale", "--scale-sizes", "1e15", "--quiet", "--workdir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "--scale-sizes" in err and "GiB free" in err
    assert list(tmp_path.iterdir()) == []  # refused before writing anything
