"""The page-batch contract every connector implements.

A connector stores opaque byte pages under string keys inside one
:class:`~hicache_l3.common.keys.Namespace`. Pages live in host memory that was
:meth:`Connector.register`-ed once; every transfer moves bytes straight between that
memory and the engine.

Contract (the conformance suite in :mod:`hicache_l3.conformance` checks all of it):

* ``batch_set(keys, pages)``, ``batch_get(keys, pages)``, ``batch_exists(keys)`` and
  ``delete(keys)`` return one ``bool`` per key, in order; a batch is never truncated.
  A miss, a short read, a size mismatch, a checksum failure, an invalid key, a page
  outside registered memory or an engine error is ``False`` for that key, and its
  :class:`~hicache_l3.common.errors.Reason` is counted in :meth:`Connector.stats`.
  The other keys of the batch are not affected.
* A page is a sequence of ``(address, length)`` segments (one for ``page_first``,
  several for ``layer_first``). All pages of a namespace have the same byte size
  (``page_bytes``, from config or from the first page seen).
* ``batch_set`` of a key already stored returns ``True`` and keeps the stored page
  (same key, same bytes).
* ``batch_get`` returning ``True`` means the page's bytes are exactly the bytes that
  were set; on ``False`` the destination memory may have been written to.
* :meth:`Connector.leading_hits` gives the number of leading keys that exist (what
  SGLang's prefetch wants).
* :meth:`Connector.clear` removes this namespace's pages only.
* Every method is thread-safe. After :meth:`Connector.close` (idempotent) every call
  raises :class:`~hicache_l3.common.errors.ConnectorClosedError`; close waits for calls
  in flight, so an engine library is never entered after it was shut down.
* A malformed page (not a tuple/list of ``(int address, int length)`` pairs) is ``False``
  for its key with reason ``malformed_page``, refused before any I/O.
* Destination pages of one ``batch_get`` that overlap are a caller error: ValueError for
  the whole call, before any I/O.
* Exceptions are raised only for caller errors (mismatched list lengths, overlapping
  get destinations, bad config, closed connector, a region that cannot be registered),
  never for one bad page; ``clear`` raises
  :class:`~hicache_l3.common.errors.EngineError` when the engine fails it.
* When a call returns or raises (KeyboardInterrupt included), no thread of the
  connector still touches the caller's pages.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Generic, TypeVar, cast

from hicache_l3.common.config import ConnectorConfig
from hicache_l3.common.errors import (
    ConnectorClosedError,
    EngineError,
    HiCacheL3Error,
    MemoryRegistrationError,
    Reason,
)
from hicache_l3.common.keys import Namespace, all_valid_keys, is_valid_key, prefixed_valid_keys
from hicache_l3.common.logs import RateLimitedLogger
from hicache_l3.common.memory import MemoryRegion, RegionTable
from hicache_l3.common.metrics import Metrics
from hicache_l3.common.pages import (
    FlatPages,
    Page,
    PointerPages,
    common_batch,
    normalize_page,
    overlapping,
    page_nbytes,
    pointer_batch,
)

log = logging.getLogger("hicache_l3")
_OK = Reason.OK
_OVERLAP = ("batch_get: destination pages overlap (two keys would be read into the same "
            "bytes); give each key its own page")

_REFUSED = {
    Reason.INVALID_KEY: "not a valid key",
    Reason.MALFORMED_PAGE: "a page must be a sequence of (int address, int length) pairs",
    Reason.UNREGISTERED: "page lies outside registered memory (call register() on its buffer first)",
    Reason.SIZE_MISMATCH: "page size differs from page_bytes={page_bytes}",
}

ConfigT = TypeVar("ConfigT", bound=ConnectorConfig)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a connector promises; the conformance suite asserts each declared behaviour.

    - ``persistent``: pages survive :meth:`Connector.close` and a reopen.
    - ``shared_across_processes``: a page set by one process is seen by another
      process opening the same engine and namespace.
    - ``detects_corruption``: stored bytes altered behind the connector's back (same
      length) read as a miss (checksummed pages).
    - ``evicts``: a configured capacity is enforced by evicting pages; evicted pages
      read as misses.
    - ``compresses``: the ``compression`` setting stores pages zstd-compressed
      (:mod:`hicache_l3.common.compression`) and every reader reads both forms; a connector
      without it refuses ``compression="zstd"`` with a ConfigError.
    """

    persistent: bool
    shared_across_processes: bool
    detects_corruption: bool
    evicts: bool
    compresses: bool = False


