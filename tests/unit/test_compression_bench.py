"""The compression bench (hicache_l3.bench.compression) and its real-KV pages
(hicache_l3.bench.real_kv), without the model: a KV cache file stands in for its run."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import fsspec.config
import numpy as np
import pytest

from hicache_l3 import engines
from hicache_l3.bench import real_kv
from hicache_l3.bench.compression import backend_settings, format_rows, run_backend
from hicache_l3.bench.runner import BenchError
from hicache_l3.common.errors import ConfigError
from hicache_l3.common.memory import HostBuffer


@pytest.fixture
def cached_kv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """A bf16-like KV of 256 tokens of 64 elements, where token_kv looks for its cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    x = np.random.default_rng(5).normal(0, 0.05, (256, 64)).astype(np.float32)
    kv = (x.view(np.uint32) >> 16).astype(np.uint16)
    path = real_kv.cache_dir() / "smollm2-135m-kv-256.npy"
    path.parent.mkdir(parents=True)
    np.save(path, kv)
    return kv


def test_fill_real_cuts_whole_tokens_and_cycles(cached_kv: np.ndarray) -> None:
    per_token = 128
    page = 16 * per_token
    buf = HostBuffer(20 * page)
    assert real_kv.fill_real(buf.view(), page, 20, tokens=256) == 16
    got = np.frombuffer(buf.view(), np.uint8)
    flat = cached_kv.reshape(-1).view(np.uint8)
    assert np.array_equal(got[: flat.size], flat)  # 16 pages of 16 tokens: every token once
    assert np.array_equal(got[flat.size:], flat[: got.size - flat.size])  # then from the start


def test_fill_real_refuses_a_page_of_partial_tokens(cached_kv: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="page-size"):
        real_kv.fill_real(HostBuffer(1000).view(), 1000, 1, tokens=256)


def test_bench_row_on_the_memory_connector(cached_kv: np.ndarray, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(real_kv, "TOKENS", 256)
    monkeypatch.setattr(real_kv.fill_real, "__defaults__", (256,))
    row = run_backend("memory", 64 * 128, 8, 4, 2, "real")
    assert row["ratio"] > 1.2  # bf16-like pages shrink
    assert row["get_zstd_gbps"] > 0 and row["get_none_gbps"] > 0
    assert "memory" in format_rows([row])
    random_row = run_backend("memory", 8192, 8, 4, 2, "random")
    assert random_row["ratio"] == 1.0  # random pages are stored raw


def test_s3_fsspec_without_s3fs_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", None)  # import s3fs raises ImportError
    started = []
    monkeypatch.setattr(engines, "S3Engine", lambda: started.append(1))
    with pytest.raises(BenchError, match="pip install s3fs"), backend_settings("s3-fsspec", 1 << 20):
        pass
    assert not started  # refused before an S3 server is started


class _FakeS3:
    """Stands in for S3Engine: its endpoint, bucket and keys, no server."""

    endpoint = "http://127.0.0.1:5999"
    bucket = "bench-bucket"
    access_key = "k-id"
    secret_key = "k-secret"

    def __enter__(self) -> _FakeS3:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def test_s3_fsspec_points_fsspec_at_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "s3fs", types.ModuleType("s3fs"))
    monkeypatch.setattr(engines, "S3Engine", _FakeS3)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": "http://elsewhere"})
    with backend_settings("s3-fsspec", 1 << 20) as (name, settings):
        assert name == "file"
        assert settings["root"].startswith("s3://bench-bucket/bench-")
        assert fsspec.config.conf["s3"] == {
            "endpoint_url": "http://127.0.0.1:5999", "key": "k-id", "secret": "k-secret",
            "client_kwargs": {"region_name": "us-east-1"},
        }
    assert fsspec.config.conf["s3"] == {"endpoint_url": "http://elsewhere"}  # put back
