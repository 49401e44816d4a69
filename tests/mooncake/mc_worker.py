"""A long-lived Mooncake client process for the engine tests (not a test module).

``python mc_worker.py '<settings json>' '<namespace json>'`` opens a Mooncake connector,
prints ``{"ready": true}``, then answers one JSON request per stdin line:
``{"op": "set"|"get"|"exists", "keys": [...], "page_bytes": N}`` ->
``{"results": [...]}``; ``get`` results are True only when the bytes equal
:func:`~hicache_l3.conformance.suite.page_pattern`. EOF closes the connector.
"""

from __future__ import annotations

import json
import sys

from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.suite import page_pattern


def main() -> int:
    """Serve requests until stdin closes."""
    settings, namespace = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    with open_connector("mooncake", namespace, settings) as conn:
        print(json.dumps({"ready": True}), flush=True)
        buffers: dict[int, HostBuffer] = {}
        for line in sys.stdin:
            req = json.loads(line)
            keys, pb = req["keys"], req.get("page_bytes", 16 << 10)
            if req["op"] == "exists":
                results = conn.batch_exists(keys)
            else:
                size = max(1, len(keys)) * pb
                if size not in buffers:
                    buffers[size] = HostBuffer(size)
                    conn.register(buffers[size])
                buf = buffers[size]
                view = buf.view()
                pages = contiguous_pages(buf.address, pb, range(len(keys)))
                if req["op"] == "set":
                    for i, k in enumerate(keys):
                        view[i * pb : (i + 1) * pb] = page_pattern(k, pb)
                    results = conn.batch_set(keys, pages)
                else:
                    view[:] = bytes(len(view))
                    got = conn.batch_get(keys, pages)
                    results = [ok and view[i * pb : (i + 1) * pb] == page_pattern(k, pb)
                               for i, (k, ok) in enumerate(zip(keys, got))]
            print(json.dumps({"results": results}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
