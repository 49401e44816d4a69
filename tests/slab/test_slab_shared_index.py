"""Several processes of one namespace share the index's checkpoint:
each maps the same table image read-only (one copy per node), keeps only what changed
since in a private delta, agrees with a full log replay, and moves onto a newer
checkpoint that another process wrote without changing what it answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hicache_l3.slab import checkpoint
from tests.slab.test_slab_checkpoint import close_index, filled, fresh_indexes, key, open_store

CHILD = r"""
import json, sys
from pathlib import Path
from hicache_l3.slab.table import NativePageTable
from tests.slab.test_slab_checkpoint import open_store

store = open_store(Path(sys.argv[1]))
def answer():
    store.refresh()
    index = store.index
    mapped = [line.split()[4] for line in open("/proc/self/maps") if line.rstrip().endswith("index.ckpt")
              or "index.ckpt (deleted)" in line]
    assert isinstance(index.table, NativePageTable)
    print(json.dumps({"pages": sorted([d.hex(), list(e)] for d, e in index.table.select()),
                      "inodes": sorted(set(map(int, mapped))), "shared": index.table.shared_nbytes,
                      "delta": index.table.delta_len, "rebases": index.checkpoints.rebases}), flush=True)
answer()
for line in sys.stdin:
    if line.strip() == "rebase":
        with store._lock:
            store.index.checkpoints.rebase_on_newer()
    answer()
store.close()
"""


def _oracle_pages(store) -> list:
    oracle, candidate = fresh_indexes(store)
    try:
        return sorted([d.hex(), list(e)] for d, e in oracle.table.select())
    finally:
        close_index(oracle)
        close_index(candidate)


def test_processes_map_one_checkpoint_and_agree(tmp_path: Path) -> None:
    writer = filled(tmp_path)  # 20 pages, checkpointed (version 3: a table image)
    children = []
    try:
        keys = [key(0, i) for i in range(20, 26)]  # a tail after the checkpoint
        plan = writer.reserve_new(keys)
        writer.commit(keys, plan.slots, [4] * len(keys))
        writer.delete([key(0, 0)])
        ckpt = writer.directory / checkpoint.CHECKPOINT_FILE
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
        for _ in range(3):
            children.append(subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        answers = [json.loads(c.stdout.readline()) for c in children]
        expected = _oracle_pages(writer)
        for a in answers:
            assert a["pages"] == expected
            assert a["inodes"] == [ckpt.stat().st_ino]  # the same file, mapped by each
            assert a["shared"] > 0 and a["delta"] == 6  # the tail's pages only, privately
        # another process writes a newer checkpoint: each moves onto it, answers unchanged
        with writer._lock:
            assert writer.index.checkpoints.save()
        for c in children:
            c.stdin.write("rebase\n")
            c.stdin.flush()
        answers = [json.loads(c.stdout.readline()) for c in children]
        for a in answers:
            assert a["pages"] == expected and a["rebases"] == 1
            assert a["inodes"] == [ckpt.stat().st_ino] and a["delta"] == 0
        # the writer goes on; the readers follow the log over their new base
        plan = writer.reserve_new([key(0, 30)])
        writer.commit([key(0, 30)], plan.slots, [5])
        writer.delete([key(0, 1)])
        for c in children:
            c.stdin.write("view\n")
            c.stdin.flush()
        expected = _oracle_pages(writer)
        for a in [json.loads(c.stdout.readline()) for c in children]:
            assert a["pages"] == expected and a["delta"] == 1
    finally:
        for c in children:
            c.stdin.close()
            c.wait(30)
        writer.close()


def test_a_reader_whose_delta_grew_moves_onto_a_newer_checkpoint_off_the_lock(
        tmp_path: Path, monkeypatch) -> None:
    """A reader's delta past its bound: the next refresh exports the table and journals
    its changes, a thread rebases a copy on the newest checkpoint, a later refresh
    catches it up and adopts it; what the reader answers never changes."""
    from hicache_l3.slab import index_checkpoint

    monkeypatch.setattr(index_checkpoint, "CHECKPOINT_MIN_RECORDS", 8)
    monkeypatch.setattr(index_checkpoint, "REBASE_CHECK_S", 0.0)
    writer = filled(tmp_path)  # 20 pages, checkpointed
    reader = open_store(tmp_path)
    try:
        reader.refresh()
        assert reader.index.table.delta_len == 0 and reader.index.checkpoints.base_id is not None
        keys = [key(0, i) for i in range(20, 40)]
        plan = writer.reserve_new(keys)
        writer.commit(keys, plan.slots, [4] * len(keys))
        with writer._lock:
            assert writer.index.checkpoints.save()
        plan = writer.reserve_new([key(0, 50)])
        writer.commit([key(0, 50)], plan.slots, [4])
        reader.refresh()  # reads the 21 records: the delta is big, a rebase starts
        assert reader.index.table.delta_len == 21
        more = [key(0, i) for i in range(60, 63)]  # records while the rebase runs
        plan = writer.reserve_new(more)
        writer.commit(more, plan.slots, [4] * 3)
        reader.refresh()
        reader.index.checkpoints.wait()
        reader.refresh()  # adopts it
        assert reader.index.checkpoints.rebases == 1
        assert reader.index.table.delta_len == 4  # what came after the newest checkpoint
        assert sorted([d.hex(), list(e)] for d, e in reader.index.table.select()) == _oracle_pages(writer)
    finally:
        reader.close()
        writer.close()
