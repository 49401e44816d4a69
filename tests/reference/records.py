"""The Python spelling of a set batch's marker records and offsets: the oracle the C
``hl3_write_markers`` (``IndexCalls.write_markers``) is compared with."""

from __future__ import annotations

import array
from collections.abc import Sequence
from itertools import repeat

from hicache_l3.common.integrity import key_fingerprint
from hicache_l3.slab.format import Geometry, encode_markers
from hicache_l3.slab.native import SetMarkers


def python_write_markers(keys: Sequence[str], gens: Sequence[int], slots: Sequence[int],
                         geometry: Geometry) -> SetMarkers:
    """:func:`hicache_l3.slab.records.write_markers` in Python."""
    data_at, marker_at = geometry.offsets(slots)
    records = encode_markers(gens, repeat(geometry.slot_bytes), repeat(0), map(key_fingerprint, keys))
    return SetMarkers(bytearray(b"".join(records)), array.array("q", data_at), array.array("q", marker_at))
