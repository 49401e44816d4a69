"""Typed errors, and the per-key reasons a batch operation can fail for.

Batch operations never raise for one bad page: they return ``False`` for that key and
count a :class:`Reason`. Exceptions are for what the caller must fix: a bad setting,
a closed connector, an engine that cannot be reached at open time.
"""

from __future__ import annotations

import enum


class HiCacheL3Error(Exception):
    """Base class of every error this package raises."""


class ConfigError(HiCacheL3Error, ValueError):
    """A setting is missing, unknown or has a bad value; the message names it."""


class EngineUnavailableError(HiCacheL3Error):
    """The engine's package is not installed, or the engine cannot be reached."""


class ConnectorClosedError(HiCacheL3Error):
    """An operation was called on a connector after :meth:`close`."""


class EngineError(HiCacheL3Error):
    """An engine failed an operation that has no per-key result (``clear``); the message
    names the connector and the engine's error."""


class InvalidKeyError(HiCacheL3Error, ValueError):
    """A key is not acceptable (empty, too long, path separators, control bytes...)."""


class MemoryRegistrationError(HiCacheL3Error, ValueError):
    """A memory region cannot be registered (overlap, size 0, engine refused it)."""


class Reason(str, enum.Enum):
    """Why one key of a batch did or did not succeed. Counted in ``stats()``."""

    OK = "ok"
    MISS = "miss"  # the key is not stored
    SIZE_MISMATCH = "size_mismatch"  # stored length differs from the page given
    CORRUPT = "corrupt"  # checksum, header or torn-write check failed
    INVALID_KEY = "invalid_key"
    MALFORMED_PAGE = "malformed_page"  # not a sequence of (int address, int length) pairs
    UNREGISTERED = "unregistered_memory"  # a page segment lies outside registered memory
    NO_SPACE = "no_space"
    ENGINE_ERROR = "engine_error"
    TIMEOUT = "timeout"
    ENGINE_DOWN = "engine_down"
    UNVERIFIED = "unverified"  # stored without the checksum this reader requires
