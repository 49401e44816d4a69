"""Bench backend ``memory``: the reference connector against raw-dict, a plain dict making
the same copies (``ctypes.string_at`` on set, ``ctypes.memmove`` on get) with no validation
and no metrics: the ratio is the cost of the base class around the hooks."""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

from hicache_l3.bench.targets import BenchOptions, BenchTarget, ConnectorTarget, Pair, bench_namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.registry import open_connector


class RawDict(BenchTarget):
    """A dict of bytes, copies by ctypes: what the memory connector does minus the base class."""

    backend = "raw-dict"
    ops = ("set", "get", "exists")

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def prepare(self, buffers: list[HostBuffer], page_bytes: int) -> None:
        """Nothing to register: the dict needs no engine."""

    def run(self, op: str, plan: Any) -> list[bool]:
        """One batch: copy out, copy back, or look up."""
        keys, pages = plan
        data = self.data
        if op == "exists":
            return [k in data for k in keys]
        out = []
        for key, page in zip(keys, pages):
            if op == "set":
                data[key] = b"".join(ctypes.string_at(a, n) for a, n in page)
                out.append(True)
                continue
            value = data.get(key)
            if value is not None:
                offset = 0
                for address, length in page:
                    ctypes.memmove(address, value[offset:offset + length], length)
                    offset += length
            out.append(value is not None)
        return out

    def close(self) -> None:
        """Drop the pages."""
        self.data.clear()


def make_pairs(opts: BenchOptions, stack: contextlib.ExitStack) -> list[Pair]:
    """The memory connector and raw-dict."""
    settings = {"store": "bench", **opts.settings.get("memory", {})}
    conn = open_connector("memory", bench_namespace(opts.page_bytes, "bench-memory"), settings)
    stack.callback(conn.close)
    return [Pair(ConnectorTarget(conn, "memory"), RawDict())]
