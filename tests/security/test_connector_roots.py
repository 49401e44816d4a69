"""The connectors that keep pages under a local root (the slab path and the fsspec
``file://`` path) open it private: another uid reads no page byte, whoever wrote it; a
root planted by another uid or a symlinked root is refused at open."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from security_helpers import NOBODY, STRANGER, run_as

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.suite import Pages, page_pattern

NS = Namespace(model="security-tests", kv_dtype="bfloat16", layout="page_first", page_size=16)
PAGE = 16 << 10
KEYS = [f"secret-{i}" for i in range(4)]


def store_pages(settings: dict[str, Any]) -> bool:
    """Open the file connector, store KEYS, read them back, close."""
    with open_connector("file", NS, settings) as conn:
        pages = Pages(conn, PAGE, len(KEYS))
        pages.fill(KEYS)
        ok = all(conn.batch_set(KEYS, pages.pages))
        pages.wipe()
        return ok and all(conn.batch_get(KEYS, pages.pages))


def leaked_bytes(base: str) -> list[str]:
    """Every path under ``base`` whose bytes this uid could read and that holds a page's
    bytes; plus the namespace paths it could list. Empty when nothing leaked."""
    marks = [page_pattern(k, PAGE)[:64] for k in KEYS]
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        for name in filenames:
            try:
                data = Path(dirpath, name).read_bytes()
            except OSError:
                continue
            if any(m in data for m in marks):
                found.append(os.path.join(dirpath, name))
        found.extend(os.path.join(dirpath, d) for d in dirnames if d.startswith("ns-"))
    return found


@pytest.mark.parametrize("root_url", ["{base}/store", "file://{base}/store"], ids=["slab", "fsspec"])
def test_another_uid_reads_no_page_byte(as_root: None, open_base: Path, root_url: str) -> None:
    settings = {"root": root_url.format(base=open_base), "capacity_bytes": "64MiB"}
    old = os.umask(0o022)
    try:
        assert store_pages(settings)
    finally:
        os.umask(old)
    assert leaked_bytes(str(open_base)), "the check must see the pages as their writer"
    assert run_as(NOBODY, lambda: leaked_bytes(str(open_base))) == []


def test_pages_of_an_unprivileged_writer_are_hidden_from_another(as_root: None, open_base: Path) -> None:
    settings = {"root": str(open_base / "store"), "capacity_bytes": "64MiB"}
    assert run_as(NOBODY, lambda: store_pages(settings), umask=0o000)
    assert run_as(NOBODY, lambda: len(leaked_bytes(str(open_base)))) > 0
    assert run_as(STRANGER, lambda: leaked_bytes(str(open_base))) == []


@pytest.mark.parametrize("root_url", ["{base}/hicache", "file://{base}/hicache"], ids=["slab", "fsspec"])
def test_root_planted_by_another_uid_is_refused(as_root: None, open_base: Path, root_url: str) -> None:
    planted = open_base / "hicache"
    run_as(NOBODY, lambda: os.mkdir(planted, 0o777) or os.chmod(planted, 0o777))
    with pytest.raises(ConfigError) as err:
        open_connector("file", NS, {"root": root_url.format(base=open_base)})
    assert str(planted) in str(err.value) and f"uid {NOBODY}" in str(err.value)
    assert os.listdir(planted) == []


@pytest.mark.parametrize("scheme", ["", "file://"], ids=["slab", "fsspec"])
def test_symlinked_root_is_refused(tmp_path: Path, scheme: str) -> None:
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    (tmp_path / "root").symlink_to(target)
    with pytest.raises(ConfigError, match="symlink"):
        open_connector("file", NS, {"root": f"{scheme}{tmp_path}/root"})
    assert os.listdir(target) == []


def test_sglang_named_root_planted_by_another_uid_is_refused(as_root: None, open_base: Path) -> None:
    """SGLang's own setting (here its env variable, as for /tmp/hicache) is honoured, with
    the checks: a planted directory there makes the open fail instead of serving pages."""
    from hicache_l3.sglang.takeover import takeover_extra_config

    planted = open_base / "hicache"
    run_as(NOBODY, lambda: os.mkdir(planted, 0o777) or os.chmod(planted, 0o777))
    cfg = takeover_extra_config("file", {}, env={"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(planted)})
    assert cfg["file"]["root"] == str(planted)
    with pytest.raises(ConfigError, match="belongs to another user"):
        open_connector(cfg["connector"], NS, cfg["file"])
