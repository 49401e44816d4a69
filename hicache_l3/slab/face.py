"""The slab store's face: the operations a connector calls on it, separating where a page
lives from moving its bytes. :class:`~hicache_l3.slab.store.SlabStore` and
:class:`~hicache_l3.slab.shared.SharedSlabStore` satisfy it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from hicache_l3.slab.format import Entry, Geometry, Located, Slot
from hicache_l3.slab.plan import GetPlan
from hicache_l3.slab.store import WritePlan

if TYPE_CHECKING:
    from hicache_l3.slab.shared import SharedSlabStore
    from hicache_l3.slab.store import SlabStore


@runtime_checkable
class PageStore(Protocol):
    """Where the pages of one namespace live. Thread-safe; metadata only: the caller moves
    the bytes. A set is :meth:`reserve_new`, the writes, :meth:`commit` (or :meth:`abort`); a
    get is :meth:`plan_get` (or :meth:`lookup`), the reads, :meth:`touch` of hits and
    :meth:`invalidate` of failed slots. Lookups, sets and deletes after :meth:`close` raise
    :class:`ValueError`."""

    @property
    def geometry(self) -> Geometry:
        """The namespace's slot layout (data area, marker record, stride)."""

    @property
    def me(self) -> int | None:
        """The writer directory this process owns (None before its first write)."""

    def reserve_new(self, keys: Sequence[str]) -> WritePlan:
        """Slots for the keys not stored yet, each key once. Keys left without a slot (full,
        or no writer directory) are in :attr:`WritePlan.full`, never an error."""

    def commit(self, keys: Sequence[str], slots: Sequence[Slot], checksums: Sequence[int],
               ds: Sequence[bytes] | None = None, lengths: Sequence[int] | None = None) -> None:
        """Publish written pages: ``keys[j]`` is in ``slots[j]`` with ``checksums[j]``
        (0: none), once their bytes are written. ``ds``: :attr:`WritePlan.digests`;
        ``lengths``: bytes per page (None: whole slots; shorter: a frame)."""

    def abort(self, slots: Iterable[Slot]) -> None:
        """Give back reserved slots that will not be committed."""

    def plan_get(self, keys: Sequence[str], verified_only: bool) -> GetPlan | None:
        """The read plan of ``keys`` (descriptors, offsets, the checks to make), or None
        where this store cannot plan: the caller uses :meth:`lookup` then."""

    def lookup(self, keys: Sequence[str]) -> list[Located | None]:
        """Per key: a descriptor and entry to read its slot from, or None for a miss. A
        slab that cannot be opened drops its keys: they miss."""

    def invalidate(self, key: str, entry: Entry) -> None:
        """Forget ``key`` if it still maps to ``entry`` (its slot failed a check)."""

    def touch(self, own: Sequence[tuple[int, int]]) -> None:
        """Mark own ``(slab, slot)`` pages recently used (eviction order)."""

    def touch_columns(self, slabs: Sequence[int], slots: Sequence[int]) -> None:
        """:meth:`touch` of own ``(slabs[j], slots[j])``."""

    def contains(self, keys: Sequence[str]) -> list[bool]:
        """One bool per key: is it stored (any process's page, seen now)?"""

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys, whichever process stored them; True where a key was there."""

    def clear(self) -> int:
        """Delete every key of the namespace known now; how many."""

    def refresh(self) -> None:
        """Pick up what other processes published (the queries above do it first)."""

    def fd(self, writer: int, slab: int, direct: bool = False) -> int:
        """A cached descriptor on a slab file (``O_DIRECT`` when ``direct``); owned by the
        store, never closed by the caller."""

    def stats(self) -> dict[str, Any]:
        """Counts for metrics (pages indexed, own slots, evictions, ...)."""

    def close(self) -> None:
        """Write what must outlive the process (an index checkpoint), release the writer
        directory and close every descriptor. Idempotent."""


if TYPE_CHECKING:  # both stores satisfy the face (checked by mypy)
    def _conforms(a: SlabStore, b: SharedSlabStore) -> tuple[PageStore, PageStore]:
        return a, b
