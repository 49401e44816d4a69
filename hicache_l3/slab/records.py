"""A set batch's per-key bytes in one C call each
(``hicache_l3/native/records.c`` in ``hicache_l3._batch_io``):

* the keys' table digests (:func:`key_digests`, the reference
  :func:`~hicache_l3.slab.table.digests`), as one buffer the table calls take as it is;
* the PUT records for the index log (:func:`encode_puts`, :func:`encode_put_values`): a
  commit's per-record Python (:func:`~hicache_l3.slab.format.encode_puts`) was a visible
  share of its cost;
* the marker records the write puts before the data, with the slots' offsets
  (:func:`write_markers`, the reference :func:`~hicache_l3.slab.format.encode_markers` of
  :func:`~hicache_l3.common.integrity.key_fingerprint` and
  :meth:`~hicache_l3.slab.format.Geometry.offsets`).

The Python functions stay the reference and the path of what C does not take (a key that
is not ASCII or holds a newline, a key or value that does not fit: the reference raises
its own error then). The library is checked against them when it loads, like the other
views of ``_batch_io`` (:class:`~hicache_l3.slab.native.LoadedOnce`).
"""

from __future__ import annotations

import array
import ctypes
import functools
import sys
from collections.abc import Sequence
from itertools import accumulate, chain, repeat
from typing import NamedTuple

from hicache_l3.common.integrity import key_fingerprint, xxh3_function
from hicache_l3.slab.format import _GROUP_SHIFT, RECORD, RECORD_BYTES, Entry, Geometry, encode_markers
from hicache_l3.slab.format import encode_puts as python_encode_puts
from hicache_l3.slab.native import LoadedOnce
from hicache_l3.slab.table import DIGEST_BYTES, DIGEST_SEED, Digests, digests, split_snapshot

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
        self.markers = lib.hl3_write_markers
        self.markers.restype = ctypes.c_long
        self.markers.argtypes = [_sz, ctypes.c_char_p, _sz, _vp, _vp, _vp, ctypes.c_uint64, *[_vp] * 4]
        self.encode_nl = lib.hl3_encode_puts_nl  # the PUT records from '\n'-ended keys
        self.encode_nl.restype = ctypes.c_long
        self.encode_nl.argtypes = [_sz, ctypes.c_char_p, _sz, _vp, _vp, _sz]
        self.digests = lib.hl3_key_digests
        self.digests.restype = ctypes.c_long
        self.digests.argtypes = [_sz, ctypes.c_char_p, _sz, _vp, ctypes.c_uint64, _vp]
        self.seeded128 = ctypes.cast(xxh3_function("seeded128"), ctypes.c_void_p).value


def _lines(keys: Sequence[str]) -> bytes | None:
    """The keys as UTF-8, each followed by a newline (what the '\n'-ended C calls take),
    or None when one cannot be encoded. (A key holding a newline makes more lines than
    keys: the C calls refuse that, -1.)"""
    try:
        return ("\n".join(keys) + "\n").encode()
    except UnicodeEncodeError:
        return None


def _native_encode_lines(lib: _Library, keys: Sequence[str], values: array.array[int]) -> bytes | None:
    """:func:`_native_encode` from the keys' lines (no per-key end offsets to build), or
    None when this call cannot encode them."""
    n, encode = len(keys), lib.encode_nl
    blob = _lines(keys)
    if blob is None or len(values) != 6 * n or values.typecode != "Q":
        return None
    cap = RECORD.size * n + len(blob) - n
    out = ctypes.create_string_buffer(cap)
    got = encode(n, blob, len(blob), values.buffer_info()[0], out, cap)
    return out.raw if got == cap else None


def _native_digests(lib: _Library, keys: Sequence[str]) -> Digests | None:
    """The keys' digests from C, with whether they are all different (None where C
    cannot hash these keys)."""
    hash_keys = lib.digests
    blob = _lines(keys)
    if blob is None:
        return None
    out = bytearray(DIGEST_BYTES * len(keys))
    code = hash_keys(len(keys), blob, len(blob), lib.seeded128, DIGEST_SEED, _address(out))
    if code not in (0, 1, 2):
        return None
    return Digests(bytes(out), distinct=(True, False, None)[code])


def key_digests(keys: Sequence[str]) -> Digests:
    """The table digests of ``keys`` (:func:`~hicache_l3.slab.table.digests`'s, same
    order) as one :class:`~hicache_l3.slab.table.Digests` buffer: one C call when it
    can (a key holding a newline, or not encodable, takes the reference). From C, its
    ``distinct`` also says whether the digests are all different (then so are the keys;
    where one repeats, the keys may or may not)."""
    if keys:
        made = _native_digests(_native.get(), keys)
        if made is not None:
            return made
    return Digests(b"".join(digests(keys)))


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
    if keys and len(keys) == len(entries):
        try:
            values = array.array("Q", chain.from_iterable(entries))
        except (OverflowError, TypeError):
            return python_encode_puts(keys, entries)
        data = _native_encode(_native.get(), keys, values)
        if data is not None:
            return data
    return python_encode_puts(keys, entries)


