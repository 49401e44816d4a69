"""Recency of a writer's own slots: second-chance CLOCK over one byte per slot
(:data:`ABSENT`: not an own page; :data:`COLD`; :data:`HOT`: read since the hand passed).
With no reads, eviction order is least recently written first.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterable, Sequence

ABSENT, COLD, HOT = 0, 1, 2
_COLD, _HOT = b"\x01", b"\x02"
_TO_HOT = bytes((ABSENT, HOT, HOT)) + bytes(range(3, 256))  # own pages HOT, free slots kept
_IOTA: array.array[int] = array.array("Q")  # 0, 1, 2, ...: grown on demand (iota)


def iota(first: int, n: int) -> array.array[int]:
    """``first, first + 1, ..., first + n - 1`` as an ``array("Q")``."""
    global _IOTA
    if len(_IOTA) < first + n:
        _IOTA = array.array("Q", range(max(first + n, 2 * len(_IOTA))))
    return _IOTA[first : first + n]


def is_run(slots: Sequence[int], first: int, n: int) -> bool:
    """Whether ``slots`` is ``first, first + 1, ..., first + len(slots) - 1``."""
    if isinstance(slots, array.array) and slots.typecode == "Q":
        return n == 0 or (slots[-1] == first + n - 1 and slots == iota(first, n))
    return list(slots) == list(range(first, first + n))


def slab_spans(slabs: Sequence[int], most: int) -> list[tuple[int, int, int]] | None:
    """The column ``slabs`` as consecutive spans ``(slab, lo, count)`` in order, where
    every slab's entries are together and there are at most ``most`` spans; None otherwise."""
    n, lo = len(slabs), 0
    out: list[tuple[int, int, int]] = []
    while lo < n:
        slab = slabs[lo]
        k = slabs.count(slab)
        if len(out) == most or slabs[lo:lo + k].count(slab) != k:  # too many, or interleaved
            return None
        out.append((slab, lo, k))
        lo += k
    return out


