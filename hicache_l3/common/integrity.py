"""Page checksums (XXH3-64) and the key fingerprint (XXH3-128) stored beside pages.

:func:`page_checksum` hashes a page in place through ``ctypes`` (GIL released); it gives
the same value as the ``xxhash`` binding.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import Any

import xxhash

from hicache_l3.common.pages import Page


def key_fingerprint(key: str) -> bytes:
    """16-byte fingerprint of a page key (XXH3-128), stored beside the page's bytes.

    An index keyed by a digest of the key must use another digest than this one, so that
    a digest collision still reads as a miss."""
    return xxhash.xxh3_128_digest(key.encode())


def buffer_checksum(views: Sequence[memoryview | bytes]) -> int:
    """XXH3-64 of the concatenated buffers (never 0: 0 means "no checksum")."""
    if len(views) == 1:
        value = xxhash.xxh3_64_intdigest(views[0])
    else:
        h = xxhash.xxh3_64()
        for v in views:
            h.update(v)
        value = h.intdigest()
    return value or 1


# The XXH3 entry points of the xxhash wheel's library by role; the first that exists wins
# (the *_dispatch ones pick AVX2/AVX-512 at run time).
XXH3_ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "one": ("XXH3_64bits_dispatch", "XXH3_64bits"),
    "create": ("XXH3_createState",),
    "free": ("XXH3_freeState",),
    "reset": ("XXH3_64bits_reset",),
    "update": ("XXH3_64bits_update_dispatch", "XXH3_64bits_update"),
    "digest": ("XXH3_64bits_digest",),
    "seeded128": ("XXH3_128bits_withSeed_dispatch", "XXH3_128bits_withSeed"),  # the index digest
}


def xxh3_function(role: str) -> Any:
    """The ``xxhash`` library's function for ``role`` (a key of :data:`XXH3_ENTRY_POINTS`,
    its own ctypes object: set its types before calling it). Raises ImportError, OSError
    or AttributeError where the wheel lacks it."""
    from xxhash import _xxhash  # type: ignore[attr-defined]

    lib = ctypes.CDLL(_xxhash.__file__)
    for name in XXH3_ENTRY_POINTS[role]:
        if hasattr(lib, name):
            return getattr(lib, name)
    raise AttributeError(f"the xxhash library lacks {XXH3_ENTRY_POINTS[role][-1]}")


class _NativeXXH3:
    """XXH3-64 over raw addresses through ctypes (GIL released during hashing)."""

    def __init__(self) -> None:
        self.one = xxh3_function("one")
        self.one.restype, self.one.argtypes = ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_size_t]
        self.create = xxh3_function("create")
        self.create.restype, self.create.argtypes = ctypes.c_void_p, []
        self.reset = xxh3_function("reset")
        self.reset.restype, self.reset.argtypes = ctypes.c_int, [ctypes.c_void_p]
        self.update = xxh3_function("update")
        self.update.restype = ctypes.c_int
        self.update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.digest = xxh3_function("digest")
        self.digest.restype, self.digest.argtypes = ctypes.c_uint64, [ctypes.c_void_p]
        self._local = threading.local()
        probe = ctypes.create_string_buffer(b"hicache-l3 xxh3 probe" * 200)
        addr = ctypes.addressof(probe)
        expected = xxhash.xxh3_64_intdigest(probe.raw)
        if self.one(addr, len(probe.raw)) != expected or self.many(
            ((addr, 100), (addr + 100, len(probe.raw) - 100))
        ) != expected:
            raise RuntimeError("native XXH3 disagrees with the xxhash binding")

    def many(self, page: Page) -> int:
        state = getattr(self._local, "state", None)
        if state is None:
            state = self._local.state = self.create()
        self.reset(state)
        for address, length in page:
            self.update(state, address, length)
        value: int = self.digest(state)
        return value


def _load_native() -> Any:
    try:
        return _NativeXXH3()
    except (ImportError, OSError, AttributeError, RuntimeError):
        return None


_NATIVE = _load_native()


def page_checksum(page: Page) -> int:
    """XXH3-64 of a page's segments, read in place (never 0: 0 means "no checksum")."""
    if _NATIVE is None:
        views = [(ctypes.c_char * n).from_address(a) for a, n in page]
        return buffer_checksum([memoryview(v).cast("B") for v in views])
    value: int = _NATIVE.one(page[0][0], page[0][1]) if len(page) == 1 else _NATIVE.many(page)
    return value or 1
