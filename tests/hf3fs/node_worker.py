"""A process playing one node (or one process of a node) against a shared hf3fs index.

``python tests/hf3fs/node_worker.py '<json>'`` with ``{"settings", "namespace", "op",
"keys", "page_bytes", ...}``. Ops:

* ``write_read``: set ``keys`` (batches of ``batch``), create ``<barrier>/<name>``, wait
  until ``parties`` files exist there, then get ``read_keys`` and check every byte;
* ``hold``: set ``keys``, print ``READY``, then sleep until killed;
* ``read_loop``: for ``seconds``, get ``read_keys`` over and over (the list is re-read
  from ``keys_file`` each round), checking the bytes of every hit.

Prints one JSON line: ``{"set_ok", "ok", "wrong", "miss", "stats"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.suite import page_pattern


def main(spec: dict) -> dict:
    """Run one op; returns the counts."""
    pb = spec["page_bytes"]
    batch = spec.get("batch", 16)
    out = {"set_ok": 0, "set_failed": 0, "ok": 0, "wrong": 0, "miss": 0}
    with open_connector("hf3fs", spec["namespace"], spec["settings"]) as conn:
        buf = HostBuffer(batch * pb)
        conn.register(buf)
        view = buf.view()
        pages = contiguous_pages(buf.address, pb, range(batch))

        def put(keys: list[str]) -> None:
            for lo in range(0, len(keys), batch):
                chunk = keys[lo : lo + batch]
                for i, k in enumerate(chunk):
                    view[i * pb : (i + 1) * pb] = page_pattern(k, pb)
                got = conn.batch_set(chunk, pages[: len(chunk)])
                out["set_ok"] += sum(got)
                out["set_failed"] += len(got) - sum(got)

        def check(keys: list[str]) -> None:
            for lo in range(0, len(keys), batch):
                chunk = keys[lo : lo + batch]
                got = conn.batch_get(chunk, pages[: len(chunk)])
                for i, (k, ok) in enumerate(zip(chunk, got)):
                    if not ok:
                        out["miss"] += 1
                    elif view[i * pb : (i + 1) * pb] == page_pattern(k, pb):
                        out["ok"] += 1
                    else:
                        out["wrong"] += 1

        op = spec["op"]
        if op == "write_read":
            put(spec["keys"])
            barrier = Path(spec["barrier"])
            (barrier / spec["name"]).touch()
            deadline = time.monotonic() + 60
            while len(os.listdir(barrier)) < spec["parties"] and time.monotonic() < deadline:
                time.sleep(0.02)
            check(spec["read_keys"])
        elif op == "hold":
            put(spec["keys"])
            print("READY", flush=True)
            while True:
                time.sleep(1)
        elif op == "read_loop":
            deadline = time.monotonic() + spec["seconds"]
            while time.monotonic() < deadline:
                keys = Path(spec["keys_file"]).read_text().split()
                check(keys[-4 * batch :])
        out["stats"] = conn.stats()["engine"]
        out["get_failed"] = conn.stats()["ops"]["get"]["failed"]
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
