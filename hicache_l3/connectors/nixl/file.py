"""NIXL file mode: the shared slab store (the file connector's layout: both read each other's
pages), page data moved by NIXL's POSIX plugin in one transfer per batch between DRAM
registered once and slab files registered once per agent (``FILE``), adjacent rows joined;
marker records and checksums by the C library, one call per batch. A set writes the marker
records, then the data; a get reads the data, then the records, and accepts a page only if
its record carries what the index gave (:mod:`hicache_l3.slab.format`). A get reads the
batch's :class:`~hicache_l3.slab.plan.GetPlan`; a checked get verifies runs of about
:data:`HOT_BYTES` right after their transfer. A batch of 4 MiB or more is shared by the lanes
(:mod:`~hicache_l3.connectors.nixl.lanes`, ``transfer_agents``).
"""

from __future__ import annotations

import array
import functools
import os
import threading
from collections.abc import Callable, Sequence
from itertools import pairwise, repeat
from typing import Any

from hicache_l3.common.errors import Reason
from hicache_l3.common.integrity import page_checksum
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import MemoryRegion
from hicache_l3.common.pages import Page
from hicache_l3.common.parallel import BatchPool
from hicache_l3.connectors.nixl import batch_lib
from hicache_l3.connectors.nixl.base import (
    MERGE_MAX_BYTES,
    Agent,
    NixlConfig,
    NixlConnector,
    TransferError,
    run_flat,
    run_on,
)
from hicache_l3.connectors.nixl.lanes import SHARE_MIN_BYTES, Balance, Lanes, by_file, row_lengths, split_rows
from hicache_l3.slab import native
from hicache_l3.slab.connector import SlabConnector
from hicache_l3.slab.format import RECORD_BYTES, Entry, expected_markers
from hicache_l3.slab.io import (
    CHECKSUM,
    FAILED,
    HEADER,
    OK,
    SHORT,
    ReadBatch,
    SlotTransport,
    WriteBatch,
)
from hicache_l3.slab.plan import GetPlan
from hicache_l3.slab.records import write_markers
from hicache_l3.slab.slots import SlotColumns
from hicache_l3.slab.store import SlabStore

# A checked get's pages are verified in runs of about this many bytes, each by the thread
# that moved it, right after its transfer, while its bytes are still in that CPU's caches:
# small enough to stay there, large enough that a run's own NIXL transfer costs little.
HOT_BYTES = 4 << 20


ENGINE_PARAMS = {"aio": "use_aio", "uring": "use_uring", "posix_aio": "use_posix_aio"}


def posix_params(engine: str) -> dict[str, str]:
    """POSIX plugin init parameters selecting one kernel I/O engine."""
    return {flag: "true" if name == engine else "false" for name, flag in ENGINE_PARAMS.items()}


def _short_is_header(status: array.array[int]) -> None:
    """Marker records read cut short (SHORT) are not the ones expected: HEADER."""
    if SHORT in status:
        for j, code in enumerate(status):
            if code == SHORT:
                status[j] = HEADER


def _flat_bytes(segments: array.array[int] | bytes) -> int:
    """The bytes of every segment of flat ``(address, length)`` uint64 pairs."""
    return sum(memoryview(segments).cast("B").cast("Q")[1::2])


def _pages_segments(segments: array.array[int] | bytes, at: array.array[int], lo: int, hi: int,
                    ) -> tuple[array.array[int] | bytes, array.array[int]]:
    """The segments and bounds (:func:`~hicache_l3.slab.native.plan_segments`) of pages
    ``lo..hi-1`` of a flat batch, as :meth:`~hicache_l3.connectors.nixl.batch_lib.NixlBatchLib.rows`
    takes them (copies: a slice of each)."""
    first, last = at[lo], at[hi]
    part = segments[16 * first:16 * last] if isinstance(segments, bytes) else segments[2 * first:2 * last]
    if at[-1] == len(at) - 1:  # one segment a page (every page has at least one)
        return part, array.array("i", range(hi - lo + 1))
    return part, array.array("i", [k - first for k in at[lo:hi + 1]])


