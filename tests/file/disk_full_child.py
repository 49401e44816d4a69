"""Fills a small filesystem through the file connector; run by test_disk_full.py inside a
private mount namespace holding a 2 MiB tmpfs at ROOT.

    disk_full_child.py ROOT

Prints one line ``REPORT {json}`` with what each step returned.
"""

from __future__ import annotations

import json
import sys

from hicache_l3 import Namespace, open_connector
from hicache_l3.conformance.pages import Pages

PAGE = 64 << 10


def main() -> int:
    root = sys.argv[1]
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="page_first", page_size=16)
    out: dict[str, object] = {}
    with open_connector("file", ns, root=root, capacity_bytes="1GiB", slab_bytes="1MiB") as conn:
        keys = [f"k{i:03d}" for i in range(64)]
        pages = Pages(conn, PAGE, len(keys))
        pages.fill(keys)
        results: list[bool] = []
        for lo in range(0, len(keys), 16):
            results += conn.batch_set(keys[lo : lo + 16], pages.pages[lo : lo + 16])
        out["set"] = results
        out["set_failed"] = conn.stats()["ops"]["set"]["failed"]
        stored = [k for k, ok in zip(keys, results) if ok]
        pages.wipe()
        got = conn.batch_get(keys, pages.pages)
        out["get_matches_set"] = got == results
        out["bytes_exact"] = all(pages.matches(i, k) for i, k in enumerate(keys) if got[i])
        # room comes back: delete what was stored, then the rest fits in the freed slots
        out["deleted"] = sum(conn.delete(stored[:8]))
        again = keys[len(stored) : len(stored) + 8]
        idx = [keys.index(k) for k in again]
        pages.fill(keys)
        out["set_after_delete"] = conn.batch_set(again, [pages.pages[i] for i in idx])
        pages.wipe()
        out["get_after_delete"] = conn.batch_get(again, [pages.pages[i] for i in idx])
        out["bytes_after_delete"] = all(pages.matches(i, keys[i]) for i in idx)
    print("REPORT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
