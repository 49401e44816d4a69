"""The opt-in ``sglang.srt.plugins`` entry point against real SGLang 0.5.23 (.venv-sglang):
``HICACHE_L3_SGLANG_BACKENDS`` makes SGLang's built-in names build our adapter, with the
zero-copy page path; without it SGLang is left as it was. Engines are started here."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_sglang import REPO, require_sglang_venv  # beside this file: pytest puts its dir on sys.path

from hicache_l3.engines import MooncakeEngine

pytestmark = pytest.mark.sglang

SCRIPT = REPO / "tests" / "integration" / "sglang_plugin_check.py"


def run_check(spec: dict[str, Any], env: dict[str, str]) -> list[str]:
    python = require_sglang_venv()
    full = {k: v for k, v in os.environ.items() if not k.startswith(("HICACHE_L3_", "SGLANG_HICACHE_"))}
    full.update(env)
    proc = subprocess.run([str(python), str(SCRIPT), json.dumps(spec)], capture_output=True, text=True,
                          timeout=240, cwd=REPO, env=full)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"plugin check gave no report (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    failures: list[str] = json.loads(lines[-1][len("REPORT "):])["failures"]
    return failures


def test_builtin_names_build_our_backend_with_zero_copy(tmp_path: Path) -> None:
    """file (root from SGLang's own variable), nixl (likewise), hf3fs (SGLang's from_env_config
    call) and mooncake (SGLang's extra-config keys), each through its own factory branch."""
    with MooncakeEngine(holder=False, segment_size="256 MB") as mc:
        spec = {"expect": "takeover", "extra": {
            "file": {},
            "nixl": {},
            "hf3fs": {"hf3fs": {"root": str(tmp_path / "hf3fs")}},
            "mooncake": {"master_server_address": mc.settings["master_address"],
                         "mooncake": {k: v for k, v in mc.settings.items() if k != "master_address"}},
        }}
        failures = run_check(spec, {
            "HICACHE_L3_SGLANG_BACKENDS": "all",
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path / "sglang-file-dir"),
            "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": str(tmp_path / "sglang-nixl-dir"),
        })
    assert failures == [], "\n".join(failures)
    assert any((tmp_path / "sglang-nixl-dir").glob("ns-*")), "nixl did not use SGLang's nixl dir"


def test_without_opting_in_sglang_keeps_its_backends() -> None:
    failures = run_check({"expect": "untouched", "extra": {}}, {})
    assert failures == [], "\n".join(failures)