def encode_put_values(keys: Sequence[str], values: array.array[int]) -> bytes:
    """:func:`encode_puts` with the entries given as six values each (``array('Q')``, a
    table export's shape), as a writer's commit builds them."""
    if keys:
        lib = _native.get()
        data = _native_encode_lines(lib, keys, values)
        if data is None:
            data = _native_encode(lib, keys, values)
        if data is not None:
            return data
    return python_encode_puts(keys, split_snapshot(bytes(16 * len(keys)), values)[1])


def _key_blob(keys: Sequence[str]) -> bytes | None:
    """The keys as the C calls take them (ASCII, each followed by a newline), or None when
    one is not ASCII (a key holding a newline: the C call answers -1)."""
    try:
        return ("\n".join(keys) + "\n").encode("ascii")
    except UnicodeEncodeError:
        return None


class SetMarkers(NamedTuple):
    """What a set batch writes before its data, in the C batch's layout: ``records`` (the
    128-byte marker records back to back, checksum fields 0), ``data_offsets`` and
    ``marker_offsets`` (int64, :meth:`~hicache_l3.slab.format.Geometry.offsets`)."""

    records: bytearray
    data_offsets: array.array[int]
    marker_offsets: array.array[int]


@functools.lru_cache(maxsize=16)
def _marker_geometry(geometry: Geometry) -> array.array[int]:
    """The geometry array ``hl3_markers`` reads (never writes): built once per geometry,
    not once per set batch."""
    return array.array("q", (_GROUP_SHIFT, geometry.table, geometry.data_stride,
                             (1 << _GROUP_SHIFT) * geometry.data_stride, RECORD_BYTES))


def _native_markers(lib: _Library, keys: Sequence[str], gens: array.array[int], slots: array.array[int],
                    geometry: Geometry) -> SetMarkers | None:
    n = len(keys)
    blob = _key_blob(keys)
    if blob is None or len(gens) != n or len(slots) != n \
            or gens.typecode != "Q" or slots.typecode != "Q":
        return None
    geo = _marker_geometry(geometry)
    out = SetMarkers(bytearray(RECORD_BYTES * n), array.array("q", bytes(8 * n)),
                     array.array("q", bytes(8 * n)))
    if lib.markers(n, blob, len(blob), lib.seeded128, gens.buffer_info()[0], slots.buffer_info()[0],
                   geometry.slot_bytes, geo.buffer_info()[0], _address(out.records),
                   out.data_offsets.buffer_info()[0], out.marker_offsets.buffer_info()[0]) != 0:
        return None
    return out


def write_markers(keys: Sequence[str], gens: array.array[int], slots: array.array[int],
                  geometry: Geometry) -> SetMarkers:
    """The marker records (checksum 0) and offsets of a set batch writing ``keys[j]`` into
    slot ``slots[j]`` with generation ``gens[j]`` (both ``array('Q')``): exactly the
    reference's bytes (:func:`~hicache_l3.slab.format.encode_markers` of the keys'
    :func:`~hicache_l3.common.integrity.key_fingerprint`, and
    :meth:`~hicache_l3.slab.format.Geometry.offsets`), in one C call when it can."""
    if keys:
        made = _native_markers(_native.get(), keys, gens, slots, geometry)
        if made is not None:
            return made
    return python_write_markers(keys, gens, slots, geometry)


def python_write_markers(keys: Sequence[str], gens: Sequence[int], slots: Sequence[int],
                         geometry: Geometry) -> SetMarkers:
    """:func:`write_markers` in Python: the reference."""
    data_at, marker_at = geometry.offsets(slots)
    records = encode_markers(gens, repeat(geometry.slot_bytes), repeat(0), map(key_fingerprint, keys))
    return SetMarkers(bytearray(b"".join(records)), array.array("q", data_at), array.array("q", marker_at))


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


def _self_test(lib: _Library) -> None:
    keys = ["a", "key-é", "", "x" * 300]
    entries = [Entry(0, 1, 2, 3, 4, 5), Entry(7, 0, 9, 1 << 40, 65536, (1 << 64) - 1),
               Entry(0, 0, 0, 0, 0, 0), Entry(0xFFFFFFFE, 0xFFFFFFFF, 5, 6, 7, 8)]
    if _native_encode(lib, keys, array.array("Q", chain.from_iterable(entries))) != python_encode_puts(
            keys, entries):
        raise RuntimeError("the C record encoder disagrees with the reference")
    if _native_encode_lines(
            lib, keys, array.array("Q", chain.from_iterable(entries))) != python_encode_puts(keys, entries):
        raise RuntimeError("the C record encoder (keys as lines) disagrees with the reference")
    made = _native_digests(lib, keys)
    twice = _native_digests(lib, [*keys, keys[0]])
    if made is None or made.blob != b"".join(digests(keys)) or made.distinct is not True or (
            twice is None or twice.distinct is not False):
        raise RuntimeError("the C key digests disagree with the reference")
    ascii_keys = ["a", "", "k" * 300, "m:0123abcd"]
    geometry = Geometry(20000)
    gens, slots = array.array("Q", [1, 2, 1 << 40, 7]), array.array("Q", [0, 1, 300, 70000])
    if _native_markers(lib, ascii_keys, gens, slots, geometry) \
            != python_write_markers(ascii_keys, gens, slots, geometry):
        raise RuntimeError("the C marker records disagree with the reference")


_native = LoadedOnce(_Library, _self_test, "hicache_l3._batch_io has no usable record encoder")
