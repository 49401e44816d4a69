"""A Mooncake transfer-engine metadata server bound to loopback, speaking the protocol of
Mooncake's own (whose master-embedded server binds 0.0.0.0 whatever host it is given);
the launcher uses it when the loopback shim was not built::

    GET    /metadata?key=K   200 + the value, 404 when absent, 400 without a key
    PUT    /metadata?key=K   200; a second, different value for an ``rpc_meta`` key is 400
    DELETE /metadata?key=K   200, 404 when absent
    GET    /health           200 "OK"

``python -m hicache_l3.engines.mooncake_metadata --port N [--host 127.0.0.1]``; values live
in memory. Standard library only: the ``mooncake-master`` image runs this file as a script.
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the default backlog of 5 drops SYNs under bursts of lookups

    def __init__(self, address: tuple[str, int], handler: Any) -> None:
        super().__init__(address, handler)
        self.lock = threading.Lock()
        self.values: dict[str, bytes] = {}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would flood the engine's log

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if method == "PUT" and length > 0 else b""
        self._reply(*self._answer(method, body))

    def _answer(self, method: str, body: bytes) -> tuple[int, bytes, str]:
        parts = urlsplit(self.path)
        if method == "GET" and parts.path == "/health":
            return 200, b"OK", "text/plain"
        if parts.path != "/metadata":
            return 404, b"not found", "text/plain"
        key = parse_qs(parts.query).get("key", [""])[0]
        if not key:
            return 400, b"Missing key parameter", "text/plain"
        values = self.server.values
        with self.server.lock:
            old = values.get(key)
            if method == "GET" and old is not None:
                return 200, old, "application/json"
            if method == "DELETE" and values.pop(key, None) is not None:
                return 200, b"metadata deleted", "text/plain"
            if method != "PUT":
                return 404, b"metadata not found", "text/plain"
            if "rpc_meta" in key and old is not None and old != body:
                return 400, b"Duplicate rpc_meta key not allowed", "text/plain"
            if "rpc_meta" in key and old is not None:
                return 200, b"metadata unchanged", "text/plain"
            values[key] = body
        return 200, b"metadata updated", "text/plain"

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_DELETE(self) -> None:
        self._handle("DELETE")


def make_server(host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A metadata server bound to ``host:port`` (not yet serving: call ``serve_forever``)."""
    return _Server((host, port), _Handler)


def main(argv: list[str] | None = None) -> int:
    """Serve until killed."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, required=True, help="TCP port to bind")
    args = parser.parse_args(argv)
    server = make_server(args.host, args.port)
    print(f"metadata server on {args.host}:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
