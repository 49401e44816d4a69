"""One "host" of the hosts-as-containers test (not a test module): runs in a runner
container (docker/runner.Dockerfile), in its own mount and PID namespaces (the
container's) and its own user namespace (``unshare --user --map-root-user``).

``python host_worker.py PORT`` serves JSON requests (POST /) on 127.0.0.1:PORT, one at a
time, on one connector:

* ``{"op": "open", "connector", "namespace", "settings"}`` -> ``{}``
* ``{"op": "set"|"get"|"exists", "keys", "page_bytes"}`` -> ``{"results": [...]}``;
  ``get`` is True only when the bytes equal :func:`pattern`;
* ``{"op": "read_loop", "keys", "page_bytes", "seconds"}`` -> ``{"ok", "miss", "wrong"}``
  counts of reading ``keys`` over and over;
* ``{"op": "namespaces"}`` -> the inodes of this process's mnt, pid and user namespaces;
* ``{"op": "listeners"}`` -> ``["ADDR:PORT", ...]``, the TCP sockets this process listens on.

Errors come back as ``{"error": "..."}`` with status 500. GET /ready answers 200.
The runner has no pytest, so this does not import hicache_l3.conformance.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector

STATE: dict[str, Any] = {}


def pattern(key: str, nbytes: int) -> bytes:
    """The bytes of page ``key`` (same as hicache_l3.conformance.suite.page_pattern)."""
    return hashlib.shake_128(key.encode()).digest(nbytes)


def _buffer(n: int, pb: int) -> tuple[memoryview, list[Any]]:
    size = max(1, n) * pb
    buffers = STATE.setdefault("buffers", {})
    if size not in buffers:
        buffers[size] = HostBuffer(size)
        STATE["conn"].register(buffers[size])
    buf = buffers[size]
    return buf.view(), contiguous_pages(buf.address, pb, range(n))


def _get(keys: list[str], pb: int) -> list[bool | None]:
    """Per key: True (exact bytes), False (miss), None (a hit with wrong bytes)."""
    view, pages = _buffer(len(keys), pb)
    view[:] = bytes(len(view))
    got = STATE["conn"].batch_get(keys, pages)
    out: list[bool | None] = []
    for i, (k, ok) in enumerate(zip(keys, got)):
        exact = view[i * pb : (i + 1) * pb] == pattern(k, pb)
        out.append(None if ok and not exact else bool(ok))
    return out


def listeners() -> list[str]:
    """The local addresses (hex, as in /proc/net/tcp*) of this process's listening sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(fields[1])
    return found


def handle(req: dict[str, Any]) -> dict[str, Any] | list[str]:
    """Serve one request."""
    op = req["op"]
    if op == "open":
        STATE["conn"] = open_connector(req["connector"], req["namespace"], req["settings"])
        return {}
    if op == "listeners":
        return listeners()
    if op == "namespaces":
        return {n: os.readlink(f"/proc/self/ns/{n}") for n in ("mnt", "pid", "user")}
    keys, pb = req.get("keys", []), req.get("page_bytes", 16 << 10)
    if op == "exists":
        return {"results": STATE["conn"].batch_exists(keys)}
    if op == "set":
        view, pages = _buffer(len(keys), pb)
        for i, k in enumerate(keys):
            view[i * pb : (i + 1) * pb] = pattern(k, pb)
        return {"results": STATE["conn"].batch_set(keys, pages)}
    if op == "get":
        return {"results": _get(keys, pb)}
    if op == "read_loop":
        counts = {"ok": 0, "miss": 0, "wrong": 0}
        deadline = time.monotonic() + req["seconds"]
        while time.monotonic() < deadline:
            for r in _get(keys, pb):
                counts["ok" if r else "miss" if r is False else "wrong"] += 1
        return counts
    raise ValueError(f"unknown op {op!r}")


class Handler(BaseHTTPRequestHandler):
    """JSON over HTTP on loopback."""

    def _reply(self, status: int, body: dict[str, Any] | list[str]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply(200, {"ready": True})

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            self._reply(200, handle(req))
        except Exception as exc:
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})

    def log_message(self, *args: Any) -> None:
        pass


if __name__ == "__main__":
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
