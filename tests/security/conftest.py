"""Fixtures of the security tests: a skip (saying why) where uids cannot be switched, and
a base directory every uid may traverse (so that only the modes we set keep others out)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def as_root() -> None:
    """Skip (saying why) where the test cannot switch uids; under CI (``CI`` set), which
    runs the tests as root, fail instead, so that these tests cannot go missing there."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must run the tests as root: the security tests switch uids")
        pytest.skip("switching to another uid needs root (CI runs the tests as root)")


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A fresh directory under /tmp that every uid may use as it uses /tmp (1777), outside
    pytest's private tmp_path, so that another uid is kept out only by our own modes."""
    base = Path(tempfile.mkdtemp(prefix="hicache-l3-security-", dir="/tmp"))
    os.chmod(base, 0o1777)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
