"""Lanes of nixl file mode: extra NIXL agents, each on a resident thread, that move a
share of one batch's bytes while the caller's agent moves the rest (a get's rows cut by
:func:`split_rows`, a set's dealt out by slab file by :func:`by_file`).
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache_l3.connectors.nixl.base import Agent, row_column

SHARE_MIN_BYTES = 2 << 20  # a get moving less than this per lane goes alone
ALIGN = 4096  # parts are cut on this byte boundary of the transfer


def row_lengths(rows: Any) -> list[int]:
    """The lengths (column 1) of transfer rows."""
    return row_column(rows, 1)


def _trimmed(rows: Any, skip: int, over: int) -> Any:
    """A copy of ``rows`` whose first row starts ``skip`` bytes later and last ends ``over`` earlier."""
    rows = rows.copy() if hasattr(rows, "shape") else list(rows)
    if skip or over:
        start, length, device = map(int, rows[0])
        rows[0] = (start + skip, length - skip, device)
        start, length, device = map(int, rows[-1])
        rows[-1] = (start, length - over, device)
    return rows


def split_rows(local: Any, remote: Any, parts: int, align: int = ALIGN,
               first: float | None = None) -> list[tuple[Any, Any]]:
    """``local`` and ``remote`` (the same rows' two sides, lengths in column 1) cut on
    multiples of ``align`` bytes into at most ``parts`` transfers moving exactly the rows'
    bytes: the first of about ``first`` of the bytes (None: 1 / parts), the others equal.
    The inputs are left as they were."""
    # row arithmetic on Python ints: a batch coalesces to a few rows, where numpy costs more
    lengths = row_lengths(local)
    ends = list(itertools.accumulate(lengths))
    total = ends[-1] if ends else 0
    if first is None or parts < 2:
        points = [total * i // parts for i in range(1, parts)]
    else:
        head = int(total * min(max(first, 0.0), 1.0))
        points = [head + (total - head) * i // (parts - 1) for i in range(parts - 1)]
    cuts = sorted({p // align * align for p in points} - {0, total})
    bounds = [0, *cuts, total]
    out = []
    for a, b in itertools.pairwise(bounds):
        first_row = bisect.bisect_right(ends, a)  # the row holding byte a
        last_row = bisect.bisect_left(ends, b)  # the row holding byte b - 1
        skip = a - (ends[first_row] - lengths[first_row])
        over = ends[last_row] - b
        out.append((_trimmed(local[first_row:last_row + 1], skip, over),
                    _trimmed(remote[first_row:last_row + 1], skip, over)))
    return out


def by_file(local: Any, remote: Any, parts: int) -> list[tuple[Any, Any]]:
    """``local`` and ``remote`` grouped into at most ``parts`` transfers, each remote file's
    rows (column 2) in one part, in order, files dealt greedily to even the parts' bytes."""
    per_file: dict[int, list[int]] = {}  # fd -> its rows, in order
    arrays = hasattr(remote, "shape")
    for row, fd in enumerate(row_column(remote, 2)):
        per_file.setdefault(fd, []).append(row)
    lengths = row_lengths(local)
    files = sorted(((sum(lengths[row] for row in rows), fd) for fd, rows in per_file.items()), reverse=True)
    loads = [0] * min(parts, len(files))
    groups: list[list[int]] = [[] for _ in loads]
    for nbytes, fd in files:  # the biggest file to the lightest part
        k = loads.index(min(loads))
        loads[k] += nbytes
        groups[k].extend(per_file[fd])
    out = []
    for group in groups:
        group.sort()
        out.append((local[group], remote[group]) if arrays
                   else ([local[row] for row in group], [remote[row] for row in group]))
    return out


class _Lane:
    """One resident thread with its own agent, running one share at a time."""

    def __init__(self, agent: Agent, name: str) -> None:
        self.agent = agent
        self.wake = threading.Semaphore(0)
        self.done = threading.Semaphore(0)
        self.job: Callable[[Agent], None] | None = None
        self.error: BaseException | None = None
        self.ended = 0.0  # perf_counter() when its last share ended
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.wake.acquire()
            job = self.job
            if job is None:
                return
            try:
                job(self.agent)
                self.error = None
            except BaseException as exc:  # handed to the caller, which raises it
                self.error = exc
            finally:
                self.job = None
                self.ended = time.perf_counter()
                self.done.release()


class Balance:
    """The caller's share of a shared get's bytes (:attr:`share`, starting at ``1 / parts``),
    learnt so that its part and the lanes' end together, counting the hand-back delay
    (:attr:`handoff`) in the lanes' time."""

    LOW, HIGH, STEP = 0.1, 0.9, 0.25
    HANDOFF_MAX = 200e-6  # a longer hand-back is a preempted caller: capped
    DECAY = 0.05  # the share of :attr:`handoff` a get without a wait takes off

    def __init__(self, parts: int) -> None:
        self.share = 1.0 / max(1, parts)
        self.observed = 0
        self.handoff = 0.0  # seconds

    def waited(self, handoff_s: float | None) -> None:
        """``handoff_s``: how long after the last lane's end the waiting caller got on (None:
        it found every lane done, and :attr:`handoff` decays)."""
        if handoff_s is None:
            self.handoff *= 1.0 - self.DECAY
        elif handoff_s > 0:
            self.handoff += self.STEP * (min(handoff_s, self.HANDOFF_MAX) - self.handoff)

    def observe(self, own_s: float, lanes_s: float) -> None:
        """Move :attr:`share` a quarter of the way to where the caller's part (``own_s``) and
        the lanes (``lanes_s`` + :attr:`handoff`) would have ended at once, within
        [:attr:`LOW`, :attr:`HIGH`]; ignored unless both times are positive."""
        if own_s <= 0 or lanes_s <= 0:
            return
        lanes_s += self.handoff
        f = self.share
        own_rate, lane_rate = f / own_s, (1.0 - f) / lanes_s  # shares of the bytes per second
        even = own_rate / (own_rate + lane_rate)
        self.share = min(self.HIGH, max(self.LOW, f + self.STEP * (even - f)))
        self.observed += 1


class Lanes:
    """``len(agents)`` lanes; ``renew(agent)`` gives a fresh agent for a poisoned one."""

    def __init__(self, agents: Sequence[Agent], renew: Callable[[Agent], Agent]) -> None:
        self._renew = renew
        self._lanes = [_Lane(agent, f"hicache-nixl-lane-{k}") for k, agent in enumerate(agents)]
        self._taken = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self.renewals = 0
        self.shared = 0  # batches whose bytes the lanes shared

    def __len__(self) -> int:
        return len(self._lanes)

    @property
    def agents(self) -> list[Agent]:
        """The lanes' agents now (to register or deregister host regions with)."""
        return [lane.agent for lane in self._lanes]

    def run(self, own: Callable[[], None], shares: Sequence[Callable[[Agent], None]],
            balance: Balance | None = None) -> bool:
        """Run ``shares[i]`` on lane ``i`` and ``own`` on the caller at once; False, having run
        nothing, when the lanes are taken, closed, too few, or this is a forked child.
        Returns or raises (own's exception first, else the first lane's) only once every
        share has ended; ``balance`` then learns from the parts' times."""
        if len(shares) > len(self._lanes) or self._closed or os.getpid() != self._pid \
                or not self._taken.acquire(blocking=False):
            return False
        started: list[_Lane] = []
        own_s, start = 0.0, time.perf_counter()
        try:
            for lane, share in zip(self._lanes, shares):
                if lane.agent.poisoned:
                    lane.agent = self._renew(lane.agent)
                    self.renewals += 1
                lane.job = share
                started.append(lane)
                lane.wake.release()
            own_error: BaseException | None = None
            own_start = time.perf_counter()
            try:
                own()
                own_s = time.perf_counter() - own_start
            except BaseException as exc:
                own_error = exc
        finally:
            waiting = time.perf_counter()
            interrupted = _wait_all(started)
            back = time.perf_counter()
            if balance is not None and own_s and started and interrupted is None \
                    and not any(lane.error is not None for lane in started):
                last = max(lane.ended for lane in started)
                # the caller waited for a lane: how long it took to get on after its end
                balance.waited(back - last if last > waiting else None)
                balance.observe(own_s, last - start)
            self._taken.release()
        self.shared += 1
        if own_error is not None:
            raise own_error
        for lane in started:
            if lane.error is not None:
                raise lane.error
        if interrupted is not None:
            raise interrupted
        return True

    def close(self) -> None:
        """Stop the threads (a share in flight ends first) and close the lanes' agents."""
        with self._taken:
            if self._closed:
                return
            self._closed = True
        if os.getpid() != self._pid:
            return
        for lane in self._lanes:
            lane.job = None
            lane.wake.release()
        for lane in self._lanes:
            lane.thread.join()
            lane.agent.close()


def _wait_all(lanes: Sequence[_Lane]) -> BaseException | None:
    """Wait for every lane's share through interruptions; return the first interruption."""
    pending: BaseException | None = None
    for lane in lanes:
        while True:
            try:
                lane.done.acquire()
                break
            except BaseException as exc:  # (KeyboardInterrupt): the lane still moves bytes
                pending = pending or exc
    return pending
