"""Split a batch across a small thread pool; the calling thread takes part of the work."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class BatchPool:
    """Runs ``fn(lo, hi)`` over ``[0, n)`` in up to ``threads`` contiguous shares."""

    def __init__(self, threads: int, name: str, min_share: int = 4) -> None:
        self.threads = max(1, threads)
        self.min_share = max(1, min_share)
        self._pool = (
            ThreadPoolExecutor(self.threads - 1, thread_name_prefix=name)
            if self.threads > 1
            else None
        )

    def map(self, fn: Callable[[int, int], T], n: int) -> list[T]:
        """Results of ``fn`` per share, in order (none for ``n == 0``); exceptions propagate.
        Returns or raises (KeyboardInterrupt included) only once no share is running."""
        if n <= 0:
            return []
        shares = min(self.threads, max(1, n // self.min_share))
        if shares <= 1 or self._pool is None:
            return [fn(0, n)]
        bounds = [(n * s // shares, n * (s + 1) // shares) for s in range(shares)]
        guard = _Guard()
        futures: list[Future[T]] = []
        try:
            for lo, hi in bounds[1:]:
                futures.append(self._pool.submit(guard.run, fn, lo, hi))
            first = fn(*bounds[0])
            return [first, *(f.result() for f in futures)]
        except BaseException:
            guard.settle()
            raise

    def start(self, fn: Callable[[int, int], object], n: int) -> Started:
        """``fn(lo, hi)`` over ``[0, n)`` in up to ``threads - 1`` shares on the pool's
        threads alone, the caller free meanwhile; :meth:`Started.wait` joins them."""
        started = Started()
        if n <= 0:
            return started
        if self._pool is None:
            fn(0, n)
            return started
        shares = min(self.threads - 1, max(1, n // self.min_share))
        try:
            for s in range(shares):
                started.futures.append(self._pool.submit(started.guard.run, fn, n * s // shares,
                                                         n * (s + 1) // shares))
        except BaseException:
            started.guard.settle()
            raise
        return started

    def run_chunks(self, fn: Callable[[int, int], object], n: int, chunk: int) -> None:
        """``fn(lo, hi)`` over ``[0, n)`` in chunks of ``chunk`` items, each claimed by
        whichever thread is free (the caller's included). Raises the first exception of a
        chunk; returns or raises only once no chunk is running."""
        if n <= 0:
            return
        if self._pool is None or n <= chunk:
            for lo in range(0, n, chunk):
                fn(lo, min(n, lo + chunk))
            return
        claims = itertools.count()  # next() is atomic under the GIL: each chunk claimed once
        failed: list[BaseException] = []

        def drain(_lo: int = 0, _hi: int = 0) -> None:
            for i in claims:
                lo = i * chunk
                if lo >= n or failed or guard.stopped:
                    return
                try:
                    fn(lo, min(n, lo + chunk))
                except BaseException as exc:
                    failed.append(exc)
                    return

        guard = _Guard()
        try:
            for _ in range(min(self.threads - 1, (n - 1) // chunk)):
                self._pool.submit(guard.run, drain, 0, 0)
            drain()
        finally:
            guard.settle()  # pool threads not started yet run nothing; running ones end
        if failed:
            raise failed[0]

    def run_shared(self, drain: Callable[[int], bool], stop: Callable[[], None], chunks: int,
                   wait_ns: int) -> None:
        """``chunks`` chunks claimed and joined natively: ``drain(wait_ns)`` runs chunks
        until none is left, waits up to ``wait_ns`` for the others and says whether all
        finished; ``stop()`` makes later claims find nothing. The caller drains with
        ``wait_ns``, pool threads with 0. Returns at once when the caller's drain saw every
        chunk finish; else stops the claims, waits for the pool threads and raises the first
        exception of a drain."""
        if chunks <= 0:
            return
        if self._pool is None or chunks <= 1:
            drain(wait_ns)
            return
        failed: list[BaseException] = []

        def pool_drain(_lo: int = 0, _hi: int = 0) -> None:
            try:
                drain(0)
            except BaseException as exc:
                failed.append(exc)

        guard = _Guard()
        finished = False
        try:
            for _ in range(min(self.threads - 1, chunks - 1)):
                self._pool.submit(guard.run, pool_drain, 0, 0)
            finished = drain(wait_ns)
        finally:
            if not finished:
                stop()
                guard.settle()
        if failed:
            raise failed[0]

    def shutdown(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class Started:
    """The shares :meth:`BatchPool.start` submitted."""

    def __init__(self) -> None:
        self.guard = _Guard()
        self.futures: list[Future[object]] = []

    def wait(self) -> None:
        """Return once every share ran; raise the first exception of one. Interrupted, no
        share starts any more and none is running when the interrupt propagates."""
        try:
            for future in self.futures:
                future.result()
        except BaseException:
            self.guard.settle()
            raise


class _Guard:
    """The pool shares of one call: an interrupted call stops those not started and waits
    for the running ones (a future is not enough: ``submit`` itself can be interrupted)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """True once :meth:`settle` began: no further work should start."""
        return self._stopped

    def run(self, fn: Callable[[int, int], T], lo: int, hi: int) -> T:
        """Run one share unless the call was given up (then raise CancelledError)."""
        with self._cond:
            if self._stopped:
                raise CancelledError
            self._running += 1
        try:
            return fn(lo, hi)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def settle(self) -> None:
        """No share starts any more; return once none is running, even if interrupted again."""
        while True:
            try:
                with self._cond:
                    self._stopped = True
                    while self._running:
                        self._cond.wait()
                return
            except BaseException:  # interrupted again while waiting: keep waiting
                continue
