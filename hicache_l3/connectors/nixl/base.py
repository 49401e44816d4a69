"""The NIXL connector: pages moved by NIXL agents, in ``mode`` ``file`` (the POSIX plugin and
the shared slab store, :mod:`hicache_l3.connectors.nixl.file`) or ``obj`` (the OBJ plugin, one
S3 object per page, :mod:`hicache_l3.connectors.nixl.obj`). Here what they share: the agent
(one per connector, only the plugin in use, strict thread mode), host regions registered as
DRAM once, and :func:`run_flat` (one transfer per batch, a failed one split until the failing
pages are isolated). Without ``nixl_cu12`` or ``nixl`` importable, opening raises
:class:`~hicache_l3.common.errors.EngineUnavailableError` with the install hint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, NamedTuple

from hicache_l3.common.compression import COMPRESSION_HELP
from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, Reason
from hicache_l3.common.memory import MemoryRegion
from hicache_l3.slab.format import ALIGN

INSTALL_HINT = "pip install 'hicache-l3[nixl]'"
DEFAULT_POSIX_ENGINE = "aio"  # the fastest POSIX engine measured (docs/benchmarks.md)

_agent_ids = itertools.count()
RETIRE_S = 60.0  # after this, requests an abandoned agent had in flight have given up
# Most bytes one merged descriptor may cover (:func:`coalesce`): far below the ~2 GiB a
# single read or write moves on Linux, so one kernel request never comes back short.
MERGE_MAX_BYTES = 64 << 20
Desc = tuple[int, int, int]  # a transfer descriptor row: (address or offset, length, device id)
_retired: list[tuple[float, Any]] = []
_retired_lock = threading.Lock()
# Agents with a transfer whose completion was never observed: kept alive, never called again
# (calling them lets the POSIX backend submit more of the abandoned transfer's I/O).
_abandoned: list[Any] = []


def _purge_retired() -> None:
    """Drop retired agents whose in-flight requests must have finished by now."""
    now = time.monotonic()
    with _retired_lock:
        old = [a for t, a in _retired if now - t > RETIRE_S]
        _retired[:] = [(t, a) for t, a in _retired if now - t <= RETIRE_S]
    old.clear()


def load_nixl_api() -> Any:
    """The ``_api`` module of ``nixl_cu12`` or ``nixl``; EngineUnavailableError with the
    install hint when neither is installed."""
    errors = []
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise EngineUnavailableError(
        f"the nixl connector needs the NIXL Python package: {INSTALL_HINT} "
        f"({'; '.join(errors)})"
    )


@dataclasses.dataclass
class NixlConfig(ConnectorConfig):
    """Settings of the nixl connector (``HICACHE_L3_NIXL_<FIELD>`` in the environment).

    Secrets (``access_key``, ``secret_key``, ``session_token``) never appear in
    ``repr``, logs or error messages.
    """

    mode: Literal["file", "obj"] = setting("file", "storage mode: 'file' (POSIX plugin) or 'obj' (S3)")
    timeout_s: float = setting(30.0, "upper bound on one NIXL transfer; pages of a transfer "
                               "that takes longer fail with reason 'timeout'")
    max_descs: int = setting(1024, "most descriptors in one NIXL transfer (larger batches are split)")
    checksum: Literal["auto", "xxh3", "none"] = setting(
        "auto", "page checksum written on set and verified on get; auto = xxh3 (both modes). none "
        "gives up detecting bytes altered at rest, and in file mode is refused on a root other "
        "nodes may mount (multi_node)",
    )
    compression: Literal["none", "zstd"] = setting("none", COMPRESSION_HELP)
    capacity_bytes: int = setting(
        0, "file: slab bytes this process may fill before evicting its LRU pages (0 = half the "
        "free space); obj: bytes of this namespace's objects kept, LRU evicted (0 = unbounded: "
        "then the bucket's lifecycle rules must bound it)", size=True,
    )
    # ---- file mode
    root: str = setting("", "file mode: directory holding the slab files")
    slab_bytes: int = setting(256 << 20, "file mode: size of one preallocated slab file", size=True)
    posix_engine: Literal["aio", "uring", "posix_aio"] = setting(
        DEFAULT_POSIX_ENGINE, "file mode: kernel I/O engine of the POSIX plugin",
    )
    fsync: Literal["none", "data", "always"] = setting("none", "file mode: durability policy")
    multi_node: Literal["auto", "true", "false"] = setting(
        "auto", "file mode: whether other nodes may mount root (as the file connector's multi_node)")
    checksum_threads: int = setting(
        2, "file mode: threads hashing a set's pages (a checked get hashes each run of pages on the "
        "thread that moved it)")
    transfer_agents: int = setting(
        2, "file mode: NIXL agents moving one batch's bytes at once, each on its own thread: a "
        "get of 4 MiB or more split in parts that end together (the caller's share learnt from "
        "the last gets' times; two agents read one slab file in parallel), a set split by "
        "slab file (the store puts a batch's slots in two files; writes to one file "
        "serialise); 1 = the caller's agent alone; on one CPU there are no lanes")
    # ---- obj mode
    endpoint: str = setting("", "obj mode: S3 endpoint (http://host:port); empty = AWS for the region")
    bucket: str = setting("", "obj mode: bucket holding the pages (must exist)")
    region: str = setting("us-east-1", "obj mode: S3 region")
    scheme: Literal["http", "https", ""] = setting(
        "", "obj mode: http or https (default: from the endpoint URL, else https)",
    )
    virtual_addressing: bool = setting(False, "obj mode: virtual-hosted-style bucket addressing")
    access_key: str = setting("", "obj mode: access key id (empty = the SDK's credential chain)",
                              secret=True)
    secret_key: str = setting("", "obj mode: secret access key", secret=True)
    session_token: str = setting("", "obj mode: session token for temporary credentials", secret=True)
    ca_bundle: str = setting("", "obj mode: path of a CA bundle for https endpoints")
    prefix: str = setting("hicache-l3/", "obj mode: object key prefix inside the bucket")
    connect_timeout_s: float = setting(
        2.0, "obj mode: bound on reaching the endpoint at open and on control calls (delete, list)",
    )
    obj_threads: int = setting(8, "obj mode: parallel S3 requests of the OBJ plugin")

    def validate(self) -> None:
        """Check values that types alone cannot; messages name the setting."""
        super().validate()
        if self.timeout_s <= 0:
            raise ConfigError(f"nixl: timeout_s must be > 0, got {self.timeout_s}")
        if self.max_descs < 1:
            raise ConfigError(f"nixl: max_descs must be >= 1, got {self.max_descs}")
        if self.mode == "file":
            if not self.root:
                raise ConfigError("nixl connector (mode=file): set root to a directory "
                                  "(e.g. root=/mnt/nvme/hicache)")
            if self.checksum_threads < 1:
                raise ConfigError(f"nixl: checksum_threads must be >= 1, got {self.checksum_threads}")
            if not 1 <= self.transfer_agents <= 16:
                raise ConfigError(f"nixl: transfer_agents must be 1..16, got {self.transfer_agents}")
            if self.slab_bytes < ALIGN:
                raise ConfigError(f"nixl: slab_bytes must be >= {ALIGN}, got {self.slab_bytes}")
        else:
            if not self.bucket:
                raise ConfigError("nixl connector (mode=obj): set bucket (and endpoint for a "
                                  "non-AWS S3 server)")
            if self.connect_timeout_s <= 0:
                raise ConfigError(f"nixl: connect_timeout_s must be > 0, got {self.connect_timeout_s}")
            if self.obj_threads < 1:
                raise ConfigError(f"nixl: obj_threads must be >= 1, got {self.obj_threads}")

    def use_checksum(self) -> bool:
        """Whether pages carry a checksum (``auto``: yes, in both modes)."""
        return self.checksum != "none"


class TransferError(Exception):
    """A NIXL transfer failed (``reason`` says how: engine error or timeout)."""

    def __init__(self, message: str, reason: Reason = Reason.ENGINE_ERROR) -> None:
        super().__init__(message)
        self.reason = reason


class Agent:
    """One NIXL agent with one storage plugin; thread-safe (NIXL strict sync mode).

    ``backend`` is ``"POSIX"`` or ``"OBJ"``; ``params`` its init parameters (they may
    hold credentials: never logged). DRAM regions are registered once and kept by
    address until :meth:`deregister_dram` or :meth:`close`; ``FILE`` descriptors once
    per agent by :meth:`register_files`.

    With ``abandon_on_timeout`` (the POSIX plugin), a transfer that times out or is
    interrupted is neither released nor polled again (either would resume its I/O): the
    agent becomes :attr:`poisoned`; the owner replaces it (:meth:`abandon`) and never
    reuses the slots the transfer touched.
    """

    def __init__(self, backend: str, params: dict[str, str], abandon_on_timeout: bool = False) -> None:
        api = load_nixl_api()
        _purge_retired()
        self.name = f"hicache-l3-{os.getpid()}-{next(_agent_ids)}"
        config = api.nixl_agent_config(
            enable_prog_thread=True, enable_listen_thread=False, backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = api.nixl_agent(self.name, config)
        if backend not in self.agent.get_plugin_list():
            raise EngineUnavailableError(
                f"NIXL has no {backend} plugin here (plugins: {self.agent.get_plugin_list()}); "
                f"reinstall with {INSTALL_HINT}"
            )
        try:
            self.agent.create_backend(backend, params)
        except Exception as exc:  # the message may not hold secrets: NIXL only names the status
            raise EngineUnavailableError(f"NIXL could not create its {backend} backend: "
                                         f"{type(exc).__name__}") from None
        self.backend = backend
        self._lock = threading.Lock()
        self._dram: dict[tuple[int, int], Any] = {}
        self._files: dict[int, Any] = {}
        self._closed = False
        self.abandon_on_timeout = abandon_on_timeout
        self.poisoned = False
        self._abandoned_handles: list[Any] = []

    # ---- registration
    def register(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> Any:
        """Register ``(addr, len, dev_id, meta)`` descriptors; returns the handle to deregister."""
        return self.agent.register_memory(descs, mem_type, backends=[self.backend])

    def deregister(self, handle: Any) -> None:
        """Undo :meth:`register`."""
        self.agent.deregister_memory(handle, backends=[self.backend])

    def register_dram(self, region: MemoryRegion) -> None:
        """Register a host region as DRAM (once per region)."""
        key = (region.address, region.size)
        with self._lock:
            if key in self._dram:
                return
            self._dram[key] = self.register([(region.address, region.size, 0, "")], "DRAM")

    def deregister_dram(self, region: MemoryRegion) -> None:
        """Forget a region registered by :meth:`register_dram`."""
        with self._lock:
            handle = self._dram.pop((region.address, region.size), None)
        if handle is not None:
            self.deregister(handle)

    def register_files(self, fds: Iterable[int]) -> None:
        """Register each slab descriptor in ``fds`` as ``FILE`` (whole file), once per agent."""
        todo = [fd for fd in fds if fd not in self._files]
        if not todo:
            return
        with self._lock:
            for fd in todo:
                if fd not in self._files:
                    size = os.fstat(fd).st_size
                    self._files[fd] = self.register([(0, size, fd, "")], "FILE")

    @property
    def registered_files(self) -> int:
        """How many ``FILE`` descriptors this agent has registered."""
        return len(self._files)

    def query(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> list[Any]:
        """The plugin's ``query_memory`` answer per descriptor (None = absent)."""
        return list(self.agent.query_memory(descs, self.backend, mem_type))

    # ---- transfers
    def transfer(self, op: str, local: Any, remote: Any, local_type: str, remote_type: str,
                 timeout_s: float) -> None:
        """Run one transfer (``op`` "READ" or "WRITE") to completion.

        ``local``/``remote`` are Nx3 ``(addr_or_offset, len, dev_id)`` arrays or lists.
        Raises :class:`TransferError` on any NIXL error, or with reason TIMEOUT when not
        done within ``timeout_s``. Polls ``check_xfer_state`` tightly for ~1 ms, then
        backs off (sleeps of 20 us growing to 1 ms) so a slow engine does not burn a core.
        """
        agent = self.agent
        try:
            ldescs = agent.get_xfer_descs(local, local_type)
            rdescs = agent.get_xfer_descs(remote, remote_type)
            handle = agent.initialize_xfer(op, ldescs, rdescs, self.name, backends=[self.backend])
        except Exception as exc:
            raise TransferError(f"NIXL {op} setup failed: {type(exc).__name__}: {exc}") from None
        done = False
        abandoned = False
        try:
            state = agent.transfer(handle)
            start = time.monotonic()
            deadline = start + timeout_s
            delay = 0.0
            while state == "PROC":
                state = agent.check_xfer_state(handle)
                if state != "PROC":
                    break
                now = time.monotonic()
                if now > deadline:
                    abandoned = self.abandon_on_timeout
                    raise TransferError(f"NIXL {op} not done after {timeout_s:g}s", Reason.TIMEOUT)
                if now - start > 1e-3:
                    delay = min(1e-3, max(2e-5, delay * 2))
                    time.sleep(delay)
            if state != "DONE":
                raise TransferError(f"NIXL {op} ended in state {state}")
            done = True
        except TransferError:
            raise
        except Exception as exc:
            raise TransferError(f"NIXL {op} failed: {type(exc).__name__}: {exc}") from None
        except BaseException:  # interrupted while the transfer may still be in flight
            abandoned = self.abandon_on_timeout
            if not abandoned:  # OBJ: the SDK's threads go on writing; wait for them first
                self._drain(handle, time.monotonic() + timeout_s)
            raise
        finally:
            if abandoned:
                self.poisoned = True
                self._abandoned_handles.append(handle)  # never released: releasing resumes it
            else:
                self._release(handle, done)

    def _drain(self, handle: Any, deadline: float) -> None:
        """Poll an interrupted transfer until it ends (or ``deadline``), through further
        interruptions, so that nothing writes into the caller's pages after the raise."""
        while time.monotonic() < deadline:
            try:
                if self.agent.check_xfer_state(handle) != "PROC":
                    return
                time.sleep(1e-3)
            except Exception:
                return
            except BaseException:  # interrupted again: keep draining
                continue

    def _release(self, handle: Any, done: bool) -> None:
        """Release a finished transfer's handle (a failure is raised only for a done one)."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:
            if done:
                raise
            # a transfer that cannot be cancelled stays with NIXL; it frees it later

    def abandon(self) -> None:
        """Give up this (poisoned) agent: kept alive, never called again (class docstring)."""
        with self._lock:
            self._closed = True
        with _retired_lock:
            _abandoned.append((self.agent, self._abandoned_handles))

    def close(self, background: bool = False) -> None:
        """Deregister every DRAM region and drop the agent (NIXL tears it down).

        NIXL's teardown waits, holding the GIL, for requests still in flight (an
        abandoned S3 request retries for ~25 s). With ``background`` the agent is
        retired instead: kept alive and dropped by a later open or close once
        ``RETIRE_S`` seconds have passed, so close returns at once.
        """
        if self.poisoned:
            self.abandon()
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            handles = [*self._dram.values(), *self._files.values()]
            self._dram.clear()
            self._files.clear()
        for handle in handles:
            with contextlib.suppress(Exception):
                self.deregister(handle)
        agent, self.agent = self.agent, None
        if background:
            with _retired_lock:
                _retired.append((time.monotonic(), agent))
        del agent
        _purge_retired()


class Unit(NamedTuple):
    """The descriptors of one page in a transfer: local (DRAM) and remote rows, same count."""

    local: list[tuple[int, int, int]]
    remote: list[tuple[int, int, int]]


def run_units(
    transfer: Callable[[list[tuple[int, int, int]], list[tuple[int, int, int]]], None],
    units: Sequence[Unit],
    max_descs: int,
    reread: bool = False,
) -> list[Reason]:
    """Move every unit; one Reason per unit: :func:`run_flat` of the units' descriptors
    laid end to end."""
    local = [d for u in units for d in u.local]
    remote = [d for u in units for d in u.remote]
    bounds = [0, *itertools.accumulate(len(u.local) for u in units)]
    return run_flat(transfer, local, remote, bounds, max_descs, reread)


def row_column(rows: Any, k: int) -> list[int]:
    """Column ``k`` of transfer rows (``m x 3`` numpy array or list of 3-tuples) as ints."""
    return rows[:, k].tolist() if hasattr(rows, "shape") else [row[k] for row in rows]


def run_flat(
    transfer: Callable[[list[tuple[int, int, int]], list[tuple[int, int, int]]], None],
    local: list[tuple[int, int, int]],
    remote: list[tuple[int, int, int]],
    bounds: Sequence[int] | None,
    max_descs: int,
    reread: bool = False,
    merge: bool = False,
) -> list[Reason]:
    """Move every unit; one Reason per unit.

    With ``merge`` and one row per unit (``bounds=None``), rows that continue each other
    on both sides are first moved as one (:func:`coalesce`) in a single transfer; if that
    transfer fails with an engine error, the rows are moved again one per unit as below,
    which finds the failing ones (a timeout fails every unit, as for one transfer).

    Unit ``i`` is the descriptors ``local[bounds[i]:bounds[i + 1]]`` and the same rows of
    ``remote``; ``bounds=None`` means one descriptor per unit (unit ``i`` is row ``i``),
    so a batch of one-segment pages is moved without a Python object per page.
    Units go in transfers of at most ``max_descs`` descriptors (a unit larger than that
    goes alone). A failed transfer of several units is split in halves, each retried,
    until the failing units are found (the others succeed); a timeout is not retried
    (that would multiply the wait). With ``reread`` (reads), when some units failed, the
    ones that succeeded are read once more at the end: a failed read may have written
    into host memory (the S3 SDK writes an error body into the destination), and a
    batch may name that memory for another key too.
    """
    b: Sequence[int] = range(len(local) + 1) if bounds is None else bounds
    count = len(b) - 1
    if merge and bounds is None and 1 < count <= max_descs:
        merged_local, merged_remote = coalesce(local, remote)
        if len(merged_local) < count:
            try:
                transfer(merged_local, merged_remote)
                return [Reason.OK] * count
            except TransferError as exc:
                if exc.reason is Reason.TIMEOUT:
                    return [Reason.TIMEOUT] * count
    out = [Reason.OK] * count

    def attempt(lo: int, hi: int) -> None:
        try:
            if lo == 0 and hi == count:
                transfer(local, remote)
            else:
                transfer(local[b[lo]:b[hi]], remote[b[lo]:b[hi]])
        except TransferError as exc:
            if hi - lo == 1 or exc.reason is Reason.TIMEOUT:
                out[lo:hi] = [exc.reason] * (hi - lo)
                return
            mid = (lo + hi) // 2
            attempt(lo, mid)
            attempt(mid, hi)

    lo = 0
    while lo < count:  # the common batch fits one transfer
        hi = lo + 1
        while hi < count and b[hi + 1] - b[lo] <= max_descs:
            hi += 1
        attempt(lo, hi)
        lo = hi
    if reread and Reason.OK in out and any(r is not Reason.OK for r in out):
        good = [i for i, r in enumerate(out) if r is Reason.OK]
        rows = [k for i in good for k in range(b[i], b[i + 1])]
        again_bounds = [0, *itertools.accumulate(b[i + 1] - b[i] for i in good)]
        again = run_flat(transfer, [local[k] for k in rows], [remote[k] for k in rows], again_bounds,
                         max_descs)
        for i, r in zip(good, again):
            out[i] = r
    return out


def coalesce(local: list[Desc], remote: list[Desc],
             max_bytes: int = MERGE_MAX_BYTES) -> tuple[list[Desc], list[Desc]]:
    """The rows of a transfer with every run of rows that continue each other on both
    sides (the next row starts where this one ends, locally and remotely on the same
    device) joined into one row of at most ``max_bytes`` (a row longer than that stays
    alone). The same bytes move to the same places, in fewer requests."""
    n = len(local)
    if n < 2:
        return local, remote
    cuts = [i for i, (a, b, c, d) in enumerate(zip(local, local[1:], remote, remote[1:]), 1)
            if a[0] + a[1] != b[0] or c[0] + c[1] != d[0] or c[2] != d[2]]
    if len(cuts) + 1 == n:
        return local, remote
    cuts.append(n)
    merged_local, merged_remote = [], []
    start = 0
    for end in cuts:
        while start < end:
            size = 0
            stop = start
            while stop < end and (stop == start or size + local[stop][1] <= max_bytes):
                size += local[stop][1]
                stop += 1
            row = remote[start]
            merged_local.append((local[start][0], size, local[start][2]))
            merged_remote.append((row[0], size, row[2]))
            start = stop
    return merged_local, merged_remote


class NixlConnector(Connector[NixlConfig]):
    """What the nixl connector's modes share (``open_nixl_connector`` in the package picks
    the mode).

    Subclasses create :attr:`agent` and implement the page hooks; host regions are
    registered with the agent as DRAM here.
    """

    name = "nixl"
    config_class = NixlConfig
    agent: Agent
    agent_renewals = 0
    _agent_params: dict[str, str] = {}
    _renew_lock: threading.Lock

    def _register(self, region: MemoryRegion) -> None:
        self.agent.register_dram(region)

    def _unregister(self, region: MemoryRegion) -> None:
        self.agent.deregister_dram(region)

    def _live_agent(self) -> Agent:
        """The agent for the next transfer; a poisoned one is replaced first (see
        :class:`Agent`), by :meth:`_renew_agent`."""
        agent = self.agent
        if agent.poisoned:
            with self._renew_lock:
                if self.agent.poisoned:
                    self.agent = self._renew_agent(self.agent)
                    self.agent_renewals += 1
                agent = self.agent
        return agent

    def _renew_agent(self, old: Agent) -> Agent:
        """A fresh agent with every host region registered; ``old`` is abandoned."""
        new = Agent(old.backend, self._agent_params, abandon_on_timeout=old.abandon_on_timeout)
        for region in list(self.regions):
            new.register_dram(region)
        old.abandon()
        self._log.warning("renew", "nixl: a transfer was abandoned (timeout or interruption); "
                          "its agent is retired and a new one serves later calls")
        return new

    def _xfer(self, op: str, remote_type: str) -> Callable[[list[Any], list[Any]], None]:
        """A function running one transfer, on the live agent at the time it runs (a
        transfer after a timeout in the same batch runs on the renewed agent)."""
        timeout = self.config.timeout_s

        def go(local: list[Any], remote: list[Any]) -> None:
            run_on(self._live_agent(), op, remote_type, local, remote, timeout)

        return go


def run_on(agent: Agent, op: str, remote_type: str, local: Any, remote: Any, timeout_s: float) -> None:
    """One transfer on ``agent`` (:meth:`Agent.transfer`), the slab files its ``FILE``
    rows name registered with that agent first (once per agent)."""
    if remote_type == "FILE":
        try:
            agent.register_files(set(row_column(remote, 2)))  # the slab files' descriptors
        except Exception as exc:
            raise TransferError(f"NIXL could not register a slab: {type(exc).__name__}: "
                                f"{exc}") from None
    agent.transfer(op, local, remote, "DRAM", remote_type, timeout_s)
