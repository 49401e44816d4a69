"""Bench backend ``hf3fs``: the 3FS connector (one writer, POSIX-mount or USRBIO mode: the
JSON's ``mode``) against raw-posix on the same pages."""

from __future__ import annotations

import contextlib

from hicache_l3.bench.backend_file import slab_pairs
from hicache_l3.bench.targets import BenchOptions, ConnectorTarget, Pair


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """The hf3fs connector (``--set hf3fs.KEY=VALUE`` overrides settings) and raw-posix."""
    conn, raw = slab_pairs(opts, stack, "hf3fs", max_writers=1)
    return [Pair(ConnectorTarget(conn, "hf3fs", mode=getattr(conn, "mode", "posix")), raw)]