def _runs(lo: int, hi: int, size: int, at: Sequence[int], max_descs: int) -> list[tuple[int, int]]:
    """Pages ``lo..hi-1`` of ``size`` bytes (page ``j`` the segments ``at[j]..at[j + 1]``)
    cut in consecutive runs ``(a, b)``, none empty, of about :data:`HOT_BYTES` (2/3 to 2
    times, or one page), more where pages have equally many segments and a run's would
    pass ``max_descs`` (its rows must fit one transfer: rows <= segments)."""
    count = hi - lo
    if count <= 0:
        return []
    per_run = max(1, max_descs // -(-(at[hi] - at[lo]) // count))  # pages whose segments fit
    runs = min(count, max(1, (count * size + HOT_BYTES // 2) // HOT_BYTES, -(-count // per_run)))
    return [(lo + count * r // runs, lo + count * (r + 1) // runs) for r in range(runs)]


def _page_bounds(n: int, parts: int, first: float) -> list[int]:
    """Pages ``0..n-1`` (``n >= parts >= 1``) cut in ``parts`` consecutive parts, none
    empty: the first of about ``first`` of the pages, the others of equal counts; their
    ``parts + 1`` bounds."""
    head = min(n - parts + 1, max(1, round(n * first))) if parts > 1 else n
    return [0, *(head + (n - head) * k // (parts - 1) for k in range(parts - 1)), n] if parts > 1 else [0, n]


Transfer = Callable[[Any, Any], None]  # one transfer of rows (local, remote) on some agent
PagesJob = Callable[[int, int, Transfer], None]  # job(lo, hi, transfer): pages lo..hi-1, moved by transfer


class NixlTransport(SlotTransport):
    """Slot bytes moved by NIXL's POSIX plugin, markers and checksums by the C library.
    ``transfer(op)`` gives the connector's transfer function for ``op``; ``share_read``,
    ``share_write`` and ``share_read_pages`` move a batch with the lanes, or answer False
    (:meth:`NixlFileConnector._share_read` and the others).

    A write transfer that timed out or was interrupted may still write its slots later:
    they are *held* (:attr:`~hicache_l3.slab.io.WriteBatch.held`), never reused or
    published by this process (a restart's adoption frees them; no record names them)."""

    name = "NIXL POSIX transfers, markers by the C batch library"
    reads_plans = True

    def __init__(self, transfer: Callable[[str], Transfer], max_descs: int, checksum_threads: int,
                 share_read: Callable[[Any, Any], bool], share_write: Callable[[Any, Any], bool],
                 share_read_pages: Callable[[int, int, PagesJob], bool]) -> None:
        self._transfer, self.max_descs = transfer, max_descs
        self.lib, self.helpers = native.library(), batch_lib.library()
        self._share_read, self._share_write = share_read, share_write
        self._share_read_pages = share_read_pages
        self._pool = BatchPool(checksum_threads, "hicache-nixl-csum", min_share=4)

    def _checksums(self, pages: list[Page]) -> list[int]:
        """XXH3 of each page, over ``checksum_threads`` threads (the hash releases the GIL)."""
        shares = self._pool.map(lambda lo, hi: [page_checksum(p) for p in pages[lo:hi]], len(pages))
        return [c for share in shares for c in share]

    def write(self, store: SlabStore, batch: WriteBatch) -> None:
        """Every page's marker record (one library call), then the data of every page
        whose marker was written (one NIXL transfer); the offsets and the records (key
        fingerprints included) one C call each, on arrays."""
        slots, status, pages = batch.slots, batch.status, batch.pages
        n = len(slots)
        if not n:
            return
        sums = self._checksums(pages) if batch.checksum else None
        cols = SlotColumns.of(slots)  # the reserve's columns, as they are: no tuple per page
        fds: Sequence[int] = cols.fds
        # the local write's call (slab/records.py): records with checksum 0, and offsets
        records, offsets, marker_at = write_markers(batch.keys, cols.gens, cols.slots, batch.geometry)
        data_at: Sequence[int] = offsets
        if sums is not None:  # each record's checksum field: its fourth uint64
            memoryview(records).cast("Q")[3::RECORD_BYTES // 8] = array.array("Q", sums)
        marks: Sequence[int] = self.helpers.write_markers(cols.fds, marker_at, records)
        staged = [j for j, code in enumerate(marks) if code == OK]
        if len(staged) < n:  # the data of a page whose marker failed is not written
            for j, code in enumerate(marks):
                if code != OK:
                    status[j] = code if code < 0 else SHORT
            pages, fds, data_at = ([pages[j] for j in staged], [fds[j] for j in staged],
                                   [data_at[j] for j in staged])
        if not staged:
            return
        batch.held.update(staged)  # until the transfer is known to have ended
        results = self._move("WRITE", pages, fds, data_at)
        if results.count(Reason.OK) == n:  # the common batch: all written
            batch.held.clear()
            status[:] = array.array("i", [OK]) * n
            if sums is not None:
                batch.checksums[:] = array.array("Q", sums)
            return
        for j, result in zip(staged, results):
            if result is not Reason.TIMEOUT:
                batch.held.discard(j)
            if result is not Reason.OK:
                batch.fail(j, result)
                continue
            if sums is not None:
                batch.checksums[j] = sums[j]
            status[j] = OK

    def read(self, store: SlabStore, batch: ReadBatch) -> None:
        """The data of every page (one NIXL transfer), then every marker record (a
        rewrite that began meanwhile shows there), then checksums."""
        located, pages = batch.located, batch.pages
        fds = [loc.fd for loc in located]
        data_at, marker_at = batch.geometry.offsets([loc.entry.slot for loc in located])
        moved = []
        for j, result in enumerate(self._move("READ", pages, fds, data_at)):
            if result is Reason.OK:
                moved.append(j)
            else:
                batch.fail(j, result)
        if not moved:
            return
        entries = [located[j].entry for j in moved]
        check = [k for k, e in enumerate(entries) if e.checksum]  # such pages are verified
        sums = self._checksums([pages[moved[k]] for k in check]) if check else []
        codes = self._check_markers([fds[j] for j in moved], [marker_at[j] for j in moved], entries,
                                    [batch.keys[j] for j in moved])
        for k, value in zip(check, sums):
            if codes[k] == OK and value != entries[k].checksum:
                codes[k] = CHECKSUM
        for j, code in zip(moved, codes):
            batch.status[j] = code

    def read_plan(self, plan: GetPlan, pages: Sequence[Page],
                  reasons: dict[int, Reason] | None = None) -> array.array[int]:
        """:meth:`read` of a :class:`~hicache_l3.slab.plan.GetPlan` (page ``j`` into
        ``pages[j]``): the data (one NIXL transfer), then the marker records, then the
        checksums, in C; one status per page, a failed transfer's Reason in ``reasons[j]``."""
        helpers = self.helpers
        if not self.reads_plans:
            raise NotImplementedError(f"{self.name}: planned gets turned off")
        n = plan.count
        if len(pages) != n:
            raise ValueError(f"read_plan: {len(pages)} pages for a plan of {n}")
        status = array.array("i", bytes(4 * n))
        if not n:
            return status
        segments, at = native.plan_segments(pages)  # a FlatPages' segments as they are
        csums = plan.csums
        hot = csums.count(0) != n  # pages written with a checksum: verified as they land
        if hot and self._read_hot(plan, segments, at, status, reasons):
            return status
        # (after the hot read's engine error, the rows one per segment: the failing pages)
        move = self._move_apart if hot else self._move_flat
        results = move("READ", segments, at, plan.fds, plan.data_offs)
        # after the data: a rewrite that began meanwhile shows there
        if helpers.plan_markers(plan.fds, plan.marker_offs, plan.expect, status):
            _short_is_header(status)
        if results is not None:
            for j, result in enumerate(results):
                if result is not Reason.OK:
                    status[j] = FAILED
                    if reasons is not None:
                        reasons[j] = result
        if csums.count(0) != n:  # pages written with a checksum are verified
            self._pool.map(lambda lo, hi: helpers.plan_sums(segments, at, csums, status, lo, hi), n)
        return status

    def _read_hot(self, plan: GetPlan, segments: array.array[int] | bytes, at: array.array[int],
                  status: array.array[int], reasons: dict[int, Reason] | None) -> bool:
        """:meth:`read_plan` of a batch whose pages carry checksums, in runs of about
        :data:`HOT_BYTES`, each moved (its own transfer), then its records read and its pages
        hashed by the same thread before the next; the lanes share the runs. True when
        ``status`` is final (every run moved, or a timeout, which fails every page); False,
        ``status`` cleared, after an engine error (or rows past ``max_descs``): the caller
        reads the batch again, isolating the failing pages."""
        helpers = self.helpers
        n = plan.count
        size = plan.slot_bytes or _flat_bytes(segments) // n
        scratch = bytearray(RECORD_BYTES * n)  # the records read, every run's share of it
        fds, data_offs, csums = plan.fds, plan.data_offs, plan.csums
        errors: list[TransferError] = []  # the first failed run's: the others stop

        def verify(lo: int, hi: int, transfer: Transfer) -> None:
            for a, b in _runs(lo, hi, size, at, self.max_descs):
                if errors:
                    return
                run_segments, run_at = _pages_segments(segments, at, a, b)
                local, remote = helpers.rows(run_segments, run_at, fds[a:b], data_offs[a:b], MERGE_MAX_BYTES,
                                             arrays=True)
                try:
                    if len(local) > self.max_descs:
                        raise TransferError(f"{len(local)} rows in one run")  # the reference splits them
                    transfer(local, remote)
                except TransferError as exc:
                    errors.append(exc)  # (and raised: a shared get's failed part teaches no balance)
                    raise
                # after the data: a rewrite that began meanwhile shows there
                helpers.plan_markers(fds, plan.marker_offs, plan.expect, status, a, b, scratch)
                helpers.plan_sums(segments, at, csums, status, a, b)  # the pages their records vouch for

        try:
            if not self._share_read_pages(n, size, verify):
                verify(0, n, self._transfer("READ"))
        except TransferError as exc:  # a run's (in errors), or the lanes' (a lane's agent not renewed)
            if not errors:
                errors.append(exc)
        if not errors:
            _short_is_header(status)
            return True
        if any(exc.reason is Reason.TIMEOUT for exc in errors):
            status[:] = array.array("i", [FAILED]) * n
            if reasons is not None:
                reasons.update(zip(range(n), repeat(Reason.TIMEOUT)))
            return True
        status[:] = array.array("i", bytes(4 * n))
        return False

    def _move(self, op: str, pages: list[Page], fds: Sequence[int], offsets: Sequence[int]) -> list[Reason]:
        """Move ``pages[j]`` to or from ``offsets[j]`` of ``fds[j]`` (``op`` "READ" or
        "WRITE"), adjacent rows joined (built in C); one Reason per page."""
        segments, at = batch_lib.flatten(pages)
        results = self._move_flat(op, segments, at, array.array("i", fds), array.array("q", offsets))
        return [Reason.OK] * len(pages) if results is None else results

    def _move_flat(self, op: str, segments: array.array[int] | bytes, at: array.array[int],
                   fds: array.array[int], offsets: array.array[int]) -> list[Reason] | None:
        """:func:`run_flat` with ``merge`` of the pages in flat arrays
        (:meth:`~hicache_l3.connectors.nixl.batch_lib.NixlBatchLib.rows`): the joined rows
        in one transfer when they fit ``max_descs``; after an engine error, the rows one
        per segment through :func:`run_flat`, which isolates the failing pages (a timeout
        fails every page, as one transfer). None when every page moved, else one Reason
        per page."""
        helpers = self.helpers
        n = len(fds)
        if not n:
            return None
        local, remote = helpers.rows(segments, at, fds, offsets, MERGE_MAX_BYTES, arrays=True)
        if len(local) <= self.max_descs:
            try:
                if not (self._share_read if op == "READ" else self._share_write)(local, remote):
                    self._transfer(op)(local, remote)
                return None
            except TransferError as exc:
                if exc.reason is Reason.TIMEOUT:
                    return [Reason.TIMEOUT] * n
        return self._move_apart(op, segments, at, fds, offsets)

    def _move_apart(self, op: str, segments: array.array[int] | bytes, at: array.array[int],
                    fds: array.array[int], offsets: array.array[int]) -> list[Reason] | None:
        """:meth:`_move_flat` once its joined rows failed: the rows one per segment, on the
        caller's agent, through :func:`run_flat`, which isolates the failing pages."""
        helpers = self.helpers
        n = len(fds)
        local, remote = helpers.rows(segments, at, fds, offsets, 0)
        bounds = None if at[n] == n else at.tolist()  # every page at least one segment
        results = run_flat(self._transfer(op), local, remote, bounds, self.max_descs, reread=op == "READ")
        return None if results.count(Reason.OK) == n else results

    def _check_markers(self, fds: list[int], offsets: list[int], entries: list[Entry],
                       keys: list[str]) -> list[int]:
        """Per slot ``k``: OK when the marker record at ``offsets[k]`` of ``fds[k]`` carries
        ``entries[k]`` and ``keys[k]``, HEADER when not or cut short, -errno."""
        got = self.lib.read_markers(fds, offsets, b"".join(expected_markers(entries, keys)), RECORD_BYTES)
        return [code if code <= 0 else HEADER for code in got]

    def close(self) -> None:
        """Stop the checksum threads (the agent deregisters the slab files it registered)."""
        self._pool.shutdown()


class NixlFileConnector(SlabConnector, NixlConnector):
    """Pages in slab files under ``root``, moved by NIXL's POSIX plugin (module docstring)."""

    def __init__(self, config: NixlConfig, namespace: Namespace) -> None:
        super().__init__(config, namespace)
        self.checksum_writes = config.use_checksum()
        self._agent_params = posix_params(config.posix_engine)
        self._renew_lock = threading.Lock()
        self.agent = Agent("POSIX", self._agent_params, abandon_on_timeout=True)
        lanes = config.transfer_agents - 1 if len(os.sched_getaffinity(0)) > 1 else 0  # (none on one CPU)
        self._lanes = Lanes([Agent("POSIX", self._agent_params, abandon_on_timeout=True)
                             for _ in range(lanes)], self._renew_agent)
        self._read_balance = Balance(config.transfer_agents)  # the caller's share of a shared get
        self.transport = NixlTransport(lambda op: self._xfer(op, "FILE"), config.max_descs,
                                       config.checksum_threads, self._share_read, self._share_write,
                                       self._share_read_pages)
        self._init_slab_root()

    def _share_read(self, local: Any, remote: Any) -> bool:
        """Move the read rows ``local``/``remote`` split between the caller's agent and the
        lanes; False (nothing moved) when too small to share or the lanes are taken. A
        TransferError as one transfer would raise it."""
        if not self._lanes:
            return False
        parts, balance = self._read_parts(sum(row_lengths(local)))
        if parts < 2:
            return False
        pieces = split_rows(local, remote, parts, first=balance.share if balance is not None else None)
        if len(pieces) < 2:
            return False
        return self._run_shared("READ", pieces, balance)

    def _share_write(self, local: Any, remote: Any) -> bool:
        """Move the write rows split by slab file between the caller's agent and the lanes
        (writes to one file serialise in the kernel); False (nothing moved) when the rows
        name one file or the lanes are taken. A TransferError as one transfer would raise it."""
        if not self._lanes or len(local) < 2 or sum(row_lengths(local)) < 2 * SHARE_MIN_BYTES:
            return False  # too small to pay a lane's wake-up
        pieces = by_file(local, remote, len(self._lanes) + 1)
        if len(pieces) < 2:
            return False  # one file: nothing to gain
        return self._run_shared("WRITE", pieces)

    def _share_read_pages(self, n: int, size: int, job: PagesJob) -> bool:
        """A get's pages ``0..n-1`` of ``size`` bytes cut in consecutive parts (the caller's
        :attr:`Balance.share` first), ``job(lo, hi, transfer)`` of each run at once on the
        caller's agent and the lanes'. False (nothing run) when too few or too small to
        share, or the lanes are taken."""
        parts, balance = self._read_parts(n * size)
        if parts < 2 or n < 4 * parts:  # (a few big pages: parts of whole pages would be uneven)
            return False
        bounds = _page_bounds(n, parts, balance.share if balance is not None else 1 / parts)
        own, timeout = self._xfer("READ", "FILE"), self.config.timeout_s
        return self._run_parts(lambda: job(0, bounds[1], own),
                               [functools.partial(_lane_read_pages, job, lo, hi, timeout)
                                for lo, hi in pairwise(bounds[1:])], balance)

    def _read_parts(self, nbytes: int) -> tuple[int, Balance | None]:
        """The parts a get of ``nbytes`` would be cut in (under 2: not shared) and the
        :class:`Balance` sizing the caller's, learnt where every lane takes one."""
        parts = min(len(self._lanes) + 1, nbytes // SHARE_MIN_BYTES)
        return parts, self._read_balance if parts == len(self._lanes) + 1 else None

    def _run_shared(self, op: str, pieces: list[tuple[Any, Any]], balance: Balance | None = None) -> bool:
        """``pieces[0]`` moved by the caller's agent, the others by the lanes, at once;
        ``balance`` learns from their times (:meth:`Lanes.run`)."""
        own, timeout = self._xfer(op, "FILE"), self.config.timeout_s
        return self._run_parts(lambda: own(*pieces[0]),
                               [functools.partial(run_on, op=op, remote_type="FILE", local=local,
                                                  remote=remote, timeout_s=timeout)
                                for local, remote in pieces[1:]], balance)

    def _run_parts(self, own: Callable[[], None], shares: list[Callable[[Agent], None]],
                   balance: Balance | None) -> bool:
        """``own()`` on the calling thread and ``shares[i](agent)`` on lane ``i``, at once
        (:meth:`Lanes.run`; ``balance`` learns from their times when every lane takes a
        part); a lane's agent that cannot be renewed is a TransferError."""
        lanes = self._lanes
        try:
            return lanes.run(own, shares, balance if len(shares) == len(lanes) else None)
        except TransferError:
            raise
        except Exception as exc:  # a lane's agent could not be renewed
            raise TransferError(f"NIXL lanes failed: {type(exc).__name__}: {exc}") from None

    def _register(self, region: MemoryRegion) -> None:
        super()._register(region)
        for agent in self._lanes.agents:
            agent.register_dram(region)

    def _unregister(self, region: MemoryRegion) -> None:
        super()._unregister(region)
        for agent in self._lanes.agents:
            agent.deregister_dram(region)

    def _close(self) -> None:
        self._lanes.close()
        self.agent.close()  # deregisters the slab files before the store closes them
        super()._close()

    def _engine_stats(self) -> dict[str, Any]:
        return {"mode": "file", "posix_engine": self.config.posix_engine,
                "checksum": self.checksum_writes, "registered_files": self.agent.registered_files,
                "planned_get": self.transport.reads_plans,
                "agent_renewals": self.agent_renewals,
                "lanes": len(self._lanes), "lane_shared_batches": self._lanes.shared,
                "lane_renewals": self._lanes.renewals,
                "lane_read_share": round(self._read_balance.share, 3),
                **super()._engine_stats()}


def _lane_read_pages(job: PagesJob, lo: int, hi: int, timeout_s: float, agent: Agent) -> None:
    """A lane's part of a get shared by pages (:meth:`NixlFileConnector._share_read_pages`):
    ``job`` of pages ``lo..hi-1`` with the lane agent's transfers."""
    job(lo, hi, lambda local, remote: run_on(agent, "READ", "FILE", local, remote, timeout_s))
