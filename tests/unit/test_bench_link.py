"""The bench's limited link (hicache_l3.bench.link) and ``bench --compression-link-rate``:
bytes pass intact both ways, at no more than the rate, and the option is refused where there
is no S3 link to limit."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from hicache_l3.bench.compression import backend_settings, format_rows, run_backend
from hicache_l3.bench.link import LimitedLink, Pace
from hicache_l3.bench.runner import BenchError
from hicache_l3.cli import main


@pytest.fixture
def echo_port() -> Iterator[int]:
    """A loopback server echoing every connection's bytes back."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def _round_trip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        got = bytearray()
        while len(got) < len(payload):
            chunk = sock.recv(1 << 16)
            assert chunk, "the link closed early"
            got += chunk
        sender.join()
    return bytes(got)


def test_pace_refuses_a_rate_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        Pace(0)


def test_bytes_pass_intact_both_ways_on_several_connections(echo_port: int) -> None:
    payloads = [bytes(range(256)) * 4096 * (i + 1) for i in range(3)]
    with LimitedLink(("127.0.0.1", echo_port), 1e9) as link:
        results: list[bytes] = [b""] * len(payloads)

        def run(i: int) -> None:
            results[i] = _round_trip(link.port, payloads[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(payloads))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    assert results == payloads


def test_the_link_passes_no_more_than_its_rate(echo_port: int) -> None:
    rate, size = 20e6, 2_000_000
    with LimitedLink(("127.0.0.1", echo_port), rate) as link:
        start = time.monotonic()
        assert _round_trip(link.port, b"x" * size) == b"x" * size
        took = time.monotonic() - start
    assert took >= 0.9 * size / rate  # each way paced; the echo overlaps the two directions


def test_closing_the_link_closes_its_connections(echo_port: int) -> None:
    link = LimitedLink(("127.0.0.1", echo_port), 1e9).__enter__()
    sock = socket.create_connection(("127.0.0.1", link.port), timeout=10)
    assert _round_trip(link.port, b"ping") == b"ping"
    sock.sendall(b"a")
    assert sock.recv(1) == b"a"
    link.close()
    assert sock.recv(1) == b""  # the client's end sees the link go, not a hang
    sock.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", link.port), timeout=5)


def test_a_finished_connection_gives_its_sockets_back(echo_port: int) -> None:
    with LimitedLink(("127.0.0.1", echo_port), 1e9) as link:
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(20):
            assert _round_trip(link.port, b"ping") == b"ping"
        deadline = time.monotonic() + 10
        while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(os.listdir("/proc/self/fd")) <= before  # 20 connections held no descriptor


def test_backends_without_an_s3_link_refuse_a_link_rate() -> None:
    with pytest.raises(BenchError, match="--compression-link-rate"), backend_settings("memory", 1 << 20, 1e6):
        pass


def test_the_cli_refuses_a_link_rate_for_other_backends(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--compression", "--compression-backends", "memory,nixl-obj",
                       "--compression-link-rate", "100MB"]) == 2
    assert "--compression-link-rate" in capsys.readouterr().err


def test_nixl_obj_through_a_limited_link_to_the_s3_server() -> None:
    rate = 20e6
    row = run_backend("nixl-obj", 256 << 10, 16, 8, 2, "random", link_rate=rate)
    assert row["link_rate"] == 20_000_000
    assert row["get_none_gbps"] < 1.5 * rate / 1e9  # the S3 server reached through the link
    assert "20 MB/s" in format_rows([row])
