"""Defects a real SGLang server and SGLang's own backend tests found, the parts
that need no SGLang import: SGLang's ``file_storage_path`` key, `hicache-l3 check` leaving
its namespace behind, the plugin's Mooncake segment split and 3FS settings, and Mooncake's
-600 on a read. The parts that need SGLang's classes run in sglang_roundtrip.py and
sglang_plugin_check.py (test_sglang.py, test_sglang_plugin.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.registry import open_connector
from hicache_l3.engines import MooncakeEngine
from hicache_l3.sglang.cli import check_config
from hicache_l3.sglang.config import AdapterConfig, extra_config_for
from hicache_l3.sglang.takeover import takeover_extra_config

pytestmark = pytest.mark.sglang


# ---- 1. --file-storage-path with the dynamic backend --------------------------------------------
def test_file_storage_path_is_the_file_root_when_none_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HICACHE_L3_FILE_ROOT", raising=False)
    extra = {**extra_config_for("file", {}), "file_storage_path": "/srv/hicache"}
    cfg = AdapterConfig.from_extra_config(extra)
    assert cfg.settings["root"] == "/srv/hicache"
    cfg.validate_settings()


def test_file_storage_path_is_ignored_when_a_root_is_set(monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="hicache_l3.sglang.config")
    extra = {**extra_config_for("file", {"root": "/mine"}), "file_storage_path": "/srv/hicache"}
    assert AdapterConfig.from_extra_config(extra).settings["root"] == "/mine"
    assert "file_storage_path" in caplog.text
    monkeypatch.setenv("HICACHE_L3_FILE_ROOT", "/from-env")
    assert "root" not in AdapterConfig.from_extra_config(
        {**extra_config_for("file", {}), "file_storage_path": "/srv/hicache"}).settings
    # every connector accepts the key SGLang adds to every backend's extra config
    for name in ("mooncake", "nixl", "hf3fs"):
        cfg = AdapterConfig.from_extra_config({**extra_config_for(name, {}), "file_storage_path": "/x"})
        assert "root" not in cfg.settings
    with pytest.raises(ConfigError, match="file_storage_pat"):
        AdapterConfig.from_extra_config({**extra_config_for("file", {}), "file_storage_pat": "/x"})


# ---- 2. `hicache-l3 check` removes its own namespace ---------------------------------------------
@pytest.mark.parametrize("connector", ["file", "nixl", "hf3fs"])
def test_check_leaves_nothing_in_the_root(tmp_path: Path, connector: str) -> None:
    root = tmp_path / "root"
    settings = {"root": str(root)} if connector != "nixl" else {"mode": "file", "root": str(root)}
    keep = root / "ns-production" / "keep.txt"
    keep.parent.mkdir(parents=True)
    keep.write_text("not the check's")
    path = tmp_path / "hicache.json"
    path.write_text(json.dumps(extra_config_for(connector, settings)))
    assert check_config(path, pages=4).startswith("ok:")
    assert sorted(p.name for p in root.iterdir()) == ["ns-production"]
    assert keep.read_text() == "not the check's"


# ---- 4. the plugin splits Mooncake's segment across TP x PP as SGLang does ------------------------
def test_plugin_splits_mooncake_segment_across_ranks(tmp_path: Path) -> None:
    env = {"MOONCAKE_GLOBAL_SEGMENT_SIZE": "4gb"}
    assert takeover_extra_config("mooncake", {}, env, ranks=4)["mooncake"]["global_segment_size"] == 1 << 30
    assert takeover_extra_config("mooncake", {}, env, ranks=1)["mooncake"]["global_segment_size"] == 4 << 30
    # SGLang's extra-config key beats its environment, and is split too
    got = takeover_extra_config("mooncake", {"global_segment_size": "2gb"}, env, ranks=2)
    assert got["mooncake"]["global_segment_size"] == 1 << 30
    # SGLang's JSON file
    js = tmp_path / "mc.json"
    js.write_text(json.dumps({"master_server_address": "127.0.0.1:1", "global_segment_size": 1 << 30}))
    got = takeover_extra_config("mooncake", {}, {"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(js)}, ranks=8)
    assert got["mooncake"]["global_segment_size"] == 128 << 20
    # nothing set: SGLang's 4 GB default, split
    assert takeover_extra_config("mooncake", {}, {}, ranks=2)["mooncake"]["global_segment_size"] == 2 << 30
    # our own settings are taken as they are (per rank)
    got = takeover_extra_config("mooncake", {"mooncake": {"global_segment_size": "1GiB"}}, env, ranks=4)
    assert got["mooncake"]["global_segment_size"] == "1GiB"
    got = takeover_extra_config("mooncake", {}, {**env, "HICACHE_L3_MOONCAKE_GLOBAL_SEGMENT_SIZE": "1GiB"},
                                ranks=4)
    assert "global_segment_size" not in got["mooncake"]


# ---- 5. the plugin maps SGLang's 3FS settings --------------------------------------------------------
def test_plugin_maps_sglang_hf3fs_config(tmp_path: Path) -> None:
    js = tmp_path / "hf3fs.json"
    prefix = tmp_path / "3fs" / "hicache"
    js.write_text(json.dumps({"file_path_prefix": str(prefix), "file_size": 1 << 30, "numjobs": 4,
                              "entries": 8, "metadata_server_url": "http://127.0.0.1:18000"}))
    got = takeover_extra_config("hf3fs", {"use_mock_hf3fs_client": True},
                                {"SGLANG_HICACHE_HF3FS_CONFIG_PATH": str(js)})
    assert got["hf3fs"] == {"root": str(prefix), "capacity_bytes": 1 << 30, "io_threads": 4,
                            "usrbio_entries": 8}
    cfg = AdapterConfig.from_extra_config(got)
    cfg.validate_settings()  # every mapped value is a valid hf3fs setting
    # the table still wins; without SGLang's file, no root (never a shared default path)
    env = {"SGLANG_HICACHE_HF3FS_CONFIG_PATH": str(js)}
    got = takeover_extra_config("hf3fs", {"hf3fs": {"root": "/mine"}}, env)
    assert got["hf3fs"]["root"] == "/mine" and got["hf3fs"]["io_threads"] == 4
    assert "root" not in takeover_extra_config("hf3fs", {}, {})["hf3fs"]  # no shared default path
    with pytest.raises(ConfigError, match="root"):
        AdapterConfig.from_extra_config(takeover_extra_config("hf3fs", {}, {})).validate_settings()
    js.write_text(json.dumps({"file_size": 1}))
    with pytest.raises(ConfigError, match="file_path_prefix"):
        takeover_extra_config("hf3fs", {}, {"SGLANG_HICACHE_HF3FS_CONFIG_PATH": str(js)})
    with pytest.raises(ConfigError, match="SGLANG_HICACHE_HF3FS_CONFIG_PATH"):
        takeover_extra_config("hf3fs", {}, {"SGLANG_HICACHE_HF3FS_CONFIG_PATH": str(tmp_path / "nope.json")})


# ---- 6. Mooncake's -600 on a read is a size mismatch ---------------------------------------------------
def test_mooncake_object_larger_than_the_buffer_is_a_size_mismatch() -> None:
    ns = Namespace(model="m", kv_dtype="uint8", layout="page_first", page_size=1, tag="mc600")
    with MooncakeEngine(holder=True, segment_size="128 MB") as engine:
        settings = {**engine.settings, "global_segment_size": 0, "checksum": "none"}
        big, small = open_connector("mooncake", ns, settings), open_connector("mooncake", ns, settings)
        buf = HostBuffer(1 << 20, pin=False)
        try:
            big.register(buf)
            small.register(buf)
            assert big.batch_set(["k"], [((buf.address, 8192),)]) == [True]
            assert small.batch_get(["k"], [((buf.address + 65536, 4096),)]) == [False]
            ops = small.stats()["ops"]
            assert ops["get"]["failed"] == {"size_mismatch": 1}
            assert ops["counters"].get("mooncake_-600") == 1
        finally:
            big.close()
            small.close()
