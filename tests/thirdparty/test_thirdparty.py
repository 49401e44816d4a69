"""A connector from outside the project: registered by a conftest, it passes the whole
shipped suite (including the second-process test, whose worker must repeat the
registration); registered by an entry point, the registry finds it lazily; a name cannot
be overwritten by accident."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dirstore import page_path

from hicache_l3.common.errors import ConfigError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import register_connector, registration
from hicache_l3.conformance import ConnectorTests

HERE = Path(__file__).resolve().parent


class TestDirstore(ConnectorTests):
    connector_name = "dirstore"

    @pytest.fixture
    def settings(self, tmp_path: Path) -> dict[str, Any]:
        return {"root": str(tmp_path / "pages")}

    def backdoor_read(self, settings: dict[str, Any], namespace: Namespace, key: str) -> bytes | None:
        path = page_path(settings["root"], namespace, key)
        return path.read_bytes() if path.exists() else None

    def backdoor_corrupt(self, settings: dict[str, Any], namespace: Namespace, key: str,
                         how: str) -> None:
        path = page_path(settings["root"], namespace, key)
        value = path.read_bytes()
        path.write_bytes(value[:-1] if how == "truncate" else bytes([value[0] ^ 0xFF]) + value[1:])


def test_a_registered_name_is_not_silently_overwritten() -> None:
    with pytest.raises(ConfigError, match="'dirstore' is already registered"):
        register_connector("dirstore", "elsewhere:Other")
    with pytest.raises(ConfigError, match="'file' is already registered"):
        register_connector("file", "dirstore:DirConnector")
    with pytest.raises(ConfigError, match="'3fs'"):
        register_connector("3fs", "dirstore:DirConnector")
    register_connector("dirstore", "dirstore:DirConnector")  # the same again: a no-op
    register_connector("dirstore", "elsewhere:Other", clobber=True)
    try:
        assert registration("dirstore").target == "elsewhere:Other"
    finally:
        register_connector("dirstore", "dirstore:DirConnector", clobber=True)


def test_entry_point_group_is_read_lazily(tmp_path: Path) -> None:
    """An installed package declaring ``[hicache_l3.connectors]`` entry points (here a
    dist-info directory on the path, which is what pip writes): its connector is listed,
    its config class is found, it opens; an entry point cannot take a built-in name."""
    dist = tmp_path / "hicache_l3_dirstore-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: hicache-l3-dirstore\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[hicache_l3.connectors]\ndirstore-ep = dirstore:DirConnector\nfile = dirstore:DirConnector\n")
    code = (
        "import sys, logging\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from hicache_l3.common import registry\n"
        "assert 'dirstore-ep' not in registry._KNOWN  # nothing read at import\n"
        "print(registry.available_connectors())\n"
        "print(registry.config_class('dirstore-ep').__name__, registry.registration('file').target)\n"
        f"with registry.open_connector('dirstore-ep', dict(model='m', kv_dtype='x', layout='l',"
        f" page_size=1), {{'root': {str(tmp_path / 'pages')!r}}}) as conn:\n"
        "    print(conn.batch_exists(['k']))\n"
    )
    env = {"PYTHONPATH": f"{tmp_path}:{HERE}:{':'.join(sys.path)}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=env)
    lines = out.stdout.splitlines()
    assert len(lines) == 3, out.stdout + out.stderr
    assert "dirstore-ep" in lines[0]
    assert lines[1] == "DirConfig hicache_l3.connectors.file:open_file_connector"
    assert lines[2] == "[False]"
    assert "entry point file = 'dirstore:DirConnector' ignored" in out.stderr