class Clock:
    """One byte per own slot of ``slabs`` slabs of ``stride`` slots each. Not thread-safe.
    ``count``: slots holding an own page."""

    __slots__ = ("count", "hand", "state", "stride")

    def __init__(self, stride: int) -> None:
        if stride < 1:
            raise ValueError(f"clock: stride must be at least 1 slot, got {stride}")
        self.stride = stride
        self.state = bytearray()
        self.hand = 0
        self.count = 0

    def __len__(self) -> int:
        """Own pages (COLD or HOT)."""
        return self.count

    @property
    def nbytes(self) -> int:
        """Bytes of the state array (one per slot of every slab)."""
        return len(self.state)

    def grow(self, slabs: int) -> None:
        """Cover ``slabs`` slabs (never shrinks)."""
        missing = slabs * self.stride - len(self.state)
        if missing > 0:
            self.state.extend(bytes(missing))

    def index(self, slab: int, slot: int) -> int:
        """The state index of ``(slab, slot)``; ValueError for a slot outside the array."""
        if not (0 <= slot < self.stride) or slab < 0 or slab * self.stride + slot >= len(self.state):
            raise ValueError(f"clock: slot ({slab}, {slot}) outside {len(self.state)} slots "
                             f"of {self.stride} per slab")
        return slab * self.stride + slot

    def __contains__(self, where: tuple[int, int]) -> bool:
        """Whether ``(slab, slot)`` holds an own page."""
        slab, slot = where
        i = slab * self.stride + slot
        return 0 <= slot < self.stride and 0 <= i < len(self.state) and self.state[i] != ABSENT

    def add(self, wheres: Sequence[tuple[int, int]]) -> None:
        """Own pages now in these ``(slab, slot)`` slots (just written: COLD)."""
        self.add_slots([slab for slab, _ in wheres], [slot for _, slot in wheres])

    def add_slots(self, slabs: Sequence[int], slots: Sequence[int]) -> None:
        """:meth:`add` of ``(slabs[j], slots[j])`` for each ``j`` (a commit's columns)."""
        n = len(slots)
        if not n:
            return
        st = self.state
        slab0, first = slabs[0], slots[0]
        if (first >= 0 and first + n <= self.stride and slots[-1] == first + n - 1
                and slabs.count(slab0) == n and is_run(slots, first, n)):
            lo = self.index(slab0, first)  # one run in one slab: the batch of an eviction pass
            self.count += st.count(ABSENT, lo, lo + n)
            st[lo : lo + n] = _COLD * n
            return
        for slab, slot in zip(slabs, slots):
            i = self.index(slab, slot)
            if st[i] == ABSENT:
                self.count += 1
            st[i] = COLD

    def touch(self, wheres: Iterable[tuple[int, int]]) -> None:
        """Own pages just read: HOT (slots without an own page are ignored)."""
        st, stride, size = self.state, self.stride, len(self.state)
        for slab, slot in wheres:
            i = slab * stride + slot
            if 0 <= slot < stride and 0 <= i < size and st[i]:
                st[i] = HOT

    def touch_slots(self, slabs: Sequence[int], slots: Sequence[int]) -> None:
        """:meth:`touch` of ``(slabs[j], slots[j])`` for each ``j``."""
        n = len(slots)
        if not n:
            return
        first, slab = slots[0], slabs[0]
        if (first >= 0 and first + n <= self.stride and slots[-1] == first + n - 1
                and slabs.count(slab) == n and is_run(slots, first, n)):
            lo = slab * self.stride + first
            if lo >= 0 and lo + n <= len(self.state):
                self.state[lo : lo + n] = self.state[lo : lo + n].translate(_TO_HOT)
                return
        self.touch(zip(slabs, slots))

    def discard(self, slab: int, slot: int) -> bool:
        """Forget the own page of ``(slab, slot)``; True if there was one."""
        if (slab, slot) not in self:
            return False
        self.state[slab * self.stride + slot] = ABSENT
        self.count -= 1
        return True

    def evict(self, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` victims, in the hand's order, as ``(slab, slot)``; their slots become
        ABSENT (the caller reuses them). Fewer only when fewer own pages exist."""
        return [(slab, slot) for slab, first, count in self.evict_runs(n)
                for slot in range(first, first + count)]

    def evict_runs(self, n: int) -> list[tuple[int, int, int]]:
        """:meth:`evict` as runs ``(slab, first, count)`` (a run never spans two slabs)."""
        st, stride = self.state, self.stride
        size = len(st)
        out: list[tuple[int, int, int]] = []
        need = min(n, self.count)
        taken = need
        hand = self.hand if self.hand < size else 0
        wraps = 0
        while need > 0:
            i = st.find(COLD, hand)
            if i < 0:  # none ahead: every page passed gets its second chance, then wrap
                wraps += 1
                if wraps > 2:  # two wraps cool every page: count is wrong
                    raise AssertionError("clock: count says own pages exist, the array has none")
                self._cool(hand, size)
                hand = 0
                continue
            self._cool(hand, i)
            slab, first = divmod(i, stride)
            end = min(i + need, size, i - first + stride)  # within this slab
            for stop in (st.find(ABSENT, i, end), st.find(HOT, i, end)):
                if stop >= 0:
                    end = min(end, stop)
            run = end - i  # >= 1: st[i] is COLD
            st[i:end] = bytes(run)
            out.append((slab, first, run))
            need -= run
            hand = end
        self.count -= taken
        self.hand = hand
        return out

    def _cool(self, lo: int, hi: int) -> None:
        """HOT -> COLD over ``[lo, hi)`` (the hand passed them: their second chance)."""
        if hi > lo and self.state.find(HOT, lo, hi) >= 0:
            self.state[lo:hi] = self.state[lo:hi].replace(_HOT, _COLD)

    def start_past(self, pages: Sequence[tuple[int, int]]) -> None:
        """Put the hand just past the newest of ``pages`` (oldest to newest, not empty)."""
        self.hand = self.index(*pages[-1]) + 1


class Clocks:
    """Two clocks, over the even and the odd slabs, with :class:`Clock`'s
    interface: each eviction takes victims from both, in proportion to their own pages, so a
    batch's slots lie in two slab files. Not thread-safe."""

    __slots__ = ("_carry", "clocks", "stride")

    def __init__(self, stride: int) -> None:
        self.stride = stride
        self.clocks = (Clock(stride), Clock(stride))
        self._carry = 0.0

    def __len__(self) -> int:
        """Own pages (COLD or HOT) of both clocks."""
        return self.clocks[0].count + self.clocks[1].count

    @property
    def nbytes(self) -> int:
        """Bytes of the two state arrays."""
        return self.clocks[0].nbytes + self.clocks[1].nbytes

    def grow(self, slabs: int) -> None:
        """Cover ``slabs`` slabs (never shrinks)."""
        self.clocks[0].grow((slabs + 1) // 2)
        self.clocks[1].grow(slabs // 2)

    def __contains__(self, where: tuple[int, int]) -> bool:
        """Whether ``(slab, slot)`` holds an own page."""
        slab, slot = where
        return slab >= 0 and (slab // 2, slot) in self.clocks[slab % 2]

    def add(self, wheres: Sequence[tuple[int, int]]) -> None:
        """Own pages now in these ``(slab, slot)`` slots (just written: COLD)."""
        self.add_slots([slab for slab, _ in wheres], [slot for _, slot in wheres])

    def add_slots(self, slabs: Sequence[int], slots: Sequence[int]) -> None:
        """:meth:`Clock.add_slots` of ``(slabs[j], slots[j])``, each slab's in one call."""
        for clock, local, part in self._per_slab(slabs, slots):
            clock.add_slots(local, part)

    def touch(self, wheres: Iterable[tuple[int, int]]) -> None:
        """Own pages just read: HOT (slots without an own page are ignored)."""
        parts: tuple[list[tuple[int, int]], list[tuple[int, int]]] = ([], [])
        for slab, slot in wheres:
            if slab >= 0:
                parts[slab % 2].append((slab // 2, slot))
        for clock, part in zip(self.clocks, parts):
            if part:  # one call a clock, not one a page
                clock.touch(part)

    def touch_slots(self, slabs: Sequence[int], slots: Sequence[int]) -> None:
        """:meth:`Clock.touch_slots` of ``(slabs[j], slots[j])``, each slab's in one call."""
        for clock, local, part in self._per_slab(slabs, slots):
            clock.touch_slots(local, part)

    def _per_slab(self, slabs: Sequence[int], slots: Sequence[int],
                  ) -> Iterable[tuple[Clock, array.array[int], Sequence[int]]]:
        """Per slab named in ``slabs``: its clock, its local slab number column and its slots."""
        n = len(slots)
        if not n:
            return []
        spans = slab_spans(slabs, 4)
        if spans is not None:  # each slab's slots together (as reserved: the common batch)
            return [(self.clocks[slab % 2], array.array("Q", (slab // 2,)) * k,
                     slots if k == n else slots[lo:lo + k]) for slab, lo, k in spans]
        out = []
        for slab in set(slabs):
            lo, k = slabs.index(slab), slabs.count(slab)
            if slabs[lo:lo + k].count(slab) == k:  # together (as reserved: the common batch)
                part: Sequence[int] = slots[lo:lo + k]
            else:
                part = array.array("Q", itertools.compress(slots, map(slab.__eq__, slabs)))
            out.append((self.clocks[slab % 2], array.array("Q", (slab // 2,)) * k, part))
        return out

    def discard(self, slab: int, slot: int) -> bool:
        """Forget the own page of ``(slab, slot)``; True if there was one."""
        return slab >= 0 and self.clocks[slab % 2].discard(slab // 2, slot)

    def evict(self, n: int) -> list[tuple[int, int]]:
        """Up to ``n`` victims as ``(slab, slot)`` (:meth:`evict_runs`)."""
        return [(slab, slot) for slab, first, count in self.evict_runs(n)
                for slot in range(first, first + count)]

    def evict_runs(self, n: int) -> list[tuple[int, int, int]]:
        """Up to ``n`` victims as runs ``(slab, first, count)``, from both clocks in
        proportion to their own pages. Fewer only when fewer own pages exist."""
        even, odd = self.clocks
        total = even.count + odd.count
        n = min(n, total)
        if n <= 0:
            return []
        share = n * even.count / total + self._carry
        k = min(int(share), even.count)
        self._carry = share - int(share)
        k = max(k, n - odd.count)  # the odd clock has too few: the even gives the rest
        runs = [(2 * slab, first, count) for slab, first, count in even.evict_runs(k)] if k else []
        if n - k:
            runs += [(2 * slab + 1, first, count) for slab, first, count in odd.evict_runs(n - k)]
        return runs

    def start_past(self, pages: Sequence[tuple[int, int]]) -> None:
        """Put each clock's hand just past the newest of ``pages`` (oldest to newest) in its slabs."""
        done: set[int] = set()
        for slab, slot in reversed(pages):
            part = slab % 2
            if part not in done:
                done.add(part)
                self.clocks[part].start_past(((slab // 2, slot),))
                if len(done) == 2:
                    return
