"""Both slab stores satisfy the face connectors call (:class:`PageStore`)."""

from __future__ import annotations

from pathlib import Path

from hicache_l3.common.keys import Namespace
from hicache_l3.slab.face import PageStore
from hicache_l3.slab.shared import SharedSlabStore
from hicache_l3.slab.store import SlabStore

NS = Namespace(model="face-test", kv_dtype="uint8", layout="page_first", page_size=64, tag="t")


def test_both_stores_are_page_stores(tmp_path: Path) -> None:
    for cls in (SlabStore, SharedSlabStore):
        root = tmp_path / cls.__name__
        root.mkdir()
        store = cls(root, NS, 4096)
        try:
            assert isinstance(store, PageStore)
            plan = store.reserve_new(["k"])
            store.commit(["k"], plan.slots, [0])
            assert store.contains(["k", "x"]) == [True, False] and store.me is not None
        finally:
            store.close()
