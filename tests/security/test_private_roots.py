"""Storage roots are private by default: created 0700 whatever the umask, an
existing root of another uid, a symlinked root or one open to others refused with an error
naming the path, the owner, the mode and the fix; our own 0755 root repaired to 0700."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from security_helpers import NOBODY, ChildError, run_as

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.safe_fs import default_root, private_root


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o002])
def test_root_and_missing_parents_created_0700_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    old = os.umask(umask)
    try:
        root = private_root(tmp_path / "a" / "b" / "root")
    finally:
        os.umask(old)
    assert root == tmp_path / "a" / "b" / "root"
    for path in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert mode(path) == 0o700, oct(mode(path))


def test_own_root_readable_by_others_is_repaired(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o755)
    private_root(root)
    assert mode(root) == 0o700


def test_own_root_writable_by_others_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(ConfigError) as err:
        private_root(root)
    msg = str(err.value)
    assert str(root) in msg and "0777" in msg and "chmod 700" in msg
    assert mode(root) == 0o777  # left for the user to inspect


def test_symlinked_root_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    link = tmp_path / "root"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        private_root(link)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nothing")
    with pytest.raises(ConfigError, match="symlink"):
        private_root(dangling)
    assert not (tmp_path / "nothing").exists()


def test_file_as_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a directory"):
        private_root(tmp_path / "f")


def test_precreated_0777_root_of_another_uid_is_refused(as_root: None, open_base: Path) -> None:
    """The attack: another user creates the root first, 0777."""
    planted = open_base / "hicache"
    run_as(NOBODY, lambda: os.mkdir(planted, 0o777) or os.chmod(planted, 0o777))
    with pytest.raises(ConfigError) as err:
        private_root(planted)
    msg = str(err.value)
    assert str(planted) in msg and f"uid {NOBODY}" in msg and "0777" in msg
    assert "another user" in msg and "Fix" in msg


def test_root_under_a_directory_of_another_uid_is_refused(as_root: None, open_base: Path) -> None:
    parent = open_base / "theirs"
    run_as(NOBODY, lambda: os.mkdir(parent, 0o755))
    os.chmod(parent, 0o777)  # so that we could create in it: still theirs to swap
    with pytest.raises(ConfigError, match="belongs to another user"):
        private_root(parent / "root")
    assert not (parent / "root").exists()


def test_unprivileged_user_gets_0700_root_and_refuses_roots_of_root(as_root: None, open_base: Path) -> None:
    """The same checks hold for an ordinary uid (here 65534 in a forked child)."""
    home = open_base / "home"
    home.mkdir()
    os.chown(home, NOBODY, NOBODY)
    created = run_as(NOBODY, lambda: mode(private_root(home / "cache" / "root")))
    assert created == 0o700
    assert os.lstat(home / "cache" / "root").st_uid == NOBODY
    foreign = open_base / "roots"
    foreign.mkdir()
    os.chmod(foreign, 0o777)  # created by root, open to all: refused for uid 65534
    with pytest.raises(ChildError) as err:
        run_as(NOBODY, lambda: str(private_root(foreign)))
    assert "ConfigError" in err.value.message and "root (uid 0)" in err.value.message


def test_default_root_is_per_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root("nixl") == tmp_path / "xdg" / "hicache-l3" / "nixl"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_root() == tmp_path / ".cache" / "hicache-l3"
    monkeypatch.setenv("HOME", "/nonexistent")
    assert default_root() == Path(f"/var/tmp/hicache-l3-{os.geteuid()}")
