"""``hicache-l3 bench --beyond-memory`` runs end to end on a tiny store (its worker in a
memory cgroup where one can be made, every page read verified), reports every contender
with the break-even against recompute and a zstd store's stored ratio, and refuses bad
input by naming the option. Speed is never asserted here."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hicache_l3.bench import beyond, memcg, real_kv
from hicache_l3.bench.beyond import BODIES, BeyondOptions, _Pages, break_even_gb_s, page_bodies, stored_ratio
from hicache_l3.bench.runner import BenchError
from hicache_l3.cli import main
from hicache_l3.common.compression import PageCodec
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector


def test_tiny_store_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "beyond.json"
    code = main(["bench", "--beyond-memory", "--beyond-store", "8MiB", "--beyond-cache", "4MiB",
                 "--beyond-rounds", "2", "--beyond-batches", "4", "--batch", "32", "--quiet",
                 "--beyond-fio-seconds", "1",
                 "--kv-bytes-per-token", "1000", "--prefill-tokens-per-s", "2e6",
                 "--workdir", str(tmp_path / "w"), "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "break-even against recompute: 2.00 GB/s" in text
    (report,) = json.loads(out.read_text())["beyond_memory"]
    meta = report["meta"]
    assert meta["pages"] == 128 and meta["page_bytes"] == 64 << 10 and meta["break_even_gb_s"] == 2.0
    if meta["cgroup"]:
        assert "page cache limited to" in text
    else:
        assert meta["cgroup_why_not"] and "no memory cgroup" in text
    names = {(r["contender"], r["op"]) for r in report["results"]}
    for contender in ("file", "file+o_direct", "hf3fs", "hf3fs+o_direct", "raw-direct-16t",
                      "raw-buffered-16t"):
        assert {(contender, "get"), (contender, "set")} <= names
    if meta["fio"]:
        assert {("fio-io_uring-qd32", "get"), ("fio-io_uring-batch128", "get"),
                ("fio-io_uring-qd32", "set")} <= names
    for row in report["results"]:
        assert row["gb_s"] > 0
        if not row["contender"].startswith("fio"):
            assert row["batches"] == 4 and row["p99_ms"] >= row["p50_ms"] > 0
    assert list((tmp_path / "w").iterdir()) == []  # stores removed
    assert not list(memcg.CGROUP_ROOT.glob(f"*/hicache-l3-bench-{os.getpid()}"))  # cgroup removed


def test_pages_check_catches_other_bytes() -> None:
    pages = _Pages(8192)
    buf = HostBuffer(3 * 8192, pin=False)
    view = buf.view()
    pages.stamp(view, 5, 3)
    pages.check(view, [5, 6, 7], "ok")
    with pytest.raises(BenchError, match="page 7"):
        pages.check(view, [5, 7, 6], "swapped")
    view[8192 + 100] ^= 1
    with pytest.raises(BenchError, match="page 6"):
        pages.check(view, [5, 6, 7], "flipped")


@pytest.mark.parametrize(("args", "needle"), [
    (["--page-size", "6000"], "--page-size"),
    (["--beyond-backends", "mooncake"], "--beyond-backends"),
    (["--beyond-modes", "mmap"], "--beyond-modes"),
    (["--set", "file.root=/x"], "file.root"),
    (["--set", "file.compression=zstd"], "file.compression"),
    (["--beyond-store", "1PiB"], "--beyond-store"),
])
def test_bad_options_name_the_option(args: list[str], needle: str, tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--beyond-memory", "--quiet", "--workdir", str(tmp_path), *args]) == 2
    assert needle in capsys.readouterr().err


def test_break_even_is_bytes_per_token_times_prefill_rate() -> None:
    assert break_even_gb_s(131072, 30000) == pytest.approx(3.93216)
    opts = BeyondOptions()
    assert opts.kv_bytes_per_token == 32 * 8 * 128 * 2 * 2  # Llama-3.1-8B, bf16
    with pytest.raises(ConfigError, match="prefill"):
        BeyondOptions(prefill_tokens_per_s=0).validate()


def test_memcg_create_says_why_not(tmp_path: Path) -> None:
    path, why = memcg.create(1 << 30, "x", root=tmp_path)  # no controller there
    assert path is None and "no memory cgroup controller" in why


def test_o_direct_moves_cold_read_threads_pages_at_once(tmp_path: Path) -> None:
    """O_DIRECT reads and writes each wait on the device: without io_uring the transport
    keeps as many in flight as the cold pool would (the beyond-memory bench measures what
    that gives)."""
    ns = Namespace(model="m", kv_dtype="uint8", layout="page_first", page_size=8192, tag="t")
    conn = open_connector("file", ns, {"root": str(tmp_path), "o_direct": "true", "io_threads": "2",
                                       "write_threads": "2", "cold_read_threads": "8", "io_uring_depth": "0"})
    try:
        transport = conn.transport  # type: ignore[attr-defined]
        assert transport.read_pool.threads == 8 and transport._write_pool.threads == 8
        buf = HostBuffer(4 * 8192, pin=False)
        buf.view()[:] = os.urandom(4 * 8192)
        conn.register(buf)
        pages = contiguous_pages(buf.address, 8192, range(4))
        assert conn.batch_set([f"k{i}" for i in range(4)], pages) == [True] * 4
        want = buf.view().tobytes()
        buf.view()[:] = bytes(4 * 8192)
        assert conn.batch_get([f"k{i}" for i in range(4)], pages) == [True] * 4
        assert buf.view().tobytes() == want
        assert conn.stats()["ops"]["counters"].get("direct_fallback", 0) == 0
    finally:
        conn.close()


def test_zstd_contender_reports_stored_ratio_and_effective_get(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """bf16-like pages through compression=zstd stores come back verified (a wrong byte
    fails the run), with the ratio from the connector's frame counters."""
    opts = BeyondOptions(store_bytes=8 << 20, cache_bytes=4 << 20, batch=32, rounds=2, batches=4,
                         backends=("file", "hf3fs"), modes=("buffered", "zstd"), kv="synthetic",
                         fio=False, workdir=str(tmp_path / "w"))
    code, report = beyond.run_beyond(opts, quiet=True)
    assert code == 0 and report is not None
    text = capsys.readouterr().out
    names = {(r["contender"], r["op"]) for r in report["results"]}
    assert {("file+zstd", "get"), ("hf3fs+zstd", "set"), ("file", "get")} <= names
    by_name = {z["contender"]: z for z in report["compressed"]}
    assert set(by_name) == {"file+zstd", "hf3fs+zstd"}
    for name, z in by_name.items():
        assert z["pages_written"] == 128 + 4 * 32  # the fill, then 4 timed set batches
        assert 0 < z["frames_written"] <= z["pages_written"] and z["frames_read"] > 0
        assert 1.1 < z["stored_ratio"] < 2.5
        assert z["get_gb_s"] > 0 and z["over_buffered_get"] > 0
        assert f"{name}: stored ratio {z['stored_ratio']:.2f}" in text
    assert "zstd / buffered get (file, same rounds)" in text


