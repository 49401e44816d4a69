"""Registry install hints, metrics exposition, memory regions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hicache_l3 import open_connector
from hicache_l3.common.errors import ConfigError, EngineUnavailableError, MemoryRegistrationError, Reason
from hicache_l3.common.memory import HostBuffer, MemoryRegion, RegionTable
from hicache_l3.common.metrics import Metrics
from hicache_l3.common.registry import available_connectors, register_connector, resolve_name


def test_names_and_alias():
    assert {"file", "mooncake", "nixl", "hf3fs"} <= set(available_connectors())
    assert resolve_name("3fs") == "hf3fs"
    with pytest.raises(ConfigError, match="unknown connector 'ftp'"):
        resolve_name("ftp")


def test_missing_engine_package_gives_install_hint():
    register_connector("ghost", "hicache_l3_no_such_module.engine:Ghost", extra="ghost")
    with pytest.raises(EngineUnavailableError, match=r"pip install 'hicache-l3\[ghost\]'"):
        open_connector("ghost", {"model": "m", "kv_dtype": "f16", "layout": "page_first",
                                 "page_size": 16})


def test_import_without_engine_packages():
    code = ("import sys; sys.modules['mooncake'] = None; sys.modules['nixl'] = None; "
            "sys.modules['nixl_cu12'] = None; sys.modules['torch'] = None; import hicache_l3; "
            "from hicache_l3.connectors import file; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_config_classes_and_settings_checks_need_no_engine():
    """Every built-in connector's config class, the settings check of `sglang-args` and the
    plugin's settings translation load with mooncake, NIXL, torch and SGLang unimportable."""
    code = (
        "import sys\n"
        "for m in ('mooncake', 'mooncake.store', 'nixl', 'nixl_cu12', 'torch', 'sglang'):\n"
        "    sys.modules[m] = None\n"
        "from hicache_l3.common.registry import available_connectors, config_class\n"
        "from hicache_l3.sglang.config import AdapterConfig, extra_config_for\n"
        "from hicache_l3.sglang.takeover import takeover_extra_config\n"
        "names = ['file', 'hf3fs', 'mooncake', 'nixl']\n"
        "assert set(names) <= set(available_connectors())\n"
        "print(' '.join(config_class(n).__name__ for n in names))\n"
        "AdapterConfig.from_extra_config(extra_config_for('mooncake', {'master_address': 'h:1'}))"
        ".validate_settings()\n"
        "print(takeover_extra_config('file', {}, env={})['file']['root'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    from hicache_l3.common.safe_fs import default_root

    want = ["FileConfig Hf3fsConfig MooncakeConfig NixlConfig", str(default_root("file"))]  # per-user
    assert out.stdout.split("\n")[:2] == want, out.stdout + out.stderr


def test_bad_setting_is_named_without_the_engine():
    from hicache_l3.common.registry import config_class

    with pytest.raises(ConfigError, match="replica_num"):
        config_class("mooncake").load("mooncake", {"master_address": "h:1", "replica_num": 0})


def test_metrics_snapshot_and_prometheus():
    m = Metrics()
    m.observe("get", [Reason.OK, Reason.MISS, Reason.CORRUPT], 4096, 0.002)
    m.count("evictions", 3)
    snap = m.snapshot()
    assert snap["get"]["pages"] == 3 and snap["get"]["ok"] == 1
    assert snap["get"]["failed"] == {"corrupt": 1, "miss": 1}
    assert snap["counters"] == {"evictions": 3}
    text = m.prometheus(labels='connector="file"')
    assert 'hicache_l3_pages_failed_total{connector="file",op="get",reason="miss"} 1' in text
    assert 'hicache_l3_latency_seconds_bucket{connector="file",op="get",le="+Inf"} 1' in text
    assert 'hicache_l3_events_total{connector="file",event="evictions"} 3' in text


def test_host_buffer_is_page_aligned_and_touched():
    buf = HostBuffer(3 * 4096 + 10)
    assert buf.address % 4096 == 0 and buf.size == 3 * 4096 + 10
    view = buf.view()
    view[-1] = 7
    assert view[-1] == 7


def test_region_table_lookup_and_overlap():
    table = RegionTable()
    a, b = HostBuffer(8192), HostBuffer(8192)
    assert table.add(a) and table.add(b) and not table.add(a)
    assert table.covers(((a.address, 8192),)) and not table.covers(((a.address + 1, 8192),))
    views = table.views(((a.address + 10, 5), (b.address, 3)))
    assert views is not None and [len(v) for v in views] == [5, 3]
    with pytest.raises(MemoryRegistrationError, match="overlaps"):
        table.add(MemoryRegion(a.address + 100, 10, owner=a))
    assert table.remove(a) and table.find(a.address, 1) is None


def test_region_from_buffer_and_tensor():
    data = bytearray(100)
    region = MemoryRegion.from_buffer(data)
    assert region.size == 100
    with pytest.raises(MemoryRegistrationError):
        MemoryRegion.from_buffer(b"read-only")
    import torch  # in the test env (setup.sh pins it)
    t = torch.zeros(64, dtype=torch.float16)
    assert MemoryRegion.from_tensor(t).size == 128


def test_batch_views_cut_the_common_batch_and_refuse_the_rest():
    table = RegionTable()
    a, b = HostBuffer(8192), HostBuffer(8192)
    table.add(a)
    table.add(b)
    views = table.batch_views([((a.address, 4096),), ((a.address + 4096, 4096),)])
    assert views is not None and [len(v[0]) for v in views] == [4096, 4096]
    views[1][0][0] = 9
    assert a.view()[4096] == 9
    assert table.batch_views([((a.address, 4096),), ((b.address, 4096),)]) is None  # two regions
    assert table.batch_views([((a.address + 8000, 4096),)]) is None  # runs past the region
    assert table.batch_views([((a.address, 0), (a.address + 20, 10))]) is None  # empty segment


def test_batch_views_take_multi_segment_pages_in_one_region():
    table = RegionTable()
    a = HostBuffer(8192)
    table.add(a)
    pages = [((a.address, 1024), (a.address + 4096, 1024)),
             ((a.address + 1024, 1024), (a.address + 5120, 1024))]
    views = table.batch_views(pages)
    assert views is not None and [[len(v) for v in page] for page in views] == [[1024, 1024]] * 2
    views[1][1][0] = 7
    assert a.view()[5120] == 7
