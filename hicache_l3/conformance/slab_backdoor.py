"""The conformance backdoor for slab-store connectors (file, nixl file mode, hf3fs): reads
the index logs and slab files directly to check and damage bytes at rest. Mix
:class:`SlabBackdoor` into a ``ConnectorTests`` subclass whose ``settings`` hold ``root``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

from hicache_l3.common.integrity import key_fingerprint
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.files import slab_file_name
from hicache_l3.slab.format import (
    DEL,
    MARKER_RECORD,
    PUT,
    RECORD_BYTES,
    Geometry,
    decode_records,
    encode_marker,
    geometry_of,
    read_namespace_file,
)
from hicache_l3.slab.frames import write_frames
from hicache_l3.slab.io import OK


def index_records(root: Path, namespace: Namespace) -> list[tuple[int, str, int, int, int, int, int]]:
    """Every record of every writer log: ``(kind, key, writer, slab, slot, gen, length)``."""
    nsdir = root / f"ns-{namespace.digest()}"
    out = []
    for log in sorted(nsdir.glob("writers/w*/index.log")):
        records, _, _ = decode_records(log.read_bytes())
        out += [(kind, key, e.writer, e.slab, e.slot, e.gen, e.length) for kind, key, e in records]
    return out


def live_entries(root: Path, namespace: Namespace) -> dict[str, tuple[int, int, int, int, int]]:
    """The index replayed as readers see it: ``key -> (writer, slab, slot, gen, length)``."""
    entries: dict[str, tuple[int, int, int, int, int]] = {}
    by_slot: dict[tuple[int, int, int], str] = {}
    deleted: dict[tuple[int, int, int], int] = {}
    for kind, key, w, slab, slot, gen, length in sorted(index_records(root, namespace), key=lambda r: r[5]):
        where = (w, slab, slot)
        if kind == PUT and deleted.get(where, 0) < gen:
            old = by_slot.get(where)
            if old is not None and entries.get(old, (None,))[:3] == where:
                del entries[old]
            prev = entries.get(key)
            if prev is not None:
                by_slot.pop(prev[:3], None)
            entries[key] = (w, slab, slot, gen, length)
            by_slot[where] = key
        elif kind == DEL:
            deleted[where] = max(deleted.get(where, 0), gen)
            if entries.get(key, (None,))[:4] == (w, slab, slot, gen):
                del entries[key]
                by_slot.pop(where, None)
    return entries


def slab_location(root: Path, namespace: Namespace, key: str) -> tuple[Path, int, int, int] | None:
    """``(slab path, data offset, stored length, marker record offset)`` of a stored page
    (a frame is shorter than the slot), or None."""
    nsdir = root / f"ns-{namespace.digest()}"
    meta = read_namespace_file(nsdir)
    where = live_entries(root, namespace).get(key)
    if not meta or where is None:
        return None
    w, slab, slot, _, length = where
    geometry = geometry_of(nsdir, meta)
    path = nsdir / "writers" / f"w{w:04d}" / slab_file_name(slab, geometry.packed)
    return path, geometry.data_offset(slot), length, geometry.marker_offset(slot)


class SlabBackdoor:
    """``backdoor_read``/``backdoor_corrupt``/``backdoor_write``/``eviction_settings`` for
    slab-store connectors."""

    page_bytes: int
    connector_name: ClassVar[str]

    def backdoor_compact(self, conn: Any) -> None:
        """Compact the connector's own index log now."""
        store = getattr(conn, "_store", None)
        if store is not None:
            store.compact()

    def backdoor_read(self, settings: dict[str, Any], namespace: Namespace, key: str) -> bytes | None:
        """The page's bytes straight from its slab."""
        where = slab_location(Path(settings["root"]), namespace, key)
        if where is None:
            return None
        path, offset, length, _ = where
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)

    def backdoor_corrupt(self, settings: dict[str, Any], namespace: Namespace, key: str,
                         how: str) -> None:
        """``flip``: one data byte inverted; ``truncate``: a rewrite cut short by a crash (a
        marker of the next generation for another key, the data's second half zeroed)."""
        where = slab_location(Path(settings["root"]), namespace, key)
        assert where is not None, f"{key} is not stored"
        path, offset, length, marker = where
        fd = os.open(path, os.O_RDWR)
        try:
            if how == "flip":
                byte = os.pread(fd, 1, offset + length // 2)
                os.pwrite(fd, bytes([byte[0] ^ 0xFF]), offset + length // 2)
            else:
                record = MARKER_RECORD.unpack(os.pread(fd, RECORD_BYTES, marker))
                gen, other = record[3] + 1, key_fingerprint(key + "-another")
                os.pwrite(fd, encode_marker(gen, length, 0, other), marker)
                os.pwrite(fd, bytes(length - length // 2), offset + length // 2)
        finally:
            os.close(fd)

    def backdoor_write(self, settings: dict[str, Any], namespace: Namespace, key: str,
                       stored: bytes) -> None:
        """``stored`` as ``key``'s page at rest, stored by another writer of the root as a
        frame is (marker record and index entry of its length, checksum over it)."""
        self.backdoor_write_many(settings, namespace, {key: stored})

    def backdoor_write_many(self, settings: dict[str, Any], namespace: Namespace,
                            stored: dict[str, bytes]) -> None:
        """:meth:`backdoor_write` of each ``key -> bytes``, by one other writer."""
        other: Any = open_connector(self.connector_name, namespace, settings)
        try:
            store = getattr(other, "inner", other)._store_for_io()  # (a faulty connector wraps one)
            keys = list(stored)
            slots = store.reserve(len(keys))
            assert len(slots) == len(keys), "no slots for the backdoor's pages"
            status, sums = write_frames(store.geometry, keys, list(stored.values()), slots, True)
            assert status == [OK] * len(keys), status
            store.commit(keys, slots, sums, lengths=[len(v) for v in stored.values()])
        finally:
            other.close()

    def eviction_settings(self, settings: dict[str, Any], capacity_pages: int) -> dict[str, Any]:
        """A capacity of ``capacity_pages`` slots."""
        return {**settings, "capacity_bytes": capacity_pages * Geometry(self.page_bytes).stride}
