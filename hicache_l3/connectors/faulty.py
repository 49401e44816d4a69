"""``faulty``: a connector wrapping another one and injecting seeded faults (delays,
failed keys, dropped keys; never wrong bytes). Open it by name (settings not in
:class:`FaultConfig` go to the inner connector) or around an open connector (:func:`wrap`).
Injected faults are counted in ``stats()["engine"]["injected"]``.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from typing import Any

from hicache_l3.common.config import ConnectorConfig, setting
from hicache_l3.common.connector import Capabilities, Connector
from hicache_l3.common.errors import ConfigError, Reason
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import MemoryRegion
from hicache_l3.common.pages import Page


@dataclasses.dataclass
class FaultConfig(ConnectorConfig):
    """Settings of the faulty connector (``HICACHE_L3_FAULTY_<FIELD>`` in the environment);
    every other setting is passed to the inner connector."""

    inner: str = setting("file", "the connector whose calls are faulted")
    seed: int = setting(0, "seed of the fault draws (same seed and calls: same faults)")
    delay_s: float = setting(0.0, "seconds slept before every batch call")
    set_failure: float = setting(0.0, "probability that one key of a set fails (engine_error)")
    get_failure: float = setting(0.0, "probability that one key of a get fails (engine_error)")
    exists_failure: float = setting(0.0, "probability that exists reports one key absent")
    drop_keys: str = setting("", "comma-separated keys that read as misses (get and exists)")
    drop_rate: float = setting(0.0, "probability that one key of a get reads as a miss")

    def validate(self) -> None:
        """Probabilities in [0, 1], a delay >= 0, an inner connector other than faulty."""
        super().validate()
        for name in ("set_failure", "get_failure", "exists_failure", "drop_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"faulty: {name} must be within [0, 1], got {value}")
        if self.delay_s < 0:
            raise ConfigError(f"faulty: delay_s must be >= 0, got {self.delay_s}")
        if self.inner == "faulty":
            raise ConfigError("faulty: inner must name another connector, not 'faulty'")


def open_faulty_connector(settings: dict[str, Any], namespace: Namespace) -> FaultyConnector:
    """Open the inner connector with the settings not :class:`FaultConfig`'s, and wrap it."""
    from hicache_l3.common.registry import open_connector

    own = {f.name for f in dataclasses.fields(FaultConfig)}
    config = FaultConfig.load("faulty", {k: v for k, v in settings.items() if k in own})
    inner = open_connector(config.inner, namespace, {k: v for k, v in settings.items() if k not in own})
    return FaultyConnector(config, inner)


def wrap(inner: Connector[Any], **faults: Any) -> FaultyConnector:
    """Wrap an open connector (``faults``: :class:`FaultConfig` settings); closing the
    wrapper closes ``inner``."""
    config = FaultConfig.from_dict({"inner": inner.name, **faults}, source="faulty wrap")
    return FaultyConnector(config, inner)


class FaultyConnector(Connector[FaultConfig]):
    """Forwards every call to ``inner``, failing keys as :class:`FaultConfig` says."""

    name = "faulty"
    config_class = FaultConfig

    def __init__(self, config: FaultConfig, inner: Connector[Any]) -> None:
        super().__init__(config, inner.namespace)
        self.inner = inner
        self.page_bytes = inner.page_bytes
        self._rng = random.Random(config.seed)
        self._rng_lock = threading.Lock()
        self._dropped = {k for k in config.drop_keys.split(",") if k}
        self.injected: dict[str, int] = {}

    @property
    def capabilities(self) -> Capabilities:
        """The inner connector's."""
        return self.inner.capabilities

    def _draws(self, op: str, keys: list[str], rate: float, drop: bool) -> list[bool]:
        """Per key: is it faulted?"""
        with self._rng_lock:
            faulted = [rate > 0 and self._rng.random() < rate for _ in keys]
            if drop:
                faulted = [f or k in self._dropped or (self.config.drop_rate > 0 and
                                                       self._rng.random() < self.config.drop_rate)
                           for f, k in zip(faulted, keys)]
            n = sum(faulted)
            if n:
                self.injected[op] = self.injected.get(op, 0) + n
        return faulted

    def _forward(self, op: str, keys: list[str], pages: list[Page] | None, faulted: list[bool],
                 fault: Reason) -> list[Reason]:
        """After ``delay_s``, ``fault`` for the faulted keys, the inner connector's own reason
        for the others."""
        if self.config.delay_s:
            time.sleep(self.config.delay_s)
        todo = [i for i, f in enumerate(faulted) if not f]
        out = [fault] * len(keys)
        if todo:
            inner_pages = [pages[i] for i in todo] if pages is not None else None
            for i, reason in zip(todo, self.inner.batch_reasons(op, [keys[i] for i in todo], inner_pages)):
                out[i] = reason
        return out

    def _register(self, region: MemoryRegion) -> None:
        self.inner.register(region)

    def _unregister(self, region: MemoryRegion) -> None:
        self.inner.unregister(region)

    def _set(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        faulted = self._draws("set", keys, self.config.set_failure, drop=False)
        return self._forward("set", keys, pages, faulted, Reason.ENGINE_ERROR)

    def _get(self, keys: list[str], pages: list[Page]) -> list[Reason]:
        failed = self._draws("get", keys, self.config.get_failure, drop=False)
        dropped = self._draws("drop", keys, 0.0, drop=True)
        out = self._forward("get", keys, pages, [a or b for a, b in zip(failed, dropped)], Reason.MISS)
        return [Reason.ENGINE_ERROR if f else r for f, r in zip(failed, out)]

    def _exists(self, keys: list[str]) -> list[Reason]:
        faulted = self._draws("exists", keys, self.config.exists_failure, drop=True)
        return self._forward("exists", keys, None, faulted, Reason.MISS)

    def _delete(self, keys: list[str]) -> list[Reason]:
        return self.inner.batch_reasons("delete", keys)

    def _clear(self) -> None:
        self.inner.clear()

    def _close(self) -> None:
        self.inner.close()

    def _engine_stats(self) -> dict[str, Any]:
        return {"inner": self.inner.stats(), "injected": dict(self.injected)}
