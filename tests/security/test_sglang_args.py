"""``hicache-l3 sglang-args``: a per-user default root, and the config file (it may hold an
S3 secret key) written 0600 also over an existing file, atomically, never through a
symlink."""

from __future__ import annotations

import argparse
import json
import os
import stat
from pathlib import Path

import pytest

from hicache_l3.common.safe_fs import default_root
from hicache_l3.sglang import cli, config


def args(config: Path, *sets: str, backend: str = "file") -> argparse.Namespace:
    return argparse.Namespace(backend=backend, config=str(config), sets=list(sets), tag="",
                              model_path="MODEL")


def test_default_roots_are_per_user() -> None:
    assert config.LOCAL_DEFAULTS["file"]["root"] == str(default_root("file"))
    assert config.LOCAL_DEFAULTS["nixl"]["root"] == str(default_root("nixl"))
    for table in config.LOCAL_DEFAULTS.values():
        assert not str(table.get("root", "")).startswith(("/tmp/", "/var/tmp/hicache-l3/"))


def test_secret_config_over_an_existing_0644_file_becomes_0600(tmp_path: Path) -> None:
    path = tmp_path / "hicache-l3.json"
    path.write_text("{}")
    os.chmod(path, 0o644)
    sets = ["mode=obj", "bucket=b", "endpoint=http://127.0.0.1:9", "access_key=k", "secret_key=TOPSECRET"]
    assert cli.run(args(path, *sets, backend="nixl")) == 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert json.loads(path.read_text())["nixl"]["secret_key"] == "TOPSECRET"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hicache-l3.json"]


def test_config_path_that_is_a_symlink_is_refused(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    victim = tmp_path / "victim.toml"
    victim.write_text("precious")
    link = tmp_path / "hicache-l3.toml"
    link.symlink_to(victim)
    assert cli.run(args(link, "root=" + str(tmp_path / "store"))) == 2
    assert "symlink" in capsys.readouterr().err
    assert victim.read_text() == "precious"