def test_stored_ratio_counts_raw_pages_at_page_bytes() -> None:
    assert stored_ratio(4, 4, 4 * 512, 1024) == 2.0
    assert stored_ratio(4, 2, 2 * 512, 1024) == pytest.approx(4 / 3)
    assert stored_ratio(4, 0, 0, 1024) == 1.0


def test_page_bodies_compress_as_their_kind_says(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = PageCodec("zstd", "bfloat16")
    synthetic = page_bodies(8192, "synthetic")
    random_ = page_bodies(8192, "random")
    assert len(synthetic) == len(random_) == BODIES and {len(b) for b in synthetic + random_} == {8184}
    assert len(set(synthetic)) == BODIES
    frame = codec.encode([memoryview(synthetic[0])])
    assert frame is not None and len(frame) < 0.8 * 8184
    assert codec.encode([memoryview(random_[0])]) is None
    kv = np.arange(3000, dtype=np.uint16).reshape(100, 30)  # a stream shorter than the bodies
    monkeypatch.setattr(real_kv, "token_kv", lambda: kv)
    stream = np.resize(kv.reshape(-1).view(np.uint8), BODIES * 8192)
    real = page_bodies(8192, "real")
    assert real[0] == stream[8:8192].tobytes() and real[5] == stream[5 * 8192 + 8:6 * 8192].tobytes()


def test_cli_passes_kv_and_modes(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[BeyondOptions] = []

    def run(opts: BeyondOptions, quiet: bool) -> tuple[int, dict[str, Any]]:
        seen.append(opts)
        return 0, {}

    monkeypatch.setattr(beyond, "run_beyond", run)
    assert main(["bench", "--beyond-memory", "--kv", "real", "--beyond-modes", "buffered,zstd",
                 "--workdir", str(tmp_path)]) == 0
    assert seen[0].kv == "real" and seen[0].modes == ("buffered", "zstd")
    assert BeyondOptions().modes == ("buffered", "o_direct")
    with pytest.raises(ConfigError, match="--kv"):
        BeyondOptions(kv="zeros").validate()


def test_zstd_cgroup_holds_a_batch_of_frames_beyond_the_page_cache() -> None:
    plain = BeyondOptions(batch=4, page_bytes=8192)
    zstd = BeyondOptions(batch=4, page_bytes=8192, modes=("buffered", "zstd"))
    assert plain.cgroup_bytes == plain.cache_bytes + beyond.CGROUP_SLACK
    assert zstd.cgroup_bytes == plain.cgroup_bytes + 4 * 8192


def test_limit_io_names_the_disk_and_the_rate(tmp_path: Path) -> None:
    here = Path(__file__).parent  # a directory on a disk
    disk = memcg.disk_of(here)
    assert Path(f"/sys/dev/block/{disk}/dev").read_text().strip() == disk
    assert not Path(f"/sys/dev/block/{disk}/partition").exists()  # the whole disk, not a partition
    v1 = tmp_path / "v1"
    (v1 / "blkio").mkdir(parents=True)
    (v1 / "blkio" / "blkio.throttle.read_bps_device").write_text("")
    path, why = memcg.limit_io(123_000_000, here, "b", None, root=v1)
    assert path == v1 / "blkio" / "b" and why == ""
    for op in ("read", "write"):
        assert (path / f"blkio.throttle.{op}_bps_device").read_text() == f"{disk} 123000000"
    v2 = tmp_path / "v2"
    (v2 / "m").mkdir(parents=True)
    (v2 / "cgroup.controllers").write_text("memory io")
    path, why = memcg.limit_io(5, here, "b", v2 / "m", root=v2)
    assert path == v2 / "m" and (v2 / "m" / "io.max").read_text() == f"{disk} rbps=5 wbps=5"
    path, why = memcg.limit_io(5, here, "b", None, root=v2)
    assert path is None and "memory cgroup" in why


def test_device_rate_is_applied_and_removed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--beyond-memory", "--beyond-store", "8MiB", "--beyond-cache", "4MiB",
            "--beyond-rounds", "1", "--beyond-batches", "2", "--batch", "32", "--quiet",
            "--beyond-fio-seconds", "1", "--beyond-backends", "file", "--beyond-device-rate", "1GB",
            "--workdir", str(tmp_path / "w")]
    if os.geteuid() != 0:  # no cgroup can be made: the option is refused, naming itself
        assert main(args) == 2
        assert "--beyond-device-rate" in capsys.readouterr().err
        return
    assert main(args) == 0
    assert "the disk limited to 1,000 MB/s each way by an I/O cgroup" in capsys.readouterr().out
    assert not list(memcg.CGROUP_ROOT.glob(f"*/hicache-l3-bench-io-{os.getpid()}"))  # removed
    with pytest.raises(ConfigError, match="--beyond-device-rate"):
        BeyondOptions(device_rate=-1).validate()
