"""A set batch's reserved slots as columns (:class:`SlotColumns`), still a
``Sequence[Slot]``.
"""

from __future__ import annotations

import array
from collections.abc import Iterator, Sequence
from operator import attrgetter
from typing import overload

from hicache_l3.slab.format import Slot

_FD, _SLAB, _SLOT, _GEN = attrgetter("fd"), attrgetter("slab"), attrgetter("slot"), attrgetter("gen")


class SlotColumns(Sequence[Slot]):
    """Slots ``j = 0..n-1`` as four equally long arrays: ``fds`` (int32), ``slabs``,
    ``slots`` and ``gens`` (uint64); item ``j`` is ``Slot(fds[j], slabs[j], slots[j],
    gens[j])``. The arrays are the caller's, not copied: unchanged while in flight."""

    __slots__ = ("fds", "gens", "slabs", "slots")

    def __init__(self, fds: array.array[int], slabs: array.array[int], slots: array.array[int],
                 gens: array.array[int]) -> None:
        if not (len(fds) == len(slabs) == len(slots) == len(gens)) or (
                fds.typecode, slabs.typecode, slots.typecode, gens.typecode) != ("i", "Q", "Q", "Q"):
            raise ValueError("SlotColumns: columns differ in length or type")
        self.fds, self.slabs, self.slots, self.gens = fds, slabs, slots, gens

    @classmethod
    def of(cls, slots: Sequence[Slot]) -> SlotColumns:
        """``slots`` as columns: itself when it is a SlotColumns, else its four columns
        taken in C-level passes."""
        if isinstance(slots, SlotColumns):
            return slots
        return cls(array.array("i", map(_FD, slots)), array.array("Q", map(_SLAB, slots)),
                   array.array("Q", map(_SLOT, slots)), array.array("Q", map(_GEN, slots)))

    def __len__(self) -> int:
        return len(self.fds)

    @overload
    def __getitem__(self, j: int) -> Slot: ...

    @overload
    def __getitem__(self, j: slice) -> SlotColumns: ...

    def __getitem__(self, j: int | slice) -> Slot | SlotColumns:
        if isinstance(j, slice):
            return SlotColumns(self.fds[j], self.slabs[j], self.slots[j], self.gens[j])
        return Slot(self.fds[j], self.slabs[j], self.slots[j], self.gens[j])

    def __iter__(self) -> Iterator[Slot]:
        return map(Slot, self.fds, self.slabs, self.slots, self.gens)

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same slots (a list of :class:`Slot` included)."""
        if isinstance(other, SlotColumns):
            return (self.fds, self.slabs, self.slots, self.gens) == (other.fds, other.slabs, other.slots,
                                                                     other.gens)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable arrays: unhashable, like a list

    def __repr__(self) -> str:
        return f"SlotColumns({list(self)!r})"
