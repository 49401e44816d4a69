"""A second process for the conformance suite: opens a connector and runs one op.

``python -m hicache_l3.conformance.worker '<json>'`` with ``{"name", "namespace",
"settings", "op": "set"|"get"|"exists", "keys", "page_bytes"}`` and optionally
``"registration"`` (``{"target", "config", "extra"}``: the connector is registered under
``name`` as in the parent, e.g. by a third party's conftest) and ``"path"`` (the parent's
``sys.path``, whose entries are added after this process's own). ``set`` stores
:func:`~hicache_l3.conformance.suite.page_pattern` pages; ``get`` reports per key
whether the bytes read equal the pattern; ``verify`` says per key ``"hit"``, ``"miss"``
or ``"wrong"`` (True with other bytes); prints ``{"results": [...]}`` as JSON.

Flags: ``--ready`` prints ``ready`` right before the op (a test may kill it in the op);
``--hold`` prints the results, then ``held``, and waits with the connector still open,
never closing it (a test kills it there: what a completed op left must survive a kill -9).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector, register_connector


def main(argv: list[str]) -> int:
    """Run the op described by ``argv[0]`` (JSON) and print the results."""
    from hicache_l3.conformance.suite import page_pattern

    spec = json.loads(argv[0])
    ready = "--ready" in argv[1:]  # print "ready" right before the op (a test may kill it then)
    hold = "--hold" in argv[1:]  # after the results, wait with the connector open (to be killed)
    sys.path.extend(entry for entry in spec.get("path", []) if entry not in sys.path)
    reg = spec.get("registration")
    if reg:
        register_connector(spec["name"], reg["target"], reg["extra"], config=reg["config"], clobber=True)
    keys, page_bytes = spec["keys"], spec["page_bytes"]
    with open_connector(spec["name"], spec["namespace"], spec["settings"]) as conn:
        if ready and spec["op"] != "set":
            print("ready", flush=True)
        if spec["op"] == "exists":
            results: list[bool] = conn.batch_exists(keys)
        else:
            buf = HostBuffer(max(1, len(keys)) * page_bytes)
            conn.register(buf)
            pages = contiguous_pages(buf.address, page_bytes, range(len(keys)))
            view = buf.view()
            if spec["op"] == "set":
                for i, key in enumerate(keys):
                    view[i * page_bytes : (i + 1) * page_bytes] = page_pattern(key, page_bytes)
                if ready:
                    print("ready", flush=True)
                results = conn.batch_set(keys, pages)
            else:
                got = conn.batch_get(keys, pages)
                exact = [view[i * page_bytes : (i + 1) * page_bytes] == page_pattern(k, page_bytes)
                         for i, k in enumerate(keys)]
                if spec["op"] == "verify":  # "hit", "miss" or "wrong" (True with other bytes)
                    outcomes: list[Any] = ["miss" if not ok else "hit" if same else "wrong"
                                           for ok, same in zip(got, exact)]
                    print(json.dumps({"results": outcomes}))
                    return 0
                results = [ok and same for ok, same in zip(got, exact)]
        if hold:
            print(json.dumps({"results": results}), flush=True)
            print("held", flush=True)
            while True:  # never closes: the test kills this process here
                time.sleep(3600)
    print(json.dumps({"results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
