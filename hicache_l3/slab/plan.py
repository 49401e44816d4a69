"""The plan of a get batch, built by one C call (``hl3_pt_plan_get``, ``native/get_plan.c``):
per key its verdict before any I/O (read, miss, size mismatch, unverified) and its entry; per
page to read its descriptor, data and marker offsets, the marker record it must carry and its
checksum, as the arrays the C read walks. Same semantics as the lookup path
(:meth:`SlabIndex.lookup`, then :meth:`SlabConnector._get`'s checks); tests compare both.
:func:`plan_get` returns None where no plan can be made (a table other than the C one, a key
that is not ASCII or holds a newline): the caller takes the lookup path then.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Callable, Sequence

from hicache_l3.slab.format import RECORD_BYTES, Entry, Geometry
from hicache_l3.slab.native import marker_geometry
from hicache_l3.slab.table import NativePageTable, PageTable

READ, MISS, SIZE, UNVERIFIED = 0, 1, 2, 3  # a key's verdict before I/O (page_table.c HL3_PLAN_*)


class GetPlan:
    """A planned get batch of ``n`` keys (module docstring).

    ``code[i]``: :data:`READ`, :data:`MISS`, :data:`SIZE` or :data:`UNVERIFIED` for key
    ``i``; :meth:`entry` its entry where indexed. The ``count`` pages to read, in key order:
    page ``j`` is key ``where[j]``, in descriptor ``fds[j]`` at ``data_offs[j]`` with its
    marker record at ``marker_offs[j]``, which must equal ``expect[128 j : 128 (j + 1)]``;
    ``csums[j]`` its checksum (0: none). Arrays are exactly ``count`` long. Every page
    read is ``slot_bytes`` long (0: not said). ``direct_fds[j]``: an O_DIRECT descriptor on
    page ``j``'s slab, in a plan made for O_DIRECT reads (else None)."""

    __slots__ = ("code", "count", "csums", "data_offs", "direct_fds", "expect", "fds", "marker_offs", "n",
                 "slot_bytes", "values", "where")

    def __init__(self, n: int, count: int, values: array.array[int], code: array.array[int],
                 data_offs: array.array[int], marker_offs: array.array[int], expect: bytearray,
                 csums: array.array[int], where: array.array[int], fds: array.array[int],
                 slot_bytes: int = 0, direct_fds: array.array[int] | None = None) -> None:
        self.n, self.count, self.values, self.code = n, count, values, code
        self.data_offs, self.marker_offs, self.expect = data_offs, marker_offs, expect
        self.csums, self.where, self.fds, self.slot_bytes = csums, where, fds, slot_bytes
        self.direct_fds = direct_fds

    def entry(self, i: int) -> Entry:
        """The index entry of key ``i`` (not a :data:`MISS`)."""
        return Entry._make(self.values[6 * i: 6 * i + 6])

    def own_columns(self, me: int | None) -> tuple[Sequence[int], Sequence[int]]:
        """Columns ``(slabs, slots)`` of the pages to read that writer ``me`` wrote (the LRU
        touch): strided slices of the entries, no object per page, when every key is read
        and every page is own (the common batch)."""
        values = self.values
        if me is None:
            return [], []
        if self.count == self.n and values[0::6].count(me) == self.n:
            return values[1::6], values[2::6]
        own = [6 * i for i in self.where if values[6 * i] == me]
        return [values[i + 1] for i in own], [values[i + 2] for i in own]


@functools.lru_cache(maxsize=16)
def _geometry_array(geometry: Geometry) -> array.array[int]:
    """The ``hl3_geometry`` the C plan reads (never writes): the slot size, then the marker geometry."""
    return array.array("q", (geometry.slot_bytes, *marker_geometry(geometry)))


_ZEROS: dict[str, array.array[int]] = {}


def _zeros(typecode: str, n: int) -> array.array[int]:
    """A new zeroed ``typecode`` array of ``n`` items (a slice of a zero array kept per type)."""
    zero = _ZEROS.get(typecode)
    if zero is None or len(zero) < n:
        zero = _ZEROS[typecode] = array.array(typecode, bytes(array.array(typecode).itemsize * max(n, 1024)))
    return zero[:n]


def plan_get(table: PageTable, keys: Sequence[str], geometry: Geometry, verified_only: bool,
             open_slab: Callable[[int, int], int | None],
             open_direct: Callable[[int, int], int] | None = None) -> GetPlan | None:
    """The :class:`GetPlan` of ``keys`` (valid page keys) against ``table``, or None where
    none can be made (module docstring). ``open_slab(writer, slab)`` gives a descriptor, or
    None when the slab cannot be opened (it has then dropped the slab's keys from the
    index): those keys are :data:`MISS`. With ``open_direct(writer, slab)`` (an O_DIRECT
    descriptor on a slab ``open_slab`` opened) the plan holds ``direct_fds``. Caller holds
    the index lock."""
    if not isinstance(table, NativePageTable):
        return None
    n = len(keys)
    try:
        blob = ("\n".join(keys) + "\n").encode("ascii")
    except UnicodeEncodeError:
        return None
    geo = _geometry_array(geometry)
    zq, zi, zs = _zeros("Q", 6 * n), _zeros("i", n), _zeros("q", n)  # slices of these are new arrays
    values, csums, slabs, nslabs = zq, zq[:n], zq[:2 * n], zq[:1]  # nslabs: a size_t (64-bit only)
    code, where, slab_of = zi, zi[:], zi[:]
    data_offs, marker_offs = zs, zs[:]
    expect = bytearray(RECORD_BYTES * n)
    # a key holding a newline splits into more than n: the C call then answers -1
    count, m = table.plan_get(n, blob, geo, verified_only,
                              (values, code, data_offs, marker_offs, expect, csums, where, slab_of,
                               slabs, nslabs))
    if count < 0:
        return None
    table_fds = [open_slab(slabs[2 * k], slabs[2 * k + 1]) for k in range(m)]
    if None in table_fds:  # an unreadable slab: its keys miss (open_slab dropped them)
        for i in range(n):
            if slab_of[i] >= 0 and table_fds[slab_of[i]] is None:
                code[i] = MISS
        keep = [j for j in range(count) if code[where[j]] == READ]
        data_offs = array.array("q", [data_offs[j] for j in keep])
        marker_offs = array.array("q", [marker_offs[j] for j in keep])
        expect = bytearray(b"".join(expect[RECORD_BYTES * j: RECORD_BYTES * (j + 1)] for j in keep))
        csums = array.array("Q", [csums[j] for j in keep])
        where = array.array("i", [where[j] for j in keep])
        count = len(keep)
    elif count < n:
        data_offs, marker_offs = data_offs[:count], marker_offs[:count]
        csums, where = csums[:count], where[:count]
        del expect[RECORD_BYTES * count:]
    by_slab = array.array("i", [fd if fd is not None else -1 for fd in table_fds])
    by_direct = None if open_direct is None else array.array("i", [
        -1 if fd is None else open_direct(slabs[2 * k], slabs[2 * k + 1]) for k, fd in enumerate(table_fds)])
    if m == 1:  # the common batch: one slab, one C-level repeat
        fds = by_slab * count
        direct_fds = None if by_direct is None else by_direct * count
    else:
        fds = table.plan_fds(where, slab_of, by_slab)
        direct_fds = None if by_direct is None else table.plan_fds(where, slab_of, by_direct)
    return GetPlan(n, count, values, code, data_offs, marker_offs, expect, csums, where, fds,
                   geometry.slot_bytes, direct_fds)
