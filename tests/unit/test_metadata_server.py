"""The loopback metadata server speaks Mooncake's metadata protocol (GET/PUT/DELETE
/metadata?key=..., the rpc_meta duplicate rule, /health) and binds 127.0.0.1."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from hicache_l3.engines.mooncake_metadata import make_server


@pytest.fixture
def base() -> Iterator[str]:
    server = make_server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    host, port = server.server_address[:2]
    assert host == "127.0.0.1"
    yield f"http://127.0.0.1:{port}"
    server.shutdown()
    server.server_close()


def call(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_get_put_delete(base: str) -> None:
    url = f"{base}/metadata?key=mooncake%2Fram%2F127.0.0.1%3A1234"
    assert call("GET", url) == (404, b"metadata not found")
    assert call("PUT", url, b'{"a": 1}')[0] == 200
    assert call("GET", url) == (200, b'{"a": 1}')
    assert call("PUT", url, b'{"a": 2}')[0] == 200
    assert call("GET", url) == (200, b'{"a": 2}')
    assert call("DELETE", url)[0] == 200
    assert call("DELETE", url)[0] == 404
    assert call("GET", url)[0] == 404


def test_rpc_meta_keys_refuse_a_different_second_value(base: str) -> None:
    url = f"{base}/metadata?key=mooncake%2Frpc_meta%2F127.0.0.1%3A1"
    assert call("PUT", url, b"x")[0] == 200
    assert call("PUT", url, b"x")[0] == 200
    assert call("PUT", url, b"y") == (400, b"Duplicate rpc_meta key not allowed")
    assert call("DELETE", url)[0] == 200
    assert call("PUT", url, b"y")[0] == 200


def test_missing_key_and_health(base: str) -> None:
    assert call("GET", f"{base}/metadata")[0] == 400
    assert call("PUT", f"{base}/metadata?key=", b"x")[0] == 400
    assert call("GET", f"{base}/health") == (200, b"OK")
    assert call("GET", f"{base}/other")[0] == 404
