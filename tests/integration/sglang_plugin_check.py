"""The opt-in plugin inside real SGLang 0.5.23; run by tests/integration/test_sglang_plugin.py with
.venv-sglang/bin/python and the environment it sets.

    sglang_plugin_check.py SPEC_JSON

SPEC: {"expect": "takeover" | "untouched", "extra": {name: extra_config}}. Loads plugins the
way every SGLang process does (``sglang.srt.plugins.load_plugins``). With "takeover": each
built-in name in ``extra`` must build our adapter through SGLang's own
``StorageBackendFactory.create_backend(name, ...)`` (each name's own constructor call), and
pages must round-trip through the controller's zero-copy methods, the ones the attach hook
selects, between two real host pools. With "untouched": SGLang's own classes stay in place.
Prints one line ``REPORT {json}``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
import warnings
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang_roundtrip import indices, make_pools, page_bytes, storage_config  # noqa: E402

from hicache_l3.sglang import HiCacheL3Storage  # noqa: E402
from hicache_l3.sglang.plugin import TAKEOVER_CLASSES, use_zero_copy  # noqa: E402

FAILURES: list[str] = []


def check(cond: bool, what: str) -> None:
    """Record a failure and go on."""
    if not cond:
        FAILURES.append(what)


class Controller:
    """What the controller's page methods and the attach hook touch."""

    _page_get_zero_copy = HiCacheController._page_get_zero_copy
    _page_set_zero_copy = HiCacheController._page_set_zero_copy
    _generic_page_get = HiCacheController._generic_page_get
    _generic_page_set = HiCacheController._generic_page_set

    def __init__(self, host: Any, backend: Any) -> None:
        self.storage_host_pool = self.mem_pool_host = host
        self.storage_backend = backend
        self.page_size = host.page_size
        self.page_get_func = self._generic_page_get  # as SGLang sets it for the name "file"
        self.page_set_func = self._generic_page_set


class Op:
    request_id = "plugin"

    def is_terminated(self) -> bool:
        return False


def takeover(name: str, extra: dict[str, Any]) -> None:
    src, dst = make_pools("mha", "page_first", 2)
    src.kv_buffer.view(-1).view(torch.uint8).random_(0, 256)
    made = []
    for pool in (src, dst):
        backend = StorageBackendFactory.create_backend(name, storage_config(extra, mla=False), pool)
        check(type(backend).__name__ == TAKEOVER_CLASSES[name],
              f"{name}: factory built {type(backend).__name__}, not {TAKEOVER_CLASSES[name]}")
        check(isinstance(backend, HiCacheL3Storage), f"{name}: not our adapter")
        check(backend.adapter.connector == name, f"{name}: adapter opened {backend.adapter.connector}")
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        made.append(Controller(pool, backend))
    writer, reader = made
    for c in made:
        use_zero_copy(None, c)  # what the hook on attach_storage_backend runs
        check(c.page_get_func == c._page_get_zero_copy and c.page_set_func == c._page_set_zero_copy,
              f"{name}: attach hook left the copying page path")
    run = uuid.uuid4().hex[:8]
    keys = [f"{run}-{name}-{i}" for i in range(8)]
    src_pages, dst_pages = [1 + 2 * i for i in range(8)], [2 + i for i in range(8)]
    check(writer.page_set_func(keys, indices(src_pages)) is True, f"{name}: zero-copy set failed")
    got = reader.page_get_func(Op(), keys, indices(dst_pages))
    check(got == len(keys), f"{name}: zero-copy get returned {got} of {len(keys)} pages")
    for s, d in zip(src_pages, dst_pages):
        check(torch.equal(page_bytes(src, s), page_bytes(dst, d)), f"{name}: page {s} -> {d} differs")
    for c in made:
        c.storage_backend.close()


def main() -> int:
    spec = json.loads(sys.argv[1])
    ours = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hicache_l3"]
    check(len(ours) == 1 and ours[0].value == "hicache_l3.sglang.plugin:install",
          f"entry point in sglang.srt.plugins: {ours}")
    load_plugins()
    # SGLang configures logging after the plugins load: a handler attached now sees only
    # what is logged later (the start-up line must be re-logged when a backend is built)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger().addHandler(handler)
    logging.getLogger().setLevel(logging.INFO)
    registry = StorageBackendFactory._registry
    attach = HiCacheController.attach_storage_backend
    if spec["expect"] == "untouched":
        check(registry["file"]["class_name"] == "HiCacheFile", f"file -> {registry['file']}")
        check(registry["mooncake"]["module_path"].startswith("sglang."), f"mooncake: {registry['mooncake']}")
        check(not hasattr(attach, "__wrapped__"), "attach_storage_backend hooked without opting in")
    else:
        check(hasattr(attach, "__wrapped__"), "attach_storage_backend is not hooked")
        for name, extra in spec["extra"].items():
            try:
                takeover(name, extra)
            except Exception as exc:  # reported, with the rest
                FAILURES.append(f"{name}: {exc!r}")
        for name in spec["extra"]:
            check(any(f"serving SGLang's {name!r} storage backend" in r.getMessage() for r in records),
                  f"{name}: no start-up line once SGLang's logging is configured")
        segment = spec.get("mooncake_segment")
        if segment:  # SGLang splits global_segment_size across TP x PP; so do we
            (pool,) = make_pools("mha", "page_first", 1)
            b = StorageBackendFactory.create_backend(
                "mooncake", storage_config(segment["extra"], mla=False, tp_rank=1, tp_size=4), pool)
            got = b.adapter.settings.get("global_segment_size")
            check(got == segment["want"], f"mooncake: global_segment_size {got}, want {segment['want']}")
        file_dir = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
        if "file" in spec["extra"] and file_dir:
            check(any(Path(file_dir).glob("ns-*")), f"file: nothing under SGLang's file dir {file_dir}")
    print("REPORT " + json.dumps({"failures": FAILURES}))
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
