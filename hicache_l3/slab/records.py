"""A set batch's per-key bytes, one C call each (``native/records.c``): the keys' table
digests (:func:`key_digests`), the PUT records of the index log (:func:`encode_puts`,
:func:`encode_put_values`) and the marker records and offsets the write puts before the
data (:func:`write_markers`). What C does not take (a key that is not ASCII or holds a
newline, a value that does not fit) goes to the references in :mod:`hicache_l3.slab.format`
and :mod:`hicache_l3.slab.table`, which raise their own errors.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from itertools import chain, repeat

from hicache_l3.common.integrity import key_fingerprint
from hicache_l3.slab.format import Entry, Geometry, encode_markers
from hicache_l3.slab.format import encode_puts as python_encode_puts
from hicache_l3.slab.native import SetMarkers, library
from hicache_l3.slab.table import Digests, digests, split_snapshot

__all__ = ["SetMarkers", "encode_put_values", "encode_puts", "key_digests", "write_markers"]


def key_digests(keys: Sequence[str]) -> Digests:
    """The table digests of ``keys`` (:func:`~hicache_l3.slab.table.digests`'s, same order) as
    one :class:`~hicache_l3.slab.table.Digests`; from C, its ``distinct`` says whether they
    are all different."""
    made = library().index.key_digests(keys) if keys else None
    if made is not None:
        return Digests(*made)
    return Digests(b"".join(digests(keys)))


def encode_puts(keys: Sequence[str], entries: Sequence[Entry]) -> bytes:
    """The PUT records of ``keys[j]`` in ``entries[j]``, concatenated: exactly
    :func:`hicache_l3.slab.format.encode_puts`'s bytes (and errors)."""
    if keys and len(keys) == len(entries):
        try:
            values = array.array("Q", chain.from_iterable(entries))
        except (OverflowError, TypeError):
            return python_encode_puts(keys, entries)
        data = library().index.encode_puts(keys, values)
        if data is not None:
            return data
    return python_encode_puts(keys, entries)


def encode_put_values(keys: Sequence[str], values: array.array[int]) -> bytes:
    """:func:`encode_puts` with the entries given as six values each (``array('Q')``, a
    table export's shape)."""
    if keys:
        index = library().index
        data = index.encode_lines(keys, values)
        if data is None:
            data = index.encode_puts(keys, values)
        if data is not None:
            return data
    return python_encode_puts(keys, split_snapshot(bytes(16 * len(keys)), values)[1])


def write_markers(keys: Sequence[str], gens: array.array[int], slots: array.array[int],
                  geometry: Geometry) -> SetMarkers:
    """The marker records (checksum 0) and offsets of a set batch writing ``keys[j]`` into
    slot ``slots[j]`` with generation ``gens[j]`` (both ``array('Q')``): the bytes of
    :func:`~hicache_l3.slab.format.encode_markers` and offsets of
    :meth:`~hicache_l3.slab.format.Geometry.offsets`."""
    made = library().index.write_markers(keys, gens, slots, geometry) if keys else None
    if made is not None:
        return made
    data_at, marker_at = geometry.offsets(slots)  # keys C does not take
    records = encode_markers(gens, repeat(geometry.slot_bytes), repeat(0), map(key_fingerprint, keys))
    return SetMarkers(bytearray(b"".join(records)), array.array("q", data_at), array.array("q", marker_at))
