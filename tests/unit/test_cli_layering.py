"""The CLI and the product modules without the test extra: nothing outside conformance/
imports pytest or the suite, and a command whose optional package is missing is listed
with what to install instead of disappearing."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hicache_l3 import cli

PACKAGE = Path(cli.__file__).resolve().parent


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_product_code_imports_neither_pytest_nor_the_suite():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "conformance" in path.relative_to(PACKAGE).parts:
            continue
        for name in _imports(path):
            if name.split(".")[0] == "pytest" or name.startswith("hicache_l3.conformance"):
                offenders.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert offenders == []


def test_every_command_is_listed_without_pytest():
    code = ("import sys; sys.modules['pytest'] = None\n"
            "from hicache_l3.cli import main\n"
            "main(['--help'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    for command in cli.COMMANDS:
        assert f"    {command}" in out.stdout, out.stdout + out.stderr
    assert "unavailable" not in out.stdout


def test_a_command_missing_its_package_is_listed_with_the_hint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "needs_plot_lib.py").write_text("import matplotlib_not_installed_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "plots", cli.Command("needs_plot_lib", "draw the figures"))
    monkeypatch.setitem(cli.EXTRAS, "matplotlib_not_installed_here", "plot")
    monkeypatch.setenv("COLUMNS", "250")  # one help line per command
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    listed = capsys.readouterr().out
    assert "draw the figures [unavailable: needs matplotlib_not_installed_here: pip install " \
           "'hicache-l3[plot]']" in listed
    assert cli.main(["plots", "--out", "x.png"]) == 2
    assert "hicache-l3 plots: unavailable: needs matplotlib_not_installed_here: pip install " \
           "'hicache-l3[plot]'" in capsys.readouterr().err
    assert cli.main(["sglang-args", "--backend", "nope"]) == 2  # the others still run


def test_sglang_package_imports_sglang_only_for_the_adapter_class():
    """config, cli, takeover and the plugin (which SGLang imports in every process) load
    without SGLang or torch; the adapter class is imported on first access to it, which is
    what SGLang's ``getattr(import_module("hicache_l3.sglang"), "HiCacheL3Storage")`` does."""
    code = (
        "import sys\n"
        "import hicache_l3.sglang as pkg, hicache_l3.sglang.config, hicache_l3.sglang.cli\n"
        "import hicache_l3.sglang.plugin, hicache_l3.sglang.takeover\n"
        "print(sorted(m for m in ('torch', 'sglang', 'hicache_l3.sglang.backend') if m in sys.modules))\n"
        "try:\n"
        "    pkg.no_such_name\n"
        "except AttributeError as exc:\n"
        "    print('AttributeError', exc)\n"
        "sys.modules['sglang'] = None\n"
        "try:\n"
        "    pkg.HiCacheL3Storage\n"
        "except ImportError as exc:\n"
        "    print('ImportError', (exc.name or '').split('.')[0] in ('sglang', 'torch'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == [
        "[]", "AttributeError module 'hicache_l3.sglang' has no attribute 'no_such_name'",
        "ImportError True"], out.stdout + out.stderr
