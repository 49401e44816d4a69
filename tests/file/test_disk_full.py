"""A full filesystem under the file connector: per-key ``no_space``, nothing lost, nothing
crashed, room reused after deletes. The filesystem is a real 2 MiB tmpfs mounted in a
private mount namespace (``unshare``; as a user namespace's root when not run as root),
so nothing is left mounted whatever happens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("disk_full_child.py")


def run_full_disk(tmp_path: Path) -> dict[str, object]:
    root = tmp_path / "small"
    root.mkdir()
    unshare = ["unshare", "--mount"]
    if os.geteuid() != 0:
        unshare[1:1] = ["--user", "--map-root-user"]
    script = (f'mount -t tmpfs -o size=2m,mode=0700 tmpfs "{root}" && '  # private, as roots must be
              f'exec "{sys.executable}" "{CHILD}" "{root}"')
    proc = subprocess.run([*unshare, "sh", "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("REPORT ")]
    assert lines, f"disk-full child failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}"
    report: dict[str, object] = json.loads(lines[-1][len("REPORT "):])
    return report


def test_full_disk_fails_per_key_and_loses_nothing(tmp_path: Path) -> None:
    r = run_full_disk(tmp_path)
    results = r["set"]
    assert isinstance(results, list)
    stored = sum(results)
    assert 0 < stored < len(results), results  # 2 MiB holds some 64 KiB pages, not all 64
    assert results == [True] * stored + [False] * (len(results) - stored)  # no holes
    assert r["set_failed"] == {"no_space": len(results) - stored}
    assert r["get_matches_set"] is True and r["bytes_exact"] is True
    assert r["deleted"] == 8
    assert r["set_after_delete"] == [True] * 8 and r["get_after_delete"] == [True] * 8
    assert r["bytes_after_delete"] is True
