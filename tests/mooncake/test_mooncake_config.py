"""Mooncake connector settings: defaults, validation, and SGLang's in-tree settings
(``MOONCAKE_*`` variables and the ``SGLANG_HICACHE_MOONCAKE_CONFIG_PATH`` JSON file)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache_l3.common.errors import ConfigError
from hicache_l3.connectors.mooncake import MooncakeConfig


def load(settings: dict[str, object] | None = None, env: dict[str, str] | None = None) -> MooncakeConfig:
    return MooncakeConfig.load("mooncake", settings or {}, environ=env or {})


def test_defaults_are_loopback_tcp_and_documented() -> None:
    cfg = load({"master_address": "10.0.0.5:50051"})
    assert (cfg.protocol, cfg.local_hostname, cfg.checksum) == ("tcp", "127.0.0.1", "none")
    assert cfg.global_segment_size == 4 << 30 and cfg.local_buffer_size == 16 << 20
    assert cfg.metadata_url() == "http://10.0.0.5:8080/metadata"
    helps = MooncakeConfig.field_help()
    assert all(text for _, text in helps.values()), "every setting has a help text"


def test_missing_master_names_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"master_address.*MOONCAKE_MASTER"):
        load()


@pytest.mark.parametrize("bad, match", [
    ({"replica_num": 0}, "replica_num"),
    ({"global_segment_size": "1MiB"}, "16 MiB"),
    ({"preferred_segment": "local", "global_segment_size": 0}, "preferred_segment"),
    ({"protocol": ""}, "protocol"),
    ({"checksum": "md5"}, "checksum"),
    ({"max_batch": 0}, "max_batch"),
    ({"no_such_setting": 1}, "no_such_setting"),
])
def test_bad_values_name_the_setting(bad: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load({"master_address": "127.0.0.1:50051", **bad})


def test_sglang_environment_is_accepted() -> None:
    env = {
        "MOONCAKE_MASTER": "10.1.1.1:50051",
        "MOONCAKE_TE_META_DATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "8gb",  # SGLang reads gb as GiB
        "MOONCAKE_PROTOCOL": "rdma",
        "MOONCAKE_DEVICE": "mlx5_0,mlx5_1",
        "MOONCAKE_LOCAL_HOSTNAME": "10.1.1.2",
    }
    cfg = load(env=env)
    assert cfg.master_address == "10.1.1.1:50051"
    assert cfg.metadata_url() == "P2PHANDSHAKE"
    assert cfg.global_segment_size == 8 << 30
    assert (cfg.protocol, cfg.device_names, cfg.local_hostname) == ("rdma", "mlx5_0,mlx5_1", "10.1.1.2")


def test_sglang_json_file_over_env_and_ours_over_both(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "master_server_address": "10.2.2.2:50051", "metadata_server": "etcd://10.2.2.2:2379",
        "global_segment_size": 1 << 30, "protocol": "tcp", "device_name": "",
        "local_hostname": "10.2.2.3", "master_metrics_port": 9003, "check_server": False,
    }))
    env = {"MOONCAKE_MASTER": "10.1.1.1:50051", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path),
           "HICACHE_L3_MOONCAKE_REPLICA_NUM": "2"}
    cfg = load(env=env)
    assert cfg.master_address == "10.2.2.2:50051"  # the file wins over MOONCAKE_*
    assert cfg.metadata_url() == "etcd://10.2.2.2:2379"
    assert cfg.global_segment_size == 1 << 30 and cfg.replica_num == 2
    cfg = load({"master_address": "127.0.0.1:1"}, env=env)  # explicit settings win
    assert cfg.master_address == "127.0.0.1:1"


@pytest.mark.parametrize("content, match", [
    ({"master_server_address": "h:1", "surprise": 1}, "surprise"),
    ({"client_server_address": "h:2"}, "client_server_address"),
    ("not json", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"),
])
def test_sglang_json_file_errors_name_the_problem(tmp_path: Path, content: object, match: str) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigError, match=match):
        load(env={"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path)})


def test_missing_package_gives_an_install_hint() -> None:
    """Without the mooncake package, opening the connector says which extra to install."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['mooncake'] = None; sys.modules['mooncake.store'] = None\n"
        "from hicache_l3.common.registry import open_connector\n"
        "from hicache_l3.common.errors import EngineUnavailableError\n"
        "try:\n"
        "    open_connector('mooncake', dict(model='m', kv_dtype='x', layout='l', page_size=1),\n"
        "                   {'master_address': '127.0.0.1:1'})\n"
        "except EngineUnavailableError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "pip install 'hicache-l3[mooncake]'" in out.stdout, out.stdout + out.stderr
