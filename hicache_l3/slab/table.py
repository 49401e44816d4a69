"""The slab index's page table: 16-byte key digest -> :class:`Entry`, and its exact inverse
``(writer, slab, slot) -> digest``. :class:`PageTable` is the API; :func:`new_table` makes
:class:`NativePageTable`, the C table (``native/page_table.c``); the property tests' oracle is
``tests/reference/dict_table.py``. The digest (:func:`digest`, seeded XXH3-128) is not the
marker's key fingerprint: a digest collision then reads as a miss, never another key's bytes.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import itertools
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Protocol, overload

import xxhash

from hicache_l3.slab.format import Entry
from hicache_l3.slab.native import DIGEST_SEED, IndexCalls, address_of, library

DIGEST_BYTES = 16
xxh3_128 = xxhash.xxh3_128_digest  # (data, seed) -> 16 bytes
_make_entry = Entry._make
_new_entry = functools.partial(tuple.__new__, Entry)  # Entry from a 6-tuple, no Python frame
_SIX = struct.Struct("=6Q")  # one entry's six native uint64 values, as the C table writes them
Where = tuple[int, int, int]
# what an entry may hold (the C table's packed bucket; PageTable says why these suffice)
MAX_WRITERS = 0xFFFF  # writer + 1 fits in 16 bits
MAX_SLABS = 1 << 24
MAX_SLOTS = 1 << 24
MAX_GEN = 1 << 48
MAX_LENGTH = 0xFFFFFFFF
MAX_LENGTHS = 0xFFFF  # distinct lengths a table takes in its life (a 16-bit class each)


def digest(key: str) -> bytes:
    """The 16-byte table digest of ``key`` (seeded XXH3-128 of its UTF-8 bytes)."""
    return xxh3_128(key.encode(), DIGEST_SEED)


def digests(keys: Sequence[str]) -> list[bytes]:
    """:func:`digest` of each key."""
    h, seed = xxh3_128, DIGEST_SEED
    return [h(k.encode(), seed) for k in keys]


class Digests(Sequence[bytes]):
    """Digests held as one buffer (``blob``, 16 bytes each, as the C calls take them); reads
    and compares as the list it stands for. ``distinct``: True when known to be all
    different, False when one is known to repeat, None when not known."""

    __slots__ = ("blob", "distinct")

    def __init__(self, blob: bytes, distinct: bool | None = None) -> None:
        if len(blob) % DIGEST_BYTES:
            raise ValueError(f"Digests: {len(blob)} bytes is not a whole number of digests")
        self.blob = blob
        self.distinct = distinct

    def __len__(self) -> int:
        return len(self.blob) // DIGEST_BYTES

    @overload
    def __getitem__(self, j: int) -> bytes: ...

    @overload
    def __getitem__(self, j: slice) -> Digests: ...

    def __getitem__(self, j: int | slice) -> bytes | Digests:
        n = len(self)
        if isinstance(j, slice):
            start, stop, step = j.indices(n)
            if step == 1:
                return Digests(self.blob[DIGEST_BYTES * start : DIGEST_BYTES * max(start, stop)])
            return Digests(b"".join(self[k] for k in range(start, stop, step)))
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError("Digests index out of range")
        return self.blob[DIGEST_BYTES * j : DIGEST_BYTES * j + DIGEST_BYTES]

    def __iter__(self) -> Iterator[bytes]:
        blob = self.blob
        return (blob[i : i + DIGEST_BYTES] for i in range(0, len(blob), DIGEST_BYTES))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Digests):
            return self.blob == other.blob
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like the list it stands for

    def __repr__(self) -> str:
        return f"Digests({list(self)!r})"


def joined(ds: Sequence[bytes]) -> bytes:
    """The digests ``ds`` as one buffer: a :class:`Digests`' own, else joined."""
    return ds.blob if isinstance(ds, Digests) else b"".join(ds)


