"""A batch's PUT records for the index log, encoded in one C call when the library is
built (``hicache_l3/native/records.c`` in ``hicache_l3._batch_io``): the commit of 1024
pages spent ~0.4 ms in the per-record Python of
:func:`~hicache_l3.slab.format.encode_puts`, which stays the reference and the fallback
(no library, a big-endian host, a key or value that does not fit: it raises its own
error then). The library is checked against it when it loads, like the other views of
``_batch_io`` (:class:`~hicache_l3.slab.native.LoadedOnce`).
"""

from __future__ import annotations

import array
import ctypes
import sys
from collections.abc import Sequence
from itertools import accumulate, chain

from hicache_l3.slab.format import RECORD, Entry
from hicache_l3.slab.format import encode_puts as python_encode_puts
from hicache_l3.slab.native import LoadedOnce
from hicache_l3.slab.table import split_snapshot

_vp, _sz = ctypes.c_void_p, ctypes.c_size_t


class _Library:
    """The record encoder of the C library, typed once."""

    def __init__(self, path: str) -> None:
        if sys.byteorder != "little":
            raise RuntimeError("the C record encoder writes little-endian hosts' bytes only")
        # the GIL stays held (PyDLL): the call takes microseconds, and taking the GIL back
        # after releasing it can wait a whole switch interval behind a busy thread
        lib = ctypes.PyDLL(path)
        self.encode = lib.hl3_encode_puts
        self.encode.restype = ctypes.c_long
        self.encode.argtypes = [_sz, ctypes.c_char_p, _vp, _vp, _vp, _sz]


def _native_encode(lib: _Library, keys: Sequence[str], values: array.array[int]) -> bytes | None:
    """The records of ``keys`` with the entries ``values`` (six each) from C, or None when
    C cannot encode them (then the reference must)."""
    n = len(keys)
    if len(values) != 6 * n or values.typecode != "Q":
        return None
    blob = "".join(keys).encode()
    if len(blob) == sum(map(len, keys)):  # all ASCII (SGLang's hex keys): one encode
        ends = array.array("Q", accumulate(map(len, keys)))
    else:
        kbs = [k.encode() for k in keys]
        blob = b"".join(kbs)
        ends = array.array("Q", accumulate(map(len, kbs)))
    cap = RECORD.size * n + len(blob)
    out = ctypes.create_string_buffer(cap)
    got = lib.encode(n, blob, ends.buffer_info()[0], values.buffer_info()[0], out, cap)
    return out.raw if got == cap else None


def encode_puts(keys: Sequence[str], entries: Sequence[Entry]) -> bytes:
    """The PUT records of ``keys[j]`` in ``entries[j]``, concatenated: exactly
    :func:`hicache_l3.slab.format.encode_puts`'s bytes (and errors), in C when it can."""
    lib = _native.get()
    if lib is not None and keys and len(keys) == len(entries):
        try:
            values = array.array("Q", chain.from_iterable(entries))
        except (OverflowError, TypeError):
            return python_encode_puts(keys, entries)
        data = _native_encode(lib, keys, values)
        if data is not None:
            return data
    return python_encode_puts(keys, entries)


def encode_put_values(keys: Sequence[str], values: array.array[int]) -> bytes:
    """:func:`encode_puts` with the entries given as six values each (``array('Q')``, a
    table export's shape), as a writer's commit builds them."""
    lib = _native.get()
    if lib is not None and keys:
        data = _native_encode(lib, keys, values)
        if data is not None:
            return data
    return python_encode_puts(keys, split_snapshot(bytes(16 * len(keys)), values)[1])


def _self_test(lib: _Library) -> None:
    keys = ["a", "key-é", "", "x" * 300]
    entries = [Entry(0, 1, 2, 3, 4, 5), Entry(7, 0, 9, 1 << 40, 65536, (1 << 64) - 1),
               Entry(0, 0, 0, 0, 0, 0), Entry(0xFFFFFFFE, 0xFFFFFFFF, 5, 6, 7, 8)]
    if _native_encode(lib, keys, array.array("Q", chain.from_iterable(entries))) != python_encode_puts(
            keys, entries):
        raise RuntimeError("the C record encoder disagrees with the reference")


def describe() -> str:
    """Which encoder :func:`encode_puts` uses, and why not the C one."""
    return "C record encoder" if _native.get() is not None else f"Python records ({_native.reason()})"


_native = LoadedOnce(_Library, _self_test, "hicache_l3._batch_io has no usable record encoder")
