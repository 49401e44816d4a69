"""Bench backend ``hf3fs``: the 3FS connector against raw ``preadv``/``pwritev``.

The connector runs on ``workdir`` (or the configured ``root``): POSIX-mount mode on a
local directory, or USRBIO mode when ``hf3fs_fuse.io`` is importable and ``root`` is on
a 3FS mount (the JSON's ``mode`` field says which). The raw baseline is the file
backend's raw-posix target on the same pages, under the same rules. The connector gets
one writer (``max_writers=1``) with a capacity of exactly one repetition's pages, so
the timed repetitions measure a full cache reusing its slots.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hicache_l3.bench.backend_file import RawPosix, bench_namespace
from hicache_l3.bench.targets import BenchOptions, ConnectorTarget, Pair
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import Geometry


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """The hf3fs connector (``--set hf3fs.KEY=VALUE`` overrides settings) and raw-posix."""
    settings: dict[str, Any] = {
        "root": str(opts.workdir / "hf3fs-store"),
        "capacity_bytes": opts.pages * Geometry(opts.page_bytes).stride,
        "max_writers": 1,
    }
    settings.update(opts.settings.get("hf3fs", {}))
    conn = open_connector("hf3fs", bench_namespace(opts, "hf3fs"), settings)
    stack.callback(conn.close)
    raw = RawPosix(opts.workdir / "raw-posix-hf3fs.dat", opts.pages * opts.page_bytes)
    stack.callback(raw.close)
    mode = getattr(conn, "mode", "posix")
    return [Pair(ConnectorTarget(conn, "hf3fs", mode=mode), raw)]
