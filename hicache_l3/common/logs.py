"""Rate-limited logging, so that a failing engine cannot flood the serving process's log."""

from __future__ import annotations

import logging
import threading
import time


class RateLimitedLogger:
    """Logs at most one message per ``interval`` seconds per message key; counts the rest."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        """Log ``msg % args`` at WARNING unless ``key`` was logged within the interval."""
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -1e18) < self._interval:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            msg += f" ({suppressed} similar messages suppressed)"
        self._logger.warning(msg, *args)


CREDENTIAL_LOGGERS = ("botocore",)  # log signed requests (credentials) at DEBUG


def quiet_credential_loggers() -> None:
    """Raise the loggers of :data:`CREDENTIAL_LOGGERS` to INFO (never lower one), so that a
    root logger at DEBUG does not print credentials."""
    for name in CREDENTIAL_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level < logging.INFO:  # NOTSET (inherit the root's DEBUG) or DEBUG
            logger.setLevel(logging.INFO)