class PageTable(Protocol):
    """``digest -> Entry`` and its exact inverse ``(writer, slab, slot) -> digest``; putting a
    page supersedes the slot's page and the key's page elsewhere.

    Not thread-safe beyond single calls (callers hold the index lock). An entry must have
    writer < 65535, slab and slot < 2**24, generation < 2**48 and length < 2**32, and a
    table takes at most 65535 distinct lengths in its life: :class:`ValueError`
    otherwise, with nothing of the call applied.
    """

    def __len__(self) -> int:
        """Pages in the table."""

    @property
    def nbytes(self) -> int:
        """Bytes of memory the table holds (approximate for the dict table)."""

    def reserve(self, pages: int) -> None:
        """Make room for ``pages`` pages now (the table still grows past it; never
        shrinks). :class:`MemoryError` when that room cannot be had (the table is
        unchanged)."""

    def expect(self, pages: int) -> None:
        """The table is expected to hold at most ``pages`` pages (a capacity hint, 0:
        none): nothing is allocated now; growth lands on that capacity once it is one
        step away, so a table filled to it was sized for it."""

    def get(self, d: bytes) -> Entry | None:
        """The page of digest ``d``, or None."""

    def get_many(self, ds: Sequence[bytes]) -> list[Entry | None]:
        """:meth:`get` of each digest."""

    def contains_many(self, ds: Sequence[bytes]) -> list[bool]:
        """Whether each digest has a page."""

    def at(self, where: Where) -> bytes | None:
        """The digest whose page is in slot ``where`` (writer, slab, slot), or None."""

    def at_many(self, wheres: Sequence[Where]) -> list[bytes | None]:
        """:meth:`at` of each slot."""

    def put(self, d: bytes, entry: Entry) -> None:
        """``d``'s page is now ``entry`` (superseding the slot's page and ``d``'s former slot)."""

    def put_many(self, ds: Sequence[bytes], entries: Sequence[Entry]) -> None:
        """:meth:`put` of each pair, in order."""

    def pop(self, d: bytes) -> Entry | None:
        """Remove ``d``'s page (and its inverse); the page it had, or None."""

    def pop_many(self, ds: Sequence[bytes]) -> int:
        """:meth:`pop` of each digest; how many had a page."""

    def take_at_many(self, wheres: Sequence[Where]) -> tuple[bytes, array.array[int]]:
        """Remove the pages in slots ``wheres``; those there were, in order, shaped as an
        :meth:`export` (digests concatenated, six values each)."""

    def select(self, writer: int | None = None, slab: int | None = None) -> list[tuple[bytes, Entry]]:
        """``(digest, entry)`` of every page of ``writer`` (any when None) in ``slab`` (any
        when None), in no particular order."""

    def count(self, writer: int | None = None, slab: int | None = None) -> int:
        """How many pages :meth:`select` would return."""

    def slot_items(self) -> list[tuple[Where, bytes]]:
        """The inverse as ``(where, digest)`` pairs, in no particular order."""

    def export(self) -> tuple[bytes, array.array[int]]:
        """A snapshot of every page: the digests concatenated, and the six fields of each
        entry as a flat ``array('Q')`` (same order)."""

    def load(self, ds: bytes, values: array.array[int]) -> None:
        """:meth:`put` every page of an :meth:`export`-shaped snapshot, in order."""


_LIMITS = "writer < 65535, slab and slot < 2**24, generation < 2**48, length < 2**32"


def _snapshot_pages(ds: bytes, values: array.array[int]) -> int:
    """How many pages an :meth:`PageTable.export`-shaped snapshot holds; ValueError when
    ``ds`` and ``values`` do not match."""
    n = len(ds) // DIGEST_BYTES
    if len(ds) != n * DIGEST_BYTES or len(values) != 6 * n:
        raise ValueError(f"page table snapshot: {len(ds)} digest bytes for {len(values)} values")
    return n


def split_snapshot(ds: bytes, values: array.array[int]) -> tuple[list[bytes], list[Entry]]:
    """The digests and entries of an :meth:`PageTable.export` snapshot as lists."""
    _snapshot_pages(ds, values)
    out_d = [ds[i : i + DIGEST_BYTES] for i in range(0, len(ds), DIGEST_BYTES)]
    out_e = [_make_entry(values[i : i + 6]) for i in range(0, len(values), 6)]
    return out_d, out_e


_NOMEM, _BADVALUE, _BADIMAGE, _NOJOURNAL = -1, -2, -3, -4
_ZERO6 = bytes(48)
_ZERO_I32 = array.array("i", (0,))


