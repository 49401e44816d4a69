"""Small files that may hold secrets (config files) are written atomically, 0600 also when
the file already exists with a looser mode, and never through a symlink."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.safe_fs import write_private_file


def test_new_file_0600_and_missing_parents_0700(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_private_file(tmp_path / "conf" / "hicache-l3.toml", "secret_key = 's'\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "conf").st_mode) == 0o700
    path = tmp_path / "conf" / "hicache-l3.toml"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_text() == "secret_key = 's'\n"


def test_existing_0644_file_becomes_0600_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    write_private_file(path, b"new")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert path.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


def test_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious")
    os.chmod(victim, 0o644)
    link = tmp_path / "c.toml"
    link.symlink_to(victim)
    with pytest.raises(ConfigError, match="symlink"):
        write_private_file(link, "secret")
    assert victim.read_text() == "precious"
    assert link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml", "victim"]


def test_directory_in_place_of_the_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c.toml").mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        write_private_file(tmp_path / "c.toml", "x")
