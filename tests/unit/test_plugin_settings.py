"""The opt-in SGLang plugin's settings logic (no SGLang needed; the plugin inside real SGLang
is tested in tests/integration/test_sglang_plugin.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.safe_fs import default_root
from hicache_l3.sglang.takeover import ENV, takeover_extra_config, takeover_names


def test_names_are_opt_in_and_checked() -> None:
    assert takeover_names(None) == [] and takeover_names("") == [] and takeover_names(" , ") == []
    assert takeover_names("all") == ["file", "mooncake", "nixl", "hf3fs"]
    assert takeover_names("File, mooncake,file") == ["file", "mooncake"]
    with pytest.raises(ConfigError, match=f"{ENV}.*'lmcache'"):
        takeover_names("file,lmcache")


def test_file_root_follows_sglang_then_ours() -> None:
    cfg = takeover_extra_config("file", None, env={})
    # not SGLang's shared /tmp/hicache (another user may have created it): a per-user root
    assert cfg == {"connector": "file", "interface_v1": 1, "file": {"root": str(default_root("file"))}}
    assert takeover_extra_config("file", {"file_storage_path": "/tmp/hicache"}, env={})["file"] == {
        "root": "/tmp/hicache"}  # still honoured when named (and checked when opened)
    assert takeover_extra_config("file", {"file_storage_path": "/a"}, env={})["file"] == {"root": "/a"}
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": "/b"}
    assert takeover_extra_config("file", {"file_storage_path": "/a"}, env=env)["file"] == {"root": "/b"}
    # our variable beats SGLang's settings (the connector reads it); our table beats everything
    env["HICACHE_L3_FILE_ROOT"] = "/c"
    assert takeover_extra_config("file", {"file_storage_path": "/a"}, env=env)["file"] == {}
    cfg = takeover_extra_config("file", {"file": {"root": "/d", "io_threads": 4}, "extra_backend_tag": "t"},
                                env=env)
    assert cfg["file"] == {"root": "/d", "io_threads": 4} and cfg["extra_backend_tag"] == "t"


def test_mooncake_maps_sglang_keys_and_ignores_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    extra = {"master_server_address": "10.0.0.1:50051", "protocol": "rdma", "device_name": "mlx5_0",
             "check_server": True, "mooncake": {"replica_num": 2}}
    with caplog.at_level("INFO", logger="hicache_l3.sglang.takeover"):
        cfg = takeover_extra_config("mooncake", extra, env={"HICACHE_L3_MOONCAKE_PROTOCOL": "tcp"})
    assert cfg["mooncake"] == {"master_address": "10.0.0.1:50051", "device_names": "mlx5_0", "replica_num": 2,
                               "global_segment_size": 4 << 30}  # SGLang's default, one rank
    assert "check_server" in caplog.text


def test_nixl_takes_sglang_storage_dir() -> None:
    env = {"SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": "/n"}
    assert takeover_extra_config("nixl", {}, env=env)["nixl"] == {"mode": "file", "root": "/n"}
    assert takeover_extra_config("nixl", {}, env={})["nixl"] == {}
    with pytest.raises(ConfigError, match="'nixl' in the extra config must be a table"):
        takeover_extra_config("nixl", {"nixl": "obj"}, env={})


def test_install_without_opting_in_imports_nothing_heavy() -> None:
    """SGLang imports the plugin in every process: unless opted in, it must stay inert."""
    code = ("import sys; from hicache_l3.sglang.plugin import install; install(); "
            "print(sorted(m for m in ('torch', 'sglang') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
