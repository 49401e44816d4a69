"""The page table over two dicts: the reference the C page table
(:class:`hicache_l3.slab.table.NativePageTable`) is compared with, and the table tests
put into an index to run the slab store on the reference path."""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

from hicache_l3.slab.format import Entry
from hicache_l3.slab.table import (
    _LIMITS,
    MAX_GEN,
    MAX_LENGTH,
    MAX_LENGTHS,
    MAX_SLABS,
    MAX_SLOTS,
    MAX_WRITERS,
    Where,
    _take_at,
    split_snapshot,
)


def _check(entry: Entry) -> None:
    w, slab, slot, gen, length, checksum = entry
    if not (0 <= w < MAX_WRITERS and 0 <= slab < MAX_SLABS and 0 <= slot < MAX_SLOTS
            and 0 <= gen < MAX_GEN and 0 <= length <= MAX_LENGTH and 0 <= checksum < 1 << 64):
        raise ValueError(f"page table: entry {entry} out of range ({_LIMITS})")



class DictPageTable:
    """:class:`~hicache_l3.slab.table.PageTable` over two dicts: the reference."""

    def __init__(self) -> None:
        self._pages: dict[bytes, Entry] = {}
        self._at: dict[Where, bytes] = {}
        self._lengths: set[int] = set()  # every length put (the C table's length classes)

    def __len__(self) -> int:
        return len(self._pages)

    @property
    def nbytes(self) -> int:
        """Bytes of the two dicts' own arrays (not the digests and entries they hold)."""
        return sys.getsizeof(self._pages) + sys.getsizeof(self._at)

    def reserve(self, pages: int) -> None:
        """Nothing: a dict grows by itself."""

    def expect(self, pages: int) -> None:
        """Nothing: a dict grows by itself."""

    def get(self, d: bytes) -> Entry | None:
        return self._pages.get(d)

    def get_many(self, ds: Sequence[bytes]) -> list[Entry | None]:
        get = self._pages.get
        return [get(d) for d in ds]

    def contains_many(self, ds: Sequence[bytes]) -> list[bool]:
        pages = self._pages
        return [d in pages for d in ds]

    def at(self, where: Where) -> bytes | None:
        return self._at.get(where)

    def at_many(self, wheres: Sequence[Where]) -> list[bytes | None]:
        get = self._at.get
        return [get(w) for w in wheres]

    def put(self, d: bytes, entry: Entry) -> None:
        self.put_many((d,), (entry,))

    def _put(self, d: bytes, entry: Entry) -> None:
        where = (entry[0], entry[1], entry[2])
        pages, at = self._pages, self._at
        other = at.get(where)
        if other is not None and other != d:
            del pages[other]
        old = pages.get(d)
        if old is not None and old[:3] != where:
            del at[(old[0], old[1], old[2])]
        pages[d] = entry
        at[where] = d

    def put_many(self, ds: Sequence[bytes], entries: Sequence[Entry]) -> None:
        for entry in entries:
            _check(entry)
        new = {e[4] for e in entries} - self._lengths
        if len(self._lengths) + len(new) > MAX_LENGTHS:
            raise ValueError(f"page table: an entry is out of range (over {MAX_LENGTHS} distinct lengths)")
        self._lengths |= new
        for d, entry in zip(ds, entries):
            self._put(d, entry)

    def pop(self, d: bytes) -> Entry | None:
        entry = self._pages.pop(d, None)
        if entry is not None:
            del self._at[(entry[0], entry[1], entry[2])]
        return entry

    def pop_many(self, ds: Sequence[bytes]) -> int:
        return sum(self.pop(d) is not None for d in ds)

    def take_at_many(self, wheres: Sequence[Where]) -> tuple[bytes, array.array[int]]:
        return _take_at(self, wheres)

    def select(self, writer: int | None = None, slab: int | None = None) -> list[tuple[bytes, Entry]]:
        return [(d, e) for d, e in self._pages.items()
                if (writer is None or e[0] == writer) and (slab is None or e[1] == slab)]

    def count(self, writer: int | None = None, slab: int | None = None) -> int:
        return sum(1 for e in self._pages.values()
                   if (writer is None or e[0] == writer) and (slab is None or e[1] == slab))

    def slot_items(self) -> list[tuple[Where, bytes]]:
        return list(self._at.items())

    def export(self) -> tuple[bytes, array.array[int]]:
        values = array.array("Q")
        for e in self._pages.values():
            values.extend(e)
        return b"".join(self._pages), values

    def load(self, ds: bytes, values: array.array[int]) -> None:
        self.put_many(*split_snapshot(ds, values))