class Connector(abc.ABC, Generic[ConfigT]):
    """Base class of all connectors: validation, metrics and lifecycle around the
    engine hooks ``_set``, ``_get``, ``_exists``, ``_delete``, ``_clear``, ``_register``,
    ``_unregister`` and ``_close``.

    Hooks receive only valid keys and pages inside registered memory, of the right size,
    and return one :class:`Reason` per key; they must be thread-safe. A connector that
    stores page ``k`` under ``prefix + k`` may set ``self._key_prefix`` and implement
    :meth:`_exists_prefixed` (keys then checked and prefixed in one pass).
    """

    name: ClassVar[str] = "connector"
    config_class: ClassVar[type[ConnectorConfig]] = ConnectorConfig

    def __init__(self, config: ConfigT, namespace: Namespace) -> None:
        self.config = config
        self.namespace = namespace
        self.page_bytes: int | None = config.page_bytes
        self.metrics = Metrics()
        self.regions = RegionTable()
        self._log = RateLimitedLogger(log)
        self._state_lock = threading.Lock()
        self._state = threading.Condition(self._state_lock)
        self._inflight = 0
        self._closed = False
        self._key_prefix: str | None = None

    @classmethod
    def open(cls, settings: dict[str, Any], namespace: Namespace) -> Connector[Any]:
        """Build the config from ``settings`` (over the environment) and open the engine."""
        return cls(cls.config_class.load(cls.name, settings), namespace)  # type: ignore[arg-type]

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this connector, as configured, promises (see :class:`Capabilities`)."""

    # ---- lifecycle ----------------------------------------------------------------
    def _enter(self) -> None:
        with self._state_lock:
            if self._closed:
                raise ConnectorClosedError(f"{self.name} connector is closed")
            self._inflight += 1

    def _leave(self) -> None:
        with self._state_lock:
            self._inflight -= 1
            if self._inflight == 0 and self._closed:  # only close() waits for the count
                self._state.notify_all()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Wait for calls in flight, release the engine and registrations. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._state.wait_for(lambda: self._inflight == 0, timeout=60.0)
        for region in list(self.regions):
            try:
                self._unregister(region)
            except Exception as exc:  # closing must not fail halfway
                log.warning("%s: unregister at close failed: %s", self.name, exc)
        self._close()

    def __enter__(self) -> Connector[ConfigT]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {state} {self.namespace.describe()}>"

    # ---- memory -------------------------------------------------------------------
    def register(self, region: MemoryRegion | Any) -> MemoryRegion:
        """Make host memory known to the engine once; returns the :class:`MemoryRegion`.

        Accepts a :class:`MemoryRegion`, a CPU torch tensor or any writable buffer.
        Registering the same region twice is a no-op; an overlapping one is refused.
        """
        region = as_region(region)
        self._enter()
        try:
            if not self.regions.add(region):
                return region
            try:
                self._register(region)
            except Exception as exc:
                self.regions.remove(region)
                raise MemoryRegistrationError(
                    f"{self.name}: registering {region.size} bytes at {region.address:#x} "
                    f"failed: {exc}"
                ) from exc
            return region
        finally:
            self._leave()

    def unregister(self, region: MemoryRegion) -> None:
        """Forget a region registered before (pages in it can no longer be moved)."""
        self._enter()
        try:
            if self.regions.remove(region):
                self._unregister(region)
        finally:
            self._leave()

    def batch_set(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Store page ``i`` under ``keys[i]``; one bool per key (see module docstring)."""
        return ok_flags(self._transfer("set", keys, pages))

    def batch_get(self, keys: Sequence[str], pages: Sequence[Page]) -> list[bool]:
        """Load ``keys[i]`` into page ``i``; one bool per key, True only for exact bytes."""
        return ok_flags(self._transfer("get", keys, pages))

    def batch_exists(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: is it stored in this namespace (as far as the engine knows)?"""
        return ok_flags(self._keyed("exists", keys))

    def leading_hits(self, keys: Sequence[str]) -> int:
        """How many keys, from the first, exist before the first miss."""
        n = 0
        for hit in self.batch_exists(keys):
            if not hit:
                break
            n += 1
        return n

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys; True per key that was stored and is now gone."""
        return ok_flags(self._keyed("delete", keys))

    def clear(self) -> None:
        """Remove every page of this namespace, and nothing of any other namespace.

        Raises a :class:`~hicache_l3.common.errors.HiCacheL3Error` when the engine fails
        (an engine's own exception becomes :class:`~hicache_l3.common.errors.EngineError`,
        naming the connector and the error); pages may then remain."""
        self._enter()
        try:
            try:
                self._clear()
            except HiCacheL3Error:
                self.metrics.count("clear_failed")
                raise
            except Exception as exc:
                self.metrics.count("clear_failed")
                raise EngineError(f"{self.name}: clear failed: {type(exc).__name__}: {exc}") from exc
            self.metrics.count("clear")
        finally:
            self._leave()

    def stats(self) -> dict[str, Any]:
        """Counters per op (pages, bytes, ok, failures by reason, latency) and engine info."""
        return {
            "connector": self.name,
            "namespace": self.namespace.describe(),
            "page_bytes": self.page_bytes,
            "ops": self.metrics.snapshot(),
            "engine": self._engine_stats(),
        }

    def batch_reasons(self, op: str, keys: Sequence[str],
                      pages: Sequence[Page] | None = None) -> list[Reason]:
        """``batch_<op>`` (set, get, exists or delete) with each key's :class:`Reason`
        instead of a bool."""
        if op in ("set", "get"):
            if pages is None:
                raise ValueError(f"batch_reasons({op!r}) needs pages")
            return self._transfer(op, keys, pages)
        if op in ("exists", "delete"):
            return self._keyed(op, keys)
        raise ValueError(f"batch_reasons: unknown op {op!r} (set, get, exists, delete)")

    def _transfer(self, op: str, keys: Sequence[str], pages: Sequence[Page]) -> list[Reason]:
        if len(keys) != len(pages):
            raise ValueError(f"batch_{op}: {len(keys)} keys but {len(pages)} pages")
        self._enter()
        start = time.perf_counter()
        try:
            flat = self._common_batch(op, keys, pages)
            if flat is not None:  # the common batch, checked in one C pass
                # a read-only sequence of pages: the hooks only index and measure it
                reasons = self._call_hook(op, list(keys), cast("list[Page]", flat))
                moved = reasons.count(_OK) * (self.page_bytes or 0)
                self.metrics.observe(op, reasons, moved, time.perf_counter() - start)
                return reasons
            reasons = [Reason.OK] * len(keys)
            valid: list[int] = []
            normal: list[Page] = []
            expected = self.page_bytes
            keys_ok = all_valid_keys(keys)
            for i, (key, page) in enumerate(zip(keys, pages)):
                if not keys_ok and not is_valid_key(key):
                    reasons[i] = Reason.INVALID_KEY
                    continue
                norm = normalize_page(page)
                if norm is None:
                    reasons[i] = Reason.MALFORMED_PAGE
                elif not self.regions.covers(norm):
                    reasons[i] = Reason.UNREGISTERED
                else:
                    nbytes = page_nbytes(norm)
                    if expected is None:
                        expected = self._learn_page_bytes(nbytes)
                    if nbytes != expected:
                        reasons[i] = Reason.SIZE_MISMATCH
                    else:
                        valid.append(i)
                        normal.append(norm)
            if op == "get" and overlapping(normal):
                raise ValueError(_OVERLAP)
            if len(valid) != len(keys):
                self._warn_rejected(op, keys, reasons)
            if valid:
                for i, r in zip(valid, self._call_hook(op, [keys[i] for i in valid], normal)):
                    reasons[i] = r
            moved = reasons.count(_OK) * (expected or 0)
            self.metrics.observe(op, reasons, moved, time.perf_counter() - start)
            return reasons
        finally:
            self._leave()

    def _call_hook(self, op: str, keys: list[str], pages: list[Page]) -> list[Reason]:
        """``_set`` or ``_get`` of checked pages; engine_error for all when it raises or
        returns a wrong count (logged, rate-limited)."""
        try:
            hook = self._set if op == "set" else self._get
            results = hook(keys, pages)
            if len(results) != len(keys):
                raise RuntimeError(f"_{op} returned {len(results)} results")
        except Exception as exc:
            self._log.warning(f"{op}-exc", "%s: batch_%s failed: %r", self.name, op, exc)
            results = [Reason.ENGINE_ERROR] * len(keys)
        return results

    def _common_batch(self, op: str, keys: Sequence[str], pages: Sequence[Page]) -> FlatPages | None:
        """The common batch (valid keys, pages of plain int segments of one size,
        ``page_bytes`` in all, inside one registered region) checked in one C pass, as
        :class:`FlatPages`; None otherwise (the key-by-key checks then decide). ValueError
        for a get whose destinations overlap."""
        if type(pages) is PointerPages and pointer_batch is not None:  # SGLang's flat lists
            checked = pointer_batch(keys, pages.ptrs, pages.sizes, pages.per)
        else:
            checked = common_batch(keys, pages) if common_batch is not None else None
        if checked is None:
            return None
        segments, per, size, low, end, overlap = checked
        expected = self.page_bytes
        if expected is None:
            expected = self._learn_page_bytes(per * size)
        if per * size != expected or self.regions.find(low, end - low) is None:
            return None
        if op == "get" and overlap:
            raise ValueError(_OVERLAP)
        return FlatPages(pages, segments, per)

    def _keyed(self, op: str, keys: Sequence[str]) -> list[Reason]:
        self._enter()
        start = time.perf_counter()
        try:
            prefix = self._key_prefix
            skeys = None if prefix is None or op != "exists" else prefixed_valid_keys(prefix, keys)
            if skeys is not None:  # checked and prefixed in one pass
                reasons = self._keyed_hook(op, skeys, self._exists_prefixed)
            elif all_valid_keys(keys):  # the common batch: no per-key Python before the hook
                reasons = self._keyed_hook(op, list(keys))
            else:
                reasons = [Reason.OK if is_valid_key(k) else Reason.INVALID_KEY for k in keys]
                self._warn_rejected(op, keys, reasons)
                valid = [i for i, r in enumerate(reasons) if r is Reason.OK]
                if valid:
                    for i, r in zip(valid, self._keyed_hook(op, [keys[i] for i in valid])):
                        reasons[i] = r
            self.metrics.observe(op, reasons, 0, time.perf_counter() - start)
            return reasons
        finally:
            self._leave()

    def _keyed_hook(self, op: str, keys: list[str],
                    hook: Callable[[list[str]], list[Reason]] | None = None) -> list[Reason]:
        """``_exists``/``_delete`` (or ``hook``) of valid keys; engine_error for all when it
        raises or returns a wrong count (logged, rate-limited)."""
        if not keys:
            return []
        try:
            if hook is None:
                hook = self._exists if op == "exists" else self._delete
            results = hook(keys)
            if len(results) != len(keys):
                raise RuntimeError(f"_{op} returned {len(results)} results")
            return results
        except Exception as exc:
            self._log.warning(f"{op}-exc", "%s: %s failed: %r", self.name, op, exc)
            return [Reason.ENGINE_ERROR] * len(keys)

    def _learn_page_bytes(self, nbytes: int) -> int:
        with self._state:
            if self.page_bytes is None:
                self.page_bytes = nbytes
            return self.page_bytes

    def _warn_rejected(self, op: str, keys: Sequence[str], reasons: list[Reason]) -> None:
        for key, r in zip(keys, reasons):
            why = _REFUSED.get(r)
            if why is not None:
                self._log.warning(f"{op}-{r.value}", "%s: %s of key %.80r refused: %s", self.name, op, key,
                                  why.format(page_bytes=self.page_bytes))

    # ---- engine hooks -------------------------------------------------------------
    def _register(self, region: MemoryRegion) -> None:
        """Register ``region`` with the engine (default: nothing to do)."""

    def _unregister(self, region: MemoryRegion) -> None:
        """Undo :meth:`_register` (default: nothing to do)."""

    @abc.abstractmethod
    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        """Store valid pages; one Reason per key."""

    @abc.abstractmethod
    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        """Load into valid pages; one Reason per key."""

    @abc.abstractmethod
    def _exists(self, keys: list[str]) -> list[Reason]:
        """Reason.OK for stored keys, Reason.MISS otherwise."""

    def _exists_prefixed(self, skeys: list[str]) -> list[Reason]:
        """:meth:`_exists` of the storage keys ``_key_prefix + key``."""
        raise NotImplementedError(f"{self.name}: _key_prefix is set but _exists_prefixed is not")

    @abc.abstractmethod
    def _delete(self, keys: list[str]) -> list[Reason]:
        """Remove keys; Reason.OK where a key was stored."""

    @abc.abstractmethod
    def _clear(self) -> None:
        """Remove every page of this namespace only."""

    @abc.abstractmethod
    def _close(self) -> None:
        """Release the engine. Called once, with no call in flight."""

    def _engine_stats(self) -> dict[str, Any]:
        """Engine-specific figures for :meth:`stats` (default: none)."""
        return {}


def ok_flags(reasons: list[Reason]) -> list[bool]:
    """One bool per reason: True for :attr:`Reason.OK`."""
    ok = _OK
    n = len(reasons)
    if reasons.count(ok) == n:
        return [True] * n
    return [r is ok for r in reasons]


def as_region(obj: MemoryRegion | Any) -> MemoryRegion:
    """A :class:`MemoryRegion` from a region, a CPU torch tensor or a writable buffer."""
    if isinstance(obj, MemoryRegion):
        return obj
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        return MemoryRegion.from_tensor(obj)
    return MemoryRegion.from_buffer(obj)
