"""Split a batch across a small thread pool; the calling thread takes the first share.

``os.preadv``/``os.pwritev``, XXH3 and most engine calls release the GIL, so pages of
one batch move in parallel.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
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
        """Results of ``fn`` per share, in order (none for ``n == 0``: ``fn`` is never
        called on an empty share); exceptions propagate."""
        if n <= 0:
            return []
        shares = min(self.threads, max(1, n // self.min_share))
        if shares <= 1 or self._pool is None:
            return [fn(0, n)]
        bounds = [(n * s // shares, n * (s + 1) // shares) for s in range(shares)]
        futures = [self._pool.submit(fn, lo, hi) for lo, hi in bounds[1:]]
        first = fn(*bounds[0])
        return [first, *(f.result() for f in futures)]

    def shutdown(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
