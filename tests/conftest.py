"""Fixtures shared by the whole suite: engines that several test directories use."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache_l3.engines import GlusterEngine


@pytest.fixture(scope="session")
def gluster() -> Iterator[GlusterEngine]:
    """A started :class:`~hicache_l3.engines.GlusterEngine` (one volume, two FUSE mounts:
    ``gluster.mounts`` = node A's and node B's roots), shared by the session and stopped at
    its end. Never skips: where it cannot start (not root, GlusterFS not installed, no
    /dev/fuse), the tests using it error with the reason (scripts/setup.sh installs it)."""
    with GlusterEngine() as engine:
        yield engine


@pytest.fixture(scope="session")
def node_roots(gluster: GlusterEngine) -> tuple[Path, Path]:
    """Two nodes' views of one directory (``hicache_l3.conformance.cross_node``): the
    GlusterFS volume's two mounts."""
    return gluster.mounts
