"""Lanes of nixl file mode: extra NIXL agents, each on a resident thread of its own,
that move a share of one batch's bytes while the caller's agent moves the rest.

Why. NIXL's POSIX plugin runs a transfer in the thread that posts it, and an agent in
strict sync mode serialises its callers, but two agents reading one slab file do run in
parallel (reads take the inode's lock shared). Writes to one file serialise in the
kernel whatever the agents; to two files they run at once, so the slab store puts a
set's slots in two files (:class:`~hicache_l3.slab.clock.Clocks`). Figures:
docs/benchmarks.md, "Figures behind design choices" (NIXL lanes).

How. A get: :func:`split_rows` cuts its rows into parts, the caller's of
:attr:`Balance.share` of the bytes and the lanes' of equal bytes, the share learnt from
how long the last gets' parts took (a lane starts after the caller, and on some machines
moves bytes slower: with equal parts the caller waited for it). A set: :func:`by_file`
deals its rows out by slab file. :meth:`Lanes.run` hands part ``i + 1`` to lane ``i`` and
runs part 0 on the caller, then waits for every lane. A lane sleeps on a semaphore
between batches; shares below :data:`SHARE_MIN_BYTES` are not split.

Rules a batch relies on:

* ``run`` returns, or raises, only once no lane is still moving bytes of its call: an
  interruption of the caller waits for the lanes first, so nothing writes into the
  caller's pages after the get ends (the conformance suite's interrupted-get test);
* one caller at a time: a batch that finds the lanes taken (another thread's) is told so
  and moves alone, as does a forked child (the threads are the parent's);
* a lane whose agent timed out or was interrupted (poisoned: never called again, see
  :class:`~hicache_l3.connectors.nixl.base.Agent`) gets a fresh agent before its next
  share, from the connector's ``renew``.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache_l3.connectors.nixl.base import Agent

SHARE_MIN_BYTES = 2 << 20  # a get moving less than this per lane goes alone (the wake-up would dominate)
ALIGN = 4096  # parts are cut on this byte boundary of the transfer


def _column(rows: Any, k: int) -> list[int]:
    """Column ``k`` of transfer rows -- an ``m x 3`` numpy array or a list of ``(address
    or offset, length, device)`` tuples, as the C helpers give them
    (:meth:`~hicache_l3.connectors.nixl.batch_lib.NixlBatchLib.rows`) -- as Python ints."""
    return rows[:, k].tolist() if hasattr(rows, "shape") else [row[k] for row in rows]


def row_lengths(rows: Any) -> list[int]:
    """The lengths (column 1) of transfer rows (:func:`_column`)."""
    return _column(rows, 1)


def _trimmed(rows: Any, skip: int, over: int) -> Any:
    """A copy of ``rows`` (a slice of a part's rows) whose first row starts ``skip`` bytes
    later and whose last ends ``over`` bytes earlier (the same row when there is one)."""
    if hasattr(rows, "shape"):
        rows = rows.copy()
        if skip or over:
            rows[0, 0] += skip
            rows[0, 1] -= skip
            rows[-1, 1] -= over
        return rows
    rows = list(rows)
    if skip or over:
        start, length, device = rows[0]
        rows[0] = (start + skip, length - skip, device)
        start, length, device = rows[-1]
        rows[-1] = (start, length - over, device)
    return rows


def split_rows(local: Any, remote: Any, parts: int, align: int = ALIGN,
               first: float | None = None) -> list[tuple[Any, Any]]:
    """``local`` and ``remote`` (the same rows' two sides, lengths in column 1: ``m x 3``
    uint64 numpy arrays, or lists of 3-tuples) cut into at most ``parts`` transfers of the
    same kind, cut on multiples of ``align`` bytes of the transfer (a row crossing a cut is
    split in two rows): the first of about ``first`` of the bytes (0 < first < 1; None:
    1 / parts), the others of about equal bytes. Together the parts move exactly the
    bytes of the rows, to the same places. Fewer parts when the rows hold fewer than
    ``parts`` aligned pieces. The inputs are left as they were."""
    # the row arithmetic on Python ints, numpy only to slice and adjust the parts: a batch
    # coalesces to a row or a few, where each numpy call costs more than the sum
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
    """``local`` and ``remote`` (the same rows' two sides, the remote device (a slab
    file's descriptor) in column 2: ``m x 3`` uint64 numpy arrays, or lists of 3-tuples)
    grouped into at most ``parts`` transfers of the same kind, each file's rows in one of
    them (in their order), the files dealt out so that the parts' bytes are as even as a
    greedy deal makes them: what writes, which serialise per file, can run at once."""
    # grouped on Python ints, numpy only to take each part's rows: a set batch has a row
    # or a few per file, where numpy's unique and masks cost more than the deal itself
    per_file: dict[int, list[int]] = {}  # fd -> its rows, in order
    arrays = hasattr(remote, "shape")
    for row, fd in enumerate(_column(remote, 2)):
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
    """The caller's share of a shared get's bytes (:attr:`share`), learnt so that its part
    and the lanes' end together. After each shared get, :meth:`observe` takes how long
    the caller's part took and how long after the start the last lane ended (its wake-up
    included), computes the share at which both would have ended at once (each side's
    bytes per second taken as they were) and moves :attr:`share` a quarter of the way
    there, within [:attr:`LOW`, :attr:`HIGH`]: one slow get moves it little, a lasting
    difference (a CPU whose second agent is slower, a lane's wake-up) is followed within a
    few gets. Starts at ``1 / parts`` (equal parts).

    "Together" allows for the hand-back: a caller that waits for a lane gets on only
    tens of microseconds after the lane's end (a futex wake, then the GIL), a tenth of a
    64 KiB-page part or so. :meth:`waited` learns that
    delay (:attr:`handoff`) and :meth:`observe` counts it in the lanes' time, so the
    lanes end about that much before the caller's part and the caller finds them done.
    A get whose caller found the lanes done shrinks the estimate a little
    (:attr:`DECAY`): one grown too big (a caller preempted while it waited) would
    otherwise never be corrected, since a caller that never waits never measures it."""

    LOW, HIGH, STEP = 0.1, 0.9, 0.25
    HANDOFF_MAX = 200e-6  # a longer hand-back is a preempted caller, not the wake-up: capped
    DECAY = 0.05  # the share of :attr:`handoff` a get without a wait takes off

    def __init__(self, parts: int) -> None:
        self.share = 1.0 / max(1, parts)
        self.observed = 0
        self.handoff = 0.0  # seconds

    def waited(self, handoff_s: float | None) -> None:
        """After a shared get: ``handoff_s``, how long after the last lane's end the
        caller, waiting for it, got on; None when the caller found every lane done.
        :attr:`handoff` moves a quarter of the way to a hand-back seen (at most
        :data:`HANDOFF_MAX`; a negative one is ignored), and loses :data:`DECAY` of
        itself when there was none."""
        if handoff_s is None:
            self.handoff *= 1.0 - self.DECAY
        elif handoff_s > 0:
            self.handoff += self.STEP * (min(handoff_s, self.HANDOFF_MAX) - self.handoff)

    def observe(self, own_s: float, lanes_s: float) -> None:
        """A shared get's times: the caller's part ``own_s``, the lanes' ``lanes_s``
        (from the start to the last lane's end, to which :attr:`handoff` is added);
        ignored unless both are positive."""
        if own_s <= 0 or lanes_s <= 0:
            return
        lanes_s += self.handoff
        f = self.share
        own_rate, lane_rate = f / own_s, (1.0 - f) / lanes_s  # shares of the bytes per second
        even = own_rate / (own_rate + lane_rate)
        self.share = min(self.HIGH, max(self.LOW, f + self.STEP * (even - f)))
        self.observed += 1


class Lanes:
    """``len(agents)`` lanes (module docstring). ``renew(agent)`` gives a fresh agent for
    a poisoned one (the connector's, with every host region registered); ``renewals``
    counts them."""

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
        """Run ``shares[i]`` on lane ``i`` (with its agent) and ``own`` on the calling
        thread, all at once; False, having run nothing, when the lanes are taken, closed,
        too few, or this process is a fork of the one that made them. Returns only once
        every share has ended; then raises the caller's own exception if ``own`` raised,
        else the first lane's. When every part ended well, ``balance`` observes how long
        the caller's part and the lanes took (:meth:`Balance.observe`), and how long the
        caller took to get on after a lane it waited for (:meth:`Balance.waited`)."""
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
    """Wait until every lane of ``lanes`` has ended its share, through interruptions (the
    first is returned, to be raised once the lanes are done)."""
    pending: BaseException | None = None
    for lane in lanes:
        while True:
            try:
                lane.done.acquire()
                break
            except BaseException as exc:  # (KeyboardInterrupt): the lane still moves bytes
                pending = pending or exc
    return pending