def _raise(code: int) -> None:
    if code == _NOMEM:
        raise MemoryError("page table: out of memory")
    if code == _BADIMAGE:
        raise ValueError("page table image: not whole, or not one this code writes")
    if code == _NOJOURNAL:
        raise ValueError("page table: no journal to replay (never started, or a record was lost)")
    if code == _BADVALUE:
        raise ValueError(f"page table: an entry is out of range ({_LIMITS}, at most "
                         f"{MAX_LENGTHS} distinct lengths)")


class NativePageTable:
    """:class:`PageTable` in C (see the module docstring); freed when garbage collected."""

    def __init__(self, lib: IndexCalls, handle: int | None = None) -> None:
        self._lib = lib
        handle = handle or lib.new()
        if not handle:
            raise MemoryError("page table: out of memory")
        self._t: int = handle

    def __del__(self) -> None:
        t, self._t = getattr(self, "_t", 0), 0
        if t:
            self._lib.free(t)

    def __len__(self) -> int:
        return int(self._lib.len(self._t))

    @property
    def nbytes(self) -> int:
        """Bytes mapped for the table: its header and the two bucket arrays (pages not
        touched yet take no memory)."""
        return int(self._lib.nbytes(self._t))

    def reserve(self, pages: int) -> None:
        """Presize both bucket arrays for ``pages`` pages at load 0.8 (``hl3_pt_reserve``)."""
        if pages < 0 or pages >= 1 << 64:
            raise ValueError(f"page table: cannot reserve {pages} pages")
        _raise(self._lib.reserve(self._t, pages))

    def expect(self, pages: int) -> None:
        """``hl3_pt_expect``: growth within one 1.5x step of ``pages`` pages at load 0.8 goes
        to exactly that; nothing is allocated now."""
        if pages < 0 or pages >= 1 << 64:
            raise ValueError(f"page table: cannot expect {pages} pages")
        self._lib.expect(self._t, pages)

    def check(self) -> int:
        """``hl3_pt_check``: 0 when the table's invariants hold (for tests), else which failed."""
        return int(self._lib.check(self._t))

    @property
    def delta_len(self) -> int:
        """Pages held in this process's own arrays (all of them without a base)."""
        return int(self._lib.delta_len(self._t))

    @property
    def shared_nbytes(self) -> int:
        """Bytes of the base's shared read-only file mapping (0: no base)."""
        return int(self._lib.shared_nbytes(self._t))

    def attach(self, fd: int, offset: int, length: int) -> None:
        """This empty table's pages become those of the image of ``length`` bytes at
        ``offset`` (a multiple of 8) of ``fd``: a read-only shared mapping kept while the
        table lives. :class:`ValueError` (image not whole, table not empty),
        :class:`MemoryError`; the table is unchanged then."""
        if len(self):
            raise ValueError("page table: attach needs an empty table")
        _raise(self._lib.attach(self._t, fd, offset, length))

    def attach_unshared(self, fd: int, offset: int, length: int) -> None:
        """:meth:`attach` without the GIL, for a table no other thread uses yet."""
        if len(self):
            raise ValueError("page table: attach needs an empty table")
        _raise(self._lib.build_attach(self._t, fd, offset, length))

    def snapshot(self, ds: bytes = b"", values: array.array[int] | None = None) -> TableImage:
        """A copy of this table's pages (both layers) with the pages of the
        :meth:`export`-shaped ``ds``/``values`` put after them, as a :class:`TableImage`
        for another thread; here only a fork (``hl3_pt_fork``). :class:`MemoryError` (or a
        value refused)."""
        vals = values if values is not None else array.array("Q")
        n = _snapshot_pages(ds, vals)
        handle = self._lib.fork(self._t)
        if not handle:
            raise MemoryError("page table: out of memory copying the table")
        return TableImage(self._lib, NativePageTable(self._lib, handle), (ds, vals) if n else None)

    def journal_start(self) -> None:
        """Record every put and pop from now on (``hl3_pt_journal_start``), for
        :meth:`catch_up`; :class:`MemoryError`."""
        _raise(self._lib.journal_start(self._t))

    def journal_stop(self) -> None:
        """Stop recording and drop the journal."""
        self._lib.journal_stop(self._t)

    def catch_up(self, src: NativePageTable) -> None:
        """Apply the puts and pops ``src`` made since its :meth:`journal_start`, in order,
        to this table, which must hold what ``src`` held then; ``src``'s journal stops.
        :class:`ValueError` (no usable journal: this table is unchanged) or
        :class:`MemoryError` (this table is partly changed: drop it)."""
        _raise(self._lib.journal_replay(self._t, src._t))

    @property
    def journal_len(self) -> int:
        """Records in the journal (0 when none is kept)."""
        return int(self._lib.journal_len(self._t))

    def journal_take(self) -> JournalPart:
        """The journal's records so far, handed over; the journal goes on from none (a long
        catch-up applied in parts). :class:`ValueError` (no usable journal: it stops),
        :class:`MemoryError`."""
        if not self._lib.journal_has(self._t):
            raise ValueError("page table: no journal to take")
        handle = self._lib.journal_take(self._t)
        if not handle:
            if self._lib.journal_has(self._t):
                raise MemoryError("page table: out of memory taking the journal")
            raise ValueError("page table: the journal lost a record")
        return JournalPart(self._lib, handle)

    def rebase(self, fd: int, offset: int, length: int) -> None:
        """Move this table's pages onto the image at ``offset`` of ``fd`` as their base,
        without changing them (``hl3_pt_rebase``): only what differs from the image stays
        private. :class:`ValueError` (not an image), :class:`MemoryError`; unchanged then."""
        _raise(self._lib.rebase(self._t, fd, offset, length))

    def get(self, d: bytes) -> Entry | None:
        out = array.array("Q", _ZERO6)
        found = bytearray(1)
        if not self._lib.get_many(self._t, 1, d, out.buffer_info()[0], address_of(found)):
            return None
        return _make_entry(out)

    def get_many(self, ds: Sequence[bytes]) -> list[Entry | None]:
        n = len(ds)
        if not n:
            return []
        values = array.array("Q", bytes(48 * n))
        found = bytearray(n)
        hits = self._lib.get_many(self._t, n, joined(ds), values.buffer_info()[0], address_of(found))
        if not hits:
            return [None] * n
        made = map(_new_entry, _SIX.iter_unpack(values))  # C-level: no slice per entry
        if hits == n:
            return list(made)
        return [e if f else None for e, f in zip(made, found)]

    def contains_many(self, ds: Sequence[bytes]) -> list[bool]:
        n = len(ds)
        if not n:
            return []
        found = bytearray(n)
        hits = self._lib.get_many(self._t, n, joined(ds), None, address_of(found))
        if hits == 0 or hits == n:  # (a set batch's keys: all new, the common case)
            return [hits > 0] * n
        return list(map(bool, found))

    def at(self, where: Where) -> bytes | None:
        out = bytearray(DIGEST_BYTES)
        w, slab, slot = where
        if w < 0 or slab < 0 or slot < 0:
            return None
        if not self._lib.at(self._t, w, slab, slot, address_of(out)):
            return None
        return bytes(out)

    def at_many(self, wheres: Sequence[Where]) -> list[bytes | None]:
        n = len(wheres)
        if not n:
            return []
        try:
            where = array.array("Q", itertools.chain.from_iterable(wheres))
        except OverflowError:  # a negative number: no such slot
            return [self.at(w) for w in wheres]
        if len(where) != 3 * n:
            raise ValueError("page table: a slot is (writer, slab, slot)")
        ds, found = bytearray(16 * n), bytearray(n)
        self._lib.at_many(self._t, n, where.buffer_info()[0], address_of(ds), address_of(found))
        return [bytes(ds[16 * i : 16 * i + 16]) if f else None for i, f in enumerate(found)]

    def put(self, d: bytes, entry: Entry) -> None:
        self.put_many((d,), (entry,))

    def put_many(self, ds: Sequence[bytes], entries: Sequence[Entry]) -> None:
        if len(ds) != len(entries):
            raise ValueError(f"page table: {len(ds)} digests for {len(entries)} entries")
        if ds:
            self._load(joined(ds), entry_values(entries))

    def _load(self, ds: bytes, values: array.array[int]) -> None:
        _raise(self._lib.put_many(self._t, len(ds) // DIGEST_BYTES, ds, values.buffer_info()[0]))

    def pop(self, d: bytes) -> Entry | None:
        out = array.array("Q", _ZERO6)
        if not self._lib.pop(self._t, d, out.buffer_info()[0]):
            return None
        return _make_entry(out)

    def pop_many(self, ds: Sequence[bytes]) -> int:
        if not ds:
            return 0
        return int(self._lib.pop_many(self._t, len(ds), joined(ds)))

    def take_at_many(self, wheres: Sequence[Where]) -> tuple[bytes, array.array[int]]:
        n = len(wheres)
        try:
            where = array.array("Q", itertools.chain.from_iterable(wheres))
        except OverflowError:  # a negative number: no such slot
            where = None
        if not n or where is None or len(where) != 3 * n or len(set(wheres)) != n:
            return _take_at(self, wheres)  # (a slot named twice is taken once)
        buf, found = bytearray(16 * n), bytearray(n)
        hits = self._lib.at_many(self._t, n, where.buffer_info()[0], address_of(buf), address_of(found))
        ds = bytes(buf) if hits == n else b"".join(buf[16 * i : 16 * i + 16] for i in range(n) if found[i])
        values = array.array("Q", bytes(48 * hits))
        if hits:  # (the GIL is held: nothing changes between the calls)
            got = bytearray(hits)  # (held: the call writes into it)
            self._lib.get_many(self._t, hits, ds, values.buffer_info()[0], address_of(got))
            self._lib.pop_many(self._t, hits, ds)
        return ds, values

    def _select(self, writer: int | None, slab: int | None) -> tuple[bytes, array.array[int]]:
        w = -1 if writer is None else writer
        s = -1 if slab is None else slab
        while True:
            n = self._lib.select(self._t, w, s, None, None, 0)
            ds = bytearray(16 * n)
            values = array.array("Q", bytes(48 * n))
            got = self._lib.select(self._t, w, s, address_of(ds), address_of(values), n)
            if got == n:  # (the GIL is held: nothing changes between the two calls)
                return bytes(ds), values

    def select(self, writer: int | None = None, slab: int | None = None) -> list[tuple[bytes, Entry]]:
        return list(zip(*split_snapshot(*self._select(writer, slab))))

    def count(self, writer: int | None = None, slab: int | None = None) -> int:
        return int(self._lib.select(self._t, -1 if writer is None else writer,
                                    -1 if slab is None else slab, None, None, 0))

    def slot_items(self) -> list[tuple[Where, bytes]]:
        while True:
            n = self._lib.slots(self._t, None, None, 0)
            where = array.array("Q", bytes(24 * n))
            ds = bytearray(16 * n)
            if self._lib.slots(self._t, address_of(where), address_of(ds), n) == n:
                break  # (else another thread changed the table between the two calls)
        return [((where[3 * i], where[3 * i + 1], where[3 * i + 2]), bytes(ds[16 * i : 16 * i + 16]))
                for i in range(n)]

    def export(self) -> tuple[bytes, array.array[int]]:
        return self._select(None, None)

    def plan_get(self, n: int, keys: bytes, geometry: array.array[int], verified_only: bool,
                 out: Sequence[array.array[int] | bytearray]) -> tuple[int, int]:
        """``hl3_pt_plan_get`` of ``n`` keys, each followed by one ``\\n`` in ``keys``, into
        the ten output buffers ``out`` (sized by :mod:`hicache_l3.slab.plan`): (pages to
        read, distinct slabs), or (-1, 0) when ``keys`` is not ``n`` keys."""
        count = self._lib.plan_get(self._t, n, keys, len(keys), DIGEST_SEED, self._lib.seeded128,
                                   address_of(geometry), int(verified_only), *map(address_of, out))
        return int(count), int(out[-1][0])

    def plan_fds(self, where: array.array[int], slab_of: array.array[int],
                 by_slab: array.array[int]) -> array.array[int]:
        """``by_slab[slab_of[where[j]]]`` for every ``j`` of ``where`` (int32 arrays of
        :meth:`plan_get`), one C loop."""
        count = len(where)
        if not count:
            return array.array("i")
        fds = _ZERO_I32 * count  # (one allocation, filled at C level: no zero bytes copied in)
        self._lib.plan_fds(count, *map(address_of, (where, slab_of, by_slab, fds)))
        return fds

    def load(self, ds: bytes, values: array.array[int]) -> None:
        if _snapshot_pages(ds, values):
            self._load(ds, values)


class TableImage:
    """A table no other thread sees (:meth:`NativePageTable.snapshot`, or
    :func:`build_image`), for its image (:attr:`nbytes`, then :meth:`write`) or to be
    rebased (:meth:`rebase`) and then used as :attr:`table`; its calls run without the GIL,
    and only the thread that holds it may use it. A snapshot's first use makes its
    standalone copy (``hl3_pt_flatten``); a rebase needs none."""

    def __init__(self, lib: IndexCalls, table: NativePageTable,
                 put: tuple[bytes, array.array[int]] | None = None) -> None:
        self._lib, self._table, self._put = lib, table, put
        self._standalone = put is None and not table.shared_nbytes

    def prepare(self) -> NativePageTable:
        """The table as a standalone copy (no base) with the snapshot's pages put, made now
        if it is not yet (without the GIL; :class:`MemoryError`)."""
        if not self._standalone:
            t, (ds, values) = self._table, self._put or (b"", array.array("Q"))
            n = len(ds) // DIGEST_BYTES
            if t.shared_nbytes:
                handle = self._lib.build_flatten(t._t, n, ds, values.buffer_info()[0] if n else None)
                if not handle:
                    raise MemoryError("page table: out of memory (or a value refused) copying the table")
                self._table = NativePageTable(self._lib, handle)
            elif n:
                _raise(self._lib.build_put_many(t._t, n, ds, values.buffer_info()[0]))
            self._put, self._standalone = None, True
        return self._table

    @property
    def pages(self) -> int:
        """Pages in the image."""
        return len(self.prepare())

    @property
    def nbytes(self) -> int:
        """Bytes of the image (:meth:`write`)."""
        return int(self._lib.image_bytes(self.prepare()._t))

    def write(self, fd: int, offset: int) -> None:
        """Write the image at ``offset`` (a multiple of 8) of ``fd``; :class:`OSError`."""
        code = self._lib.write_image(self.prepare()._t, fd, offset)
        if code:
            raise OSError(code, os.strerror(code))

    def rebase(self, fd: int, offset: int, length: int) -> None:
        """:meth:`NativePageTable.rebase` of the table, without the GIL (a snapshot's
        pages put first; its fork is rebased as it is: no standalone copy)."""
        if self._put is not None:
            ds, values = self._put
            _raise(self._lib.build_put_many(self._table._t, len(ds) // DIGEST_BYTES, ds,
                                            values.buffer_info()[0]))
            self._put = None
        _raise(self._lib.build_rebase(self._table._t, fd, offset, length))

    def write_live_puts(self, data: bytes, expect: int, fd: int) -> tuple[int, int] | None:
        """Write to ``fd`` (at its offset), in log order, the PUT records of index log bytes
        ``data`` that this table holds, as :func:`live_put_spans` judges them: ``(records,
        bytes written)``; None where C cannot say (a snapshot with pages put, bytes that are
        not all whole good records: the caller compacts the reference way). Runs without the
        GIL on the fork as it is. :class:`OSError` from the write."""
        lib = self._lib
        if self._put is not None:
            return None
        if not data:
            return 0, 0
        found = _find_live_puts(lib.build_live_puts, lib, self._table._t, data, expect)
        if found is None:
            return None
        starts, ends, n = found
        written = lib.write_spans(fd, data, starts.buffer_info()[0], ends.buffer_info()[0], n)
        if written < 0:
            raise OSError(-written, os.strerror(-written))
        return n, int(written)

    @property
    def table(self) -> NativePageTable:
        """The table itself (a snapshot's pages put)."""
        if self._put is not None:
            return self.prepare()
        return self._table


class JournalPart:
    """Records a table's journal held (:meth:`NativePageTable.journal_take`), to apply,
    in order, to a table that holds what that table held when they began."""

    def __init__(self, lib: IndexCalls, handle: int) -> None:
        self._lib, self._j = lib, handle

    def __del__(self) -> None:
        j, self._j = getattr(self, "_j", 0), 0
        if j:
            self._lib.journal_free(j)

    def apply(self, table: NativePageTable) -> None:
        """Apply the records to ``table`` (no other thread may use it meanwhile: the call
        runs without the GIL) and free them. :class:`MemoryError` (``table`` is partly
        changed: drop it)."""
        j, self._j = self._j, 0
        if not j:
            raise ValueError("page table: journal part already applied")
        _raise(self._lib.build_journal_apply(table._t, j))


def build_image(ds: bytes, values: array.array[int], expect: int | None = None) -> TableImage:
    """The :class:`TableImage` of an :meth:`~PageTable.export`-shaped snapshot, built
    without the GIL, expecting ``expect`` pages at most as the live table does."""
    n = _snapshot_pages(ds, values)
    table = new_table(expect)
    lib = table._lib
    _raise(lib.build_reserve(table._t, n))
    if n:
        _raise(lib.build_put_many(table._t, n, ds, values.buffer_info()[0]))
    return TableImage(lib, table)


def _take_at(table: PageTable, wheres: Sequence[Where]) -> tuple[bytes, array.array[int]]:
    """:meth:`PageTable.take_at_many` through the table's single-page calls."""
    out_d, values = [], array.array("Q")
    for where in wheres:
        d = table.at(where)
        entry = table.pop(d) if d is not None else None
        if d is not None and entry is not None:
            out_d.append(d)
            values.extend(entry)
    return b"".join(out_d), values


def _find_live_puts(fn: ctypes._NamedFuncPointer, lib: IndexCalls, handle: int, data: bytes,
                    expect: int) -> tuple[array.array[int], array.array[int], int] | None:
    """``hl3_pt_live_puts`` through ``fn`` (with or without the GIL) on table ``handle``:
    the span arrays and how many spans they hold, or None (see :func:`live_put_spans`)."""
    whole = len(data) // 48 + 1  # (the shortest record is 48 bytes: always enough)
    # sized for the live pages expected; the whole bound on a second walk where more are live
    for cap in ((expect + 1, whole) if 0 <= expect < whole else (whole,)):
        starts = array.array("Q", bytes(8 * cap))
        ends = array.array("Q", bytes(8 * cap))
        n = fn(handle, data, len(data), DIGEST_SEED, lib.seeded128, starts.buffer_info()[0],
               ends.buffer_info()[0], cap)
        if n >= 0:
            return starts, ends, int(n)
    return None


def live_put_spans(table: PageTable, data: bytes, expect: int = -1) -> list[tuple[int, int]] | None:
    """The ``(start, end)`` byte spans of the PUT records in index log bytes ``data`` whose
    key's digest ``table`` maps to exactly that record's (writer, slab, slot, generation),
    found in C; None where C cannot say (no C table, or bytes that are not all whole records
    with good CRCs and ASCII keys: the caller decodes them in Python). ``expect``: how many
    the caller expects, to size the result arrays."""
    if not isinstance(table, NativePageTable) or not data:
        return None if data else []
    found = _find_live_puts(table._lib.live_puts, table._lib, table._t, data, expect)
    if found is None:
        return None
    starts, ends, n = found
    return list(zip(starts[:n], ends[:n]))


def entry_values(entries: Sequence[Entry]) -> array.array[int]:
    """The six values of each entry, flat (an :meth:`PageTable.export`'s shape); ValueError
    for a value that is negative or over 64 bits."""
    try:
        values = array.array("Q", itertools.chain.from_iterable(entries))
    except OverflowError:
        raise ValueError("page table: an entry is out of range (negative or over 64 bits)") from None
    return values


def native_library() -> IndexCalls:
    """The C page table's calls (:func:`~hicache_l3.slab.native.library`'s)."""
    return library().index


def new_table(capacity: int | None = None) -> NativePageTable:
    """An empty C table, expecting at most ``capacity`` pages when given
    (:meth:`PageTable.expect`)."""
    table = NativePageTable(native_library())
    if capacity:
        with contextlib.suppress(ValueError):  # a hint past any table: it grows as pages come
            table.expect(capacity)
    return table

