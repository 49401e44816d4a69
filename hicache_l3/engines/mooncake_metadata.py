"""A Mooncake transfer-engine metadata server bound to loopback.

``mooncake_master --enable_http_metadata_server`` binds its metadata server to 0.0.0.0
whatever ``--http_metadata_server_host`` says (Mooncake 0.3.13 and its main branch build
the server from the port alone). Anyone who reaches that port can rewrite where clients
send and fetch pages. The launcher (:class:`~hicache_l3.engines.MooncakeEngine`)
runs this server, on 127.0.0.1, when the loopback shim was not built (with the shim the
master's own server binds loopback); same protocol as Mooncake's own::

    GET    /metadata?key=K   200 + the value, 404 when absent, 400 without a key
    PUT    /metadata?key=K   200; a second, different value for an ``rpc_meta`` key is 400
    DELETE /metadata?key=K   200, 404 when absent
    GET    /health           200 "OK"

Run: ``python -m hicache_l3.engines.mooncake_metadata --port N [--host 127.0.0.1]``.
Values live in memory only, like the master's embedded server. Standard library only: the
``mooncake-master`` image (``docker/``) runs this file as a script.
"""

from __future__ import annotations

import argparse
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class MetadataStore:
    """The key -> value map behind the server; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        """The value of ``key``, or None."""
        with self._lock:
            return self._values.get(key)

    def put(self, key: str, value: bytes) -> tuple[int, str]:
        """Store ``value``; (status, message) as Mooncake's server answers."""
        with self._lock:
            old = self._values.get(key)
            if "rpc_meta" in key and old is not None:
                if old == value:
                    return 200, "metadata unchanged"
                return 400, "Duplicate rpc_meta key not allowed"
            self._values[key] = value
        return 200, "metadata updated"

    def delete(self, key: str) -> bool:
        """Remove ``key``; False when it was absent."""
        with self._lock:
            return self._values.pop(key, None) is not None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: MetadataStore  # set on the subclass made by make_server

    def log_message(self, format: str, *args: object) -> None:
        pass  # one line per request would flood the engine's log

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _key(self) -> str | None:
        parts = urlsplit(self.path)
        if parts.path != "/metadata":
            self._reply(404, b"not found")
            return None
        key = parse_qs(parts.query).get("key", [""])[0]
        if not key:
            self._reply(400, b"Missing key parameter")
            return None
        return key

    def do_GET(self) -> None:
        if urlsplit(self.path).path == "/health":
            self._reply(200, b"OK")
            return
        key = self._key()
        if key is None:
            return
        value = self.store.get(key)
        if value is None:
            self._reply(404, b"metadata not found")
        else:
            self._reply(200, value, "application/json")

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length > 0 else b""
        key = self._key()
        if key is None:
            return
        status, message = self.store.put(key, body)
        self._reply(status, message.encode())

    def do_DELETE(self) -> None:
        key = self._key()
        if key is None:
            return
        if self.store.delete(key):
            self._reply(200, b"metadata deleted")
        else:
            self._reply(404, b"metadata not found")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # http.server's default listen backlog is 5: a burst of transfer-engine lookups from a
    # loaded machine's clients would see dropped SYNs and one-second retries
    request_queue_size = 1024


def make_server(host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A metadata server bound to ``host:port`` (not yet serving: call ``serve_forever``)."""
    handler = type("MetadataHandler", (_Handler,), {"store": MetadataStore()})
    return _Server((host, port), handler)


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
