"""What every connector keeping pages in the shared slab store has in common (file,
nixl file mode, hf3fs): the storage root, the byte capacity, the store opened once the
page size is known (or found because another process created the namespace), and
``exists``/``delete``/``clear`` answered by the store's index. The connectors differ
only in how bytes move, and in :meth:`SlabBacked._make_store`.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Any, ClassVar

from hicache_l3.common.errors import ConfigError, Reason
from hicache_l3.common.keys import Namespace
from hicache_l3.common.safe_fs import private_root
from hicache_l3.common.slabs import Entry, SlabStore, read_namespace_file


class SlabBacked:
    """Mixin placed before :class:`~hicache_l3.common.connector.Connector` in the bases.

    Call :meth:`_init_slab_root` from ``__init__`` after ``Connector.__init__``.
    """

    namespace: Namespace
    page_bytes: int | None
    name: ClassVar[str]

    def _init_slab_root(self, root: str, capacity_bytes: int) -> None:
        """Create ``root`` private (0700) or check an existing one (ours, not a symlink, closed
        to other users: :func:`~hicache_l3.common.safe_fs.private_root`); capacity 0 means
        half the filesystem's free space."""
        self.root = private_root(root, f"{self.name} connector: root")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise ConfigError(f"{self.name} connector: root {self.root} is not writable")
        self.capacity_bytes = capacity_bytes or shutil.disk_usage(self.root).free // 2
        self._store: SlabStore | None = None
        self._store_lock = threading.Lock()
        if self.page_bytes is None:
            self.page_bytes = read_namespace_file(self._ns_dir()).get("slot_bytes")
        if self.page_bytes is not None:
            self._open_store(self.page_bytes)

    def _ns_dir(self) -> Path:
        return self.root / f"ns-{self.namespace.digest()}"

    def _make_store(self, slot_bytes: int) -> SlabStore:
        """Build this connector's store (override to pass engine-specific options)."""
        raise NotImplementedError

    def _open_store(self, slot_bytes: int) -> SlabStore:
        with self._store_lock:
            if self._store is None:
                self._store = self._make_store(slot_bytes)
            return self._store

    def _existing_store(self) -> SlabStore | None:
        """The store, opened now if another process created the namespace meanwhile."""
        if self._store is None:
            slot_bytes = read_namespace_file(self._ns_dir()).get("slot_bytes")
            if slot_bytes is None or self.page_bytes not in (None, slot_bytes):
                return None
            self._learn_page_bytes(slot_bytes)  # type: ignore[attr-defined]
            return self._open_store(slot_bytes)
        return self._store

    def _store_for_io(self) -> SlabStore:
        """The store for a transfer (the base class has learned the page size by now)."""
        store = self._store
        if store is None:
            assert self.page_bytes is not None
            store = self._open_store(self.page_bytes)
        return store

    def _plan_writes(self, keys: list[str]) -> tuple[SlabStore, list[Reason], list[int],
                                                    list[tuple[int, int, int, int]]]:
        """For a set: the store, one Reason per key (``NO_SPACE`` where the store is full,
        ``OK`` otherwise), the indices of the keys to write and their reserved slots."""
        store = self._store_for_io()
        reasons = [Reason.OK] * len(keys)
        planned, full = store.reserve_new(keys)
        for i in full:
            reasons[i] = Reason.NO_SPACE
        return store, reasons, [i for i, _ in planned], [slot for _, slot in planned]

    def _plan_reads(self, keys: list[str]) -> tuple[SlabStore, list[tuple[int, Entry] | None],
                                                    list[Reason]] | None:
        """For a get: the store, ``(fd, entry)`` or None per key, and one Reason per key
        (``MISS`` until read); None when the namespace has no store yet (all misses)."""
        store = self._existing_store()
        if store is None:
            return None
        return store, store.lookup(keys), [Reason.MISS] * len(keys)

    def _exists(self, keys: list[str]) -> list[Reason]:
        store = self._existing_store()
        if store is None:
            return [Reason.MISS] * len(keys)
        return [Reason.OK if hit else Reason.MISS for hit in store.contains(keys)]

    def _delete(self, keys: list[str]) -> list[Reason]:
        store = self._existing_store()
        if store is None:
            return [Reason.MISS] * len(keys)
        return [Reason.OK if hit else Reason.MISS for hit in store.delete(keys)]

    def _clear(self) -> None:
        store = self._existing_store()
        if store is not None:
            store.clear()

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()

    def _slab_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"root": str(self.root), "capacity_bytes": self.capacity_bytes}
        if self._store is not None:
            out.update(self._store.stats())
        return out
