"""Config loading: dict, TOML, environment, sizes, strict errors naming the setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache_l3.common.config import parse_sets, parse_size
from hicache_l3.common.errors import ConfigError
from hicache_l3.connectors.file import FileConfig


@pytest.mark.parametrize(
    "text, value",
    [("65536", 65536), ("64KiB", 65536), ("64k", 64000), ("1 GB", 10**9), ("1GiB", 1 << 30),
     ("1.5MiB", 3 << 19), (4096, 4096)],
)
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "lots", "-1", "1XB", True, -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError):
        parse_size(bad, "capacity_bytes")


def test_from_dict_coerces_and_validates(tmp_path):
    cfg = FileConfig.from_dict({"root": str(tmp_path), "capacity_bytes": "1GiB", "io_threads": "3",
                                "o_direct": "true", "checksum": "none"})
    assert cfg.capacity_bytes == 1 << 30 and cfg.io_threads == 3 and cfg.o_direct == "true"
    assert cfg.checksum == "none"


def test_unknown_setting_is_named():
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) \['rooot'\].*known:"):
        FileConfig.from_dict({"rooot": "/tmp"})


def test_bad_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match="io_threads: expected int, got 'many'"):
        FileConfig.from_dict({"root": str(tmp_path), "io_threads": "many"})
    with pytest.raises(ConfigError, match="checksum"):
        FileConfig.from_dict({"root": str(tmp_path), "checksum": "md5"})


def test_missing_root_explains_itself():
    with pytest.raises(ConfigError, match="set root to a directory"):
        FileConfig.from_dict({})


def test_toml_table(tmp_path):
    path = tmp_path / "hicache.toml"
    path.write_text(f'[file]\nroot = "{tmp_path}"\nslab_bytes = "64MiB"\n')
    cfg = FileConfig.from_toml(path, table="file")
    assert cfg.slab_bytes == 64 << 20 and cfg.root == str(tmp_path)


def test_toml_unreadable_names_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[file\nroot=")
    with pytest.raises(ConfigError, match=r"broken\.toml"):
        FileConfig.from_toml(path)


def test_environment_then_explicit(tmp_path):
    env = {"HICACHE_L3_FILE_ROOT": str(tmp_path), "HICACHE_L3_FILE_IO_THREADS": "7"}
    cfg = FileConfig.load("file", {"io_threads": 2}, environ=env)
    assert cfg.root == str(tmp_path) and cfg.io_threads == 2
    assert FileConfig.load("file", {}, environ=env).io_threads == 7


def test_help_lists_every_field():
    helps = FileConfig.field_help()
    assert {"root", "capacity_bytes", "o_direct", "fsync", "page_bytes"} <= set(helps)
    assert all(text for _, text in helps.values())


def test_settings_reference_is_current():
    """docs/settings.md is generated from the config classes; regenerate it when they change:
    python -m hicache_l3.settings_doc > docs/settings.md"""
    from pathlib import Path

    from hicache_l3.settings_doc import render

    doc = Path(__file__).resolve().parents[2] / "docs" / "settings.md"
    assert doc.read_text() == render()


def test_fsspec_root_names_the_slab_settings_it_ignores(tmp_path: Path, caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """A URL root gets the fsspec connector, whose settings are its own: the slab store's
    settings given with it are named in a warning instead of being silently ignored."""
    from hicache_l3.common.registry import open_connector
    from hicache_l3.connectors.fsspec_root import FsspecConfig, FsspecConnector

    ns = {"model": "m", "kv_dtype": "x", "layout": "page_first", "page_size": 1}
    root = f"file://{tmp_path}/fs"
    with caplog.at_level("WARNING", logger="hicache_l3.fsspec"), open_connector(
            "file", ns, {"root": root, "capacity_bytes": "1GiB", "o_direct": True, "io_threads": 1}) as conn:
        assert isinstance(conn, FsspecConnector) and conn.batch_exists(["k"]) == [False]
        assert isinstance(conn.config, FsspecConfig) and conn.config.io_threads == 1
    assert "['capacity_bytes', 'o_direct'] mean nothing for an fsspec root" in caplog.text


def test_parse_sets_keeps_values_as_given_and_names_a_bad_item() -> None:
    assert parse_sets([" checksum = none", "write_threads=1", "root=/a=b"]) == {
        "checksum": "none", "write_threads": "1", "root": "/a=b"}
    for bad in ("oops", "=1"):
        with pytest.raises(ConfigError, match=f"--set '{bad}': expected KEY=VALUE"):
            parse_sets(["checksum=none", bad])
