"""hicache-l3 installed alone, as a user without any engine or the test extra has it: a fresh
venv (no system site-packages) with ``pip install --no-deps -e <a copy of the repo>`` plus the
runtime dependencies (xxhash, tqdm, zstandard, numpy), and no mooncake, NIXL, pytest, torch
or SGLang. Every config class loads, ``sglang-args`` validates every built-in connector,
``check`` and ``replay`` run on the file connector, ``--help`` lists every command, and the
SGLang plugin stays inert.

pip resolves those (and setuptools for the build) through the machine's pip
configuration; here that is a local package index, so the test runs offline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONNECTORS = ["file", "hf3fs", "mooncake", "nixl"]

pytestmark = pytest.mark.slow


def _run(cmd: list[str], env: dict[str, str], timeout: float = 300, cwd: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("minimal")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    base = getattr(sys, "_base_executable", sys.executable)
    made = _run([base, "-m", "venv", str(root / "venv")], env)
    assert made.returncode == 0, made.stderr
    python = root / "venv" / "bin" / "python"
    # a copy of the checkout: an editable build writes its C libraries next to the sources,
    # and the ones there are loaded by this very test session
    source = root / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "__pycache__", "*.so", "build", "dist", "*.egg-info", ".*_cache", "tests"))
    deps = ["xxhash>=3.4", "tqdm>=4.60", "zstandard>=0.22", "numpy>=1.22"] + (
        ["tomli>=1.1"] if sys.version_info < (3, 11) else [])
    for args in (["--no-deps", "-e", str(source)], deps):
        out = _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
                   env, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    env["PATH"] = f"{root / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(root)
    return root, env


def test_no_engine_no_pytest_in_the_venv(venv: tuple[Path, dict[str, str]]) -> None:
    _, env = venv
    code = ("import importlib.util as u, json; print(json.dumps({m: u.find_spec(m) is not None for m in "
            "['mooncake', 'nixl', 'nixl_cu12', 'pytest', 'torch', 'sglang', 'hicache_l3']}))")
    out = _run(["python", "-c", code], env)
    assert json.loads(out.stdout) == {"mooncake": False, "nixl": False, "nixl_cu12": False,
                                      "pytest": False, "torch": False, "sglang": False,
                                      "hicache_l3": True}, out.stderr


def test_every_config_class_loads(venv: tuple[Path, dict[str, str]]) -> None:
    _, env = venv
    code = ("from hicache_l3.common.registry import available_connectors, config_class\n"
            "for name in available_connectors():\n"
            "    cls = config_class(name)\n"
            "    print(name, cls.__name__, len(cls.field_help()))\n"
            "import hicache_l3.settings_doc as d; assert '## mooncake' in d.render()\n")
    out = _run(["python", "-c", code], env)
    assert out.returncode == 0, out.stderr
    names = {line.split()[0]: line.split()[1] for line in out.stdout.splitlines()}
    assert names == {"faulty": "FaultConfig", "file": "FileConfig", "hf3fs": "Hf3fsConfig",
                     "memory": "MemoryConfig", "mooncake": "MooncakeConfig", "nixl": "NixlConfig"}


@pytest.mark.parametrize("connector", CONNECTORS)
def test_sglang_args_validates_every_connector(venv: tuple[Path, dict[str, str]], connector: str) -> None:
    root, env = venv
    config = root / f"{connector}.toml"
    out = _run(["hicache-l3", "sglang-args", "--backend", connector, "--config", str(config)], env)
    assert out.returncode == 0, out.stderr
    assert "--hicache-storage-backend dynamic" in out.stdout and config.exists()
    bad = _run(["hicache-l3", "sglang-args", "--backend", connector, "--set", "no_such_setting=1",
                "--config", str(root / "bad.toml")], env)
    assert bad.returncode == 2 and "no_such_setting" in bad.stderr


def test_check_and_opening_an_absent_engine(venv: tuple[Path, dict[str, str]]) -> None:
    root, env = venv
    config = root / "check-file.toml"
    made = _run(["hicache-l3", "sglang-args", "--backend", "file", "--set", f"root={root / 'l3'}",
                 "--config", str(config)], env)
    assert made.returncode == 0, made.stderr
    out = _run(["hicache-l3", "check", "--config", str(config), "--pages", "4"], env)
    assert out.returncode == 0 and out.stdout.startswith("ok: file connector"), out.stderr
    moon = root / "mooncake.toml"
    _run(["hicache-l3", "sglang-args", "--backend", "mooncake", "--config", str(moon)], env)
    out = _run(["hicache-l3", "check", "--config", str(moon)], env)
    assert out.returncode == 1 and "pip install 'hicache-l3[mooncake]'" in out.stderr, out.stderr


def test_replay_runs(venv: tuple[Path, dict[str, str]]) -> None:
    root, env = venv
    result = root / "replay.json"
    out = _run(["hicache-l3", "replay", "--backend", "file", "--sessions", "4", "--turns", "3",
                "--quiet", "--workdir", str(root / "replay"), "--json", str(result)], env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(result.read_text())["summary"]


def test_help_lists_every_command(venv: tuple[Path, dict[str, str]]) -> None:
    _, env = venv
    out = _run(["hicache-l3", "--help"], env | {"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^    (\S+)", out.stdout, re.MULTILINE)
    assert listed[:5] == ["bench", "replay", "engines", "sglang-args", "check"], out.stdout
    assert "unavailable" not in out.stdout


def test_sglang_plugin_without_sglang(venv: tuple[Path, dict[str, str]]) -> None:
    _, env = venv
    code = ("from hicache_l3.sglang.plugin import install; install()\n"
            "from hicache_l3.sglang.takeover import takeover_extra_config as t\n"
            "for n in ('file', 'mooncake', 'nixl', 'hf3fs'): print(t(n, {}, env={})['connector'])\n")
    out = _run(["python", "-c", code], {k: v for k, v in env.items() if k != "HICACHE_L3_SGLANG_BACKENDS"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["file", "mooncake", "nixl", "hf3fs"]
