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
                          timeout=600, cwd=REPO, env=full)  # a hang bound (SGLang import: ~95 s here)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"plugin check gave no report (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    failures: list[str] = json.loads(lines[-1][len("REPORT "):])["failures"]
    return failures


def test_builtin_names_build_our_backend_with_zero_copy(tmp_path: Path) -> None:
    """file (root from SGLang's own variable), nixl (likewise), hf3fs (SGLang's from_env_config
    call, settings from SGLang's 3FS JSON file) and mooncake (SGLang's extra-config keys, the
    segment split across TP x PP as SGLang does), each through its own factory branch; the
    start-up line reaches a log configured after the plugin loaded."""
    prefix = tmp_path / "3fs" / "hicache"
    hf3fs_json = tmp_path / "hf3fs.json"
    hf3fs_json.write_text(json.dumps({"file_path_prefix": str(prefix), "file_size": 1 << 30, "numjobs": 2,
                                      "entries": 8, "metadata_server_url": "http://127.0.0.1:1"}))
    with MooncakeEngine(holder=False, segment_size="256 MB") as mc:
        spec = {"expect": "takeover", "extra": {
            "file": {},
            "nixl": {},
            "hf3fs": {},
            "mooncake": {"master_server_address": mc.settings["master_address"],
                         "mooncake": {k: v for k, v in mc.settings.items() if k != "master_address"}},
        }, "mooncake_segment": {"extra": {"master_server_address": mc.settings["master_address"],
                                          "global_segment_size": "2gb"}, "want": 512 << 20}}
        failures = run_check(spec, {
            "HICACHE_L3_SGLANG_BACKENDS": "all",
            "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path / "sglang-file-dir"),
            "SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR": str(tmp_path / "sglang-nixl-dir"),
            "SGLANG_HICACHE_HF3FS_CONFIG_PATH": str(hf3fs_json),
        })
    assert failures == [], "\n".join(failures)
    assert any((tmp_path / "sglang-nixl-dir").glob("ns-*")), "nixl did not use SGLang's nixl dir"
    assert any(prefix.glob("ns-*")), "hf3fs did not use SGLang's file_path_prefix"


def test_without_opting_in_sglang_keeps_its_backends() -> None:
    failures = run_check({"expect": "untouched", "extra": {}}, {})
    assert failures == [], "\n".join(failures)
