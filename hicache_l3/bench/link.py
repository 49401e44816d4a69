"""A network link of limited bandwidth for the bench: a loopback TCP proxy in front of a
server (the local S3 server), every byte through it paced to one rate per direction, shared
by all its connections, as a client's link to a remote store is."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Any

_CHUNK = 64 << 10
_BURST_S = 0.005  # how far a direction may run ahead of its rate


class Pace:
    """``rate`` bytes a second: :meth:`take` returns once ``n`` more bytes fit the rate since
    the first call, less a burst of :data:`_BURST_S` seconds."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError(f"a link rate must be positive, not {rate}")
        self.rate = rate
        self._due = 0.0  # when the bytes taken so far have passed at the rate
        self._lock = threading.Lock()

    def take(self, n: int) -> None:
        """Wait until ``n`` bytes may pass."""
        with self._lock:
            start = max(time.monotonic() - _BURST_S, self._due)
            self._due = start + n / self.rate
            wait = self._due - _BURST_S - time.monotonic()
        if wait > 0:
            time.sleep(wait)


class LimitedLink:
    """A proxy on ``127.0.0.1`` forwarding every connection to ``target`` (host, port), each
    direction limited to ``rate`` bytes a second across connections. A context manager:
    :attr:`port` is listening inside the block; leaving it closes every connection."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target = target
        self.up, self.down = Pace(rate), Pace(rate)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="bench-link", daemon=True)

    def __enter__(self) -> LimitedLink:
        self._acceptor.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop accepting and close every connection."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        if self._acceptor.is_alive():
            self._acceptor.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            pair = [client, server]
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += pair
            running = [2]  # directions of this connection still copying
            for src, dst, pace in ((client, server, self.up), (server, client, self.down)):
                threading.Thread(target=self._pump, args=(src, dst, pace, pair, running),
                                 name="bench-link-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, pace: Pace, pair: list[socket.socket],
              running: list[int]) -> None:
        """Copy ``src`` to ``dst`` at ``pace`` until either end closes; the last direction of
        ``pair`` to end closes both sockets."""
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        try:
            while n := src.recv_into(buf):
                pace.take(n)
                dst.sendall(view[:n])
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:
            running[0] -= 1
            if running[0] or self._closed:
                return  # the other direction still copies, or close() has the sockets
            self._sockets = [sock for sock in self._sockets if sock not in pair]
        for sock in pair:
            sock.close()
