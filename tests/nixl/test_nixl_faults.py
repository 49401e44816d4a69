"""nixl connector under faults, against the real POSIX and OBJ plugins (moto_server):
bounded failures, per-key results when one page of a batch is bad, secrets kept out
of repr, errors and logs, clear config errors, the install hint."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hicache_l3.common.errors import ConfigError, EngineUnavailableError
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import open_connector
from hicache_l3.conformance.suite import Pages
from hicache_l3.engines import S3Engine, free_port
from hicache_l3.slab.format import Geometry

PAGE = 16 << 10
SECRET_ID = "AKIDSECRETVALUE1234"
SECRET_KEY = "sEcReT/kEy+9876543210zyxwvutsrq"


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model="faults/model", kv_dtype="bfloat16", layout="page_first",
                     page_size=16, tag=f"f{uuid.uuid4().hex[:10]}")


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Engine]:
    with S3Engine() as engine:
        yield engine


def _stored(conn: Any, keys: list[str]) -> Pages:
    pages = Pages(conn, PAGE, len(keys))
    pages.fill(keys)
    assert conn.batch_set(keys, pages.pages) == [True] * len(keys)
    return pages


# ---- file mode: one bad page of a batch -------------------------------------------------
def _file_conn(opened: list[Any], namespace: Namespace, root: Path) -> Any:
    stride = Geometry(PAGE).stride
    conn = open_connector("nixl", namespace, {"root": str(root), "slab_bytes": 4 * stride,
                                              "capacity_bytes": 8 * stride})
    opened.append(conn)
    return conn


def test_file_get_with_one_unreadable_slab_loads_the_others(opened: list[Any], namespace: Namespace,
                                                            tmp_path: Path) -> None:
    conn = _file_conn(opened, namespace, tmp_path)
    keys = [f"g{i}" for i in range(8)]
    pages = _stored(conn, keys)
    store = conn._store
    slab_of = {k: store.index.entry(k).slab for k in keys}
    assert set(slab_of.values()) == {0, 1}
    os.truncate(store.files.path(store.me, 1), 0)  # slab 1 vanishes under the connector
    pages.wipe()
    got = conn.batch_get(keys, pages.pages)
    assert got == [slab_of[k] == 0 for k in keys]
    for i, (key, ok) in enumerate(zip(keys, got)):
        if ok:
            assert pages.matches(i, key)
    assert conn.stats()["ops"]["get"]["failed"] == {"engine_error": 4}


def test_file_set_with_one_unwritable_slab_stores_the_others(opened: list[Any], namespace: Namespace,
                                                             tmp_path: Path) -> None:
    conn = _file_conn(opened, namespace, tmp_path)
    first = [f"a{i}" for i in range(8)]
    _stored(conn, first)
    store = conn._store
    in_slab1 = [k for k in first if store.index.entry(k).slab == 1]
    assert conn.delete(in_slab1) == [True] * len(in_slab1)  # frees slab 1's slots
    fd = store.fd(store.me, 1)
    ro = os.open(store.files.path(store.me, 1), os.O_RDONLY)
    os.dup2(ro, fd)  # the registered descriptor now refuses writes
    os.close(ro)
    keys = [f"b{i}" for i in range(8)]
    pages = Pages(conn, PAGE, 8)
    pages.fill(keys)
    got = conn.batch_set(keys, pages.pages)
    assert 0 < sum(got) < 8, got
    assert conn.batch_exists(keys) == got
    stored = [k for k, ok in zip(keys, got) if ok]
    assert all(store.index.entry(k).slab == 0 for k in stored)
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == got
    for i, (key, ok) in enumerate(zip(keys, got)):
        if ok:
            assert pages.matches(i, key)


# ---- file mode: a transfer abandoned by a timeout never hands out wrong bytes ------------
TIMEOUT_PAGES = 512  # more than the POSIX plugin's queue (64): a transfer spans several polls


class Permuted(Pages):
    """Pages taken from the buffer in an order that keeps a batch's transfer spanning
    several polls although the connector joins adjacent rows
    (:func:`~hicache_l3.connectors.nixl.base.coalesce`): ``backwards`` (key ``i`` in
    page ``n - 1 - i``: no two rows continue each other, one request per page) or
    ``pairs`` (pages 2k and 2k + 1 adjacent, the pairs backwards: the merged transfer of
    rows of two pages is the one that times out)."""

    def __init__(self, conn: Any, page_bytes: int, count: int, layout: str) -> None:
        super().__init__(conn, page_bytes, count)
        if layout == "backwards":
            self.order = list(range(count))[::-1]
        else:
            self.order = [p for k in range(count // 2 - 1, -1, -1) for p in (2 * k, 2 * k + 1)]
        base = self.pages
        self.pages = [base[i] for i in self.order]

    def fill(self, keys: list[str]) -> None:
        self.fill_at(self.order, keys)

    def matches(self, i: int, key: str) -> bool:
        return super().matches(self.order[i], key)


def _timeout_conn(opened: list[Any], namespace: Namespace, root: Path) -> Any:
    conn = open_connector("nixl", namespace, {"root": str(root), "timeout_s": 1e-6})
    opened.append(conn)
    return conn


@pytest.mark.parametrize("layout", ["backwards", "pairs"])
def test_fault_timeout_set_never_leaves_wrong_bytes(opened: list[Any], namespace: Namespace,
                                                    tmp_path: Path, layout: str) -> None:
    """A set that times out leaves its transfer in flight; the slots it may still write are
    never handed out again, and no later transfer resumes it (the agent is renewed)."""
    conn = _timeout_conn(opened, namespace, tmp_path)
    lost = [f"late{i}" for i in range(TIMEOUT_PAGES)]
    pages = Permuted(conn, PAGE, TIMEOUT_PAGES, layout)
    pages.fill(lost)
    first = conn.batch_set(lost, pages.pages)
    assert not all(first), "the tiny timeout did not expire: the test cannot see the fault"
    conn.config.timeout_s = 30.0
    keys = [f"next{i}" for i in range(TIMEOUT_PAGES)]
    pages.fill(keys)
    assert conn.batch_set(keys, pages.pages) == [True] * TIMEOUT_PAGES
    time.sleep(0.3)  # whatever the abandoned transfer had in the kernel lands by now
    reader = open_connector("nixl", namespace, {"root": str(tmp_path)})
    opened.append(reader)
    out = Permuted(reader, PAGE, TIMEOUT_PAGES, layout)
    got = reader.batch_get(keys, out.pages)
    assert got == [True] * TIMEOUT_PAGES
    wrong = [k for i, k in enumerate(keys) if not out.matches(i, k)]
    assert wrong == []
    got = reader.batch_get(lost, out.pages)
    for i, (key, ok) in enumerate(zip(lost, got)):
        assert not ok or out.matches(i, key)
    assert got == first
    assert conn.stats()["engine"]["agent_renewals"] == 1
    assert conn.stats()["engine"]["quarantined_slots"] == first.count(False)


@pytest.mark.parametrize("layout", ["backwards", "pairs"])
def test_fault_timeout_get_then_set_and_get_are_exact(opened: list[Any], namespace: Namespace,
                                                      tmp_path: Path, layout: str) -> None:
    """A get that times out does not let its transfer resume during the next calls of the
    same connector (they once returned True with the abandoned read's bytes)."""
    conn = open_connector("nixl", namespace, {"root": str(tmp_path)})
    opened.append(conn)
    old = [f"old{i}" for i in range(TIMEOUT_PAGES)]
    pages = Permuted(conn, PAGE, TIMEOUT_PAGES, layout)
    pages.fill(old)
    assert conn.batch_set(old, pages.pages) == [True] * TIMEOUT_PAGES
    conn.config.timeout_s = 1e-6
    pages.wipe()
    assert not all(conn.batch_get(old, pages.pages)), "the tiny timeout did not expire"
    conn.config.timeout_s = 30.0
    time.sleep(0.3)
    keys = [f"new{i}" for i in range(TIMEOUT_PAGES)]
    pages.fill(keys)
    assert conn.batch_set(keys, pages.pages) == [True] * TIMEOUT_PAGES
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == [True] * TIMEOUT_PAGES
    time.sleep(0.3)
    assert [k for i, k in enumerate(keys) if not pages.matches(i, k)] == []
    assert conn.stats()["engine"]["agent_renewals"] == 1


def test_file_config_errors_name_the_setting(namespace: Namespace, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="root"):
        open_connector("nixl", namespace, {"mode": "file"})
    with pytest.raises(ConfigError, match="posix_engine"):
        open_connector("nixl", namespace, {"root": str(tmp_path), "posix_engine": "gds"})
    with pytest.raises(ConfigError, match="timeout_s"):
        open_connector("nixl", namespace, {"root": str(tmp_path), "timeout_s": 0})
    with pytest.raises(ConfigError, match="bucket"):
        open_connector("nixl", namespace, {"mode": "obj"})


def test_missing_package_gives_the_install_hint(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['nixl_cu12'] = None; sys.modules['nixl'] = None\n"
        "from hicache_l3.common.registry import open_connector\n"
        "from hicache_l3.common.errors import EngineUnavailableError\n"
        "try:\n"
        f"    open_connector('nixl', dict(model='m', kv_dtype='b', layout='l', page_size=1),"
        f" {{'root': {str(tmp_path)!r}}})\n"
        "except EngineUnavailableError as exc:\n"
        "    print('HINT', exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HINT" in out.stdout, out.stderr[-2000:]
    assert "pip install 'hicache-l3[nixl]'" in out.stdout


# ---- obj mode -----------------------------------------------------------------------------
def test_obj_unreachable_endpoint_fails_fast_at_open(namespace: Namespace) -> None:
    port = free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(EngineUnavailableError, match=f"127.0.0.1:{port} unreachable"):
        open_connector("nixl", namespace, {"mode": "obj", "endpoint": f"http://127.0.0.1:{port}",
                                           "bucket": "b", "connect_timeout_s": 1.0})
    assert time.monotonic() - start < 2.0


def test_obj_silent_endpoint_fails_within_connect_timeout(namespace: Namespace) -> None:
    """A server that accepts connections and never answers: open gives up in time."""
    import boto3  # noqa: F401  (imports are not what is timed: a loaded machine takes seconds)

    import hicache_l3.connectors.nixl.obj  # noqa: F401

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    port = listener.getsockname()[1]
    try:
        start = time.monotonic()
        with pytest.raises(EngineUnavailableError, match="did not answer"):
            open_connector("nixl", namespace, {"mode": "obj", "endpoint": f"http://127.0.0.1:{port}",
                                               "bucket": "b", "connect_timeout_s": 1.0})
        assert time.monotonic() - start < 2.0
    finally:
        listener.close()


def test_obj_missing_bucket_is_a_config_error(s3: S3Engine, namespace: Namespace) -> None:
    with pytest.raises(ConfigError, match="no-such-bucket"):
        open_connector("nixl", namespace, {**s3.settings, "bucket": "no-such-bucket"})


def test_obj_secrets_stay_out_of_repr_errors_and_logs(s3: S3Engine, namespace: Namespace,
                                                      caplog: pytest.LogCaptureFixture,
                                                      capfd: pytest.CaptureFixture[str]) -> None:
    caplog.set_level("DEBUG")
    settings = {**s3.settings, "access_key": SECRET_ID, "secret_key": SECRET_KEY}
    texts = []
    conn = open_connector("nixl", namespace, settings)  # moto accepts any credentials
    try:
        texts += [repr(conn), repr(conn.config), str(conn.config.public_dict()), str(conn.stats())]
        pages = Pages(conn, PAGE, 2)
        pages.fill(["s0", "s1"])
        assert conn.batch_set(["s0", "s1"], pages.pages) == [True, True]
        assert conn.batch_get(["s0", "never"], pages.pages) == [True, False]
    finally:
        conn.close()
    for bad in ({"bucket": "no-such-bucket"}, {"endpoint": f"http://127.0.0.1:{free_port()}"},
                {"scheme": "ftp"}):
        with pytest.raises((ConfigError, EngineUnavailableError)) as err:
            open_connector("nixl", namespace, {**settings, **bad})
        texts.append(str(err.value))
    out, errs = capfd.readouterr()
    ours = [r.getMessage() for r in caplog.records if not r.name.startswith(("botocore", "urllib3"))]
    for text in [*texts, *ours, out, errs]:
        assert SECRET_ID not in text and SECRET_KEY not in text
    # botocore's own DEBUG log carries the key id in the Authorization header, never the secret
    assert SECRET_KEY not in caplog.text


def test_obj_get_with_one_missing_object_loads_the_others(s3: S3Engine, namespace: Namespace,
                                                          opened: list[Any]) -> None:
    conn = open_connector("nixl", namespace, s3.settings)
    opened.append(conn)
    keys = [f"m{i}" for i in range(6)]
    pages = _stored(conn, keys)
    client = s3.client()
    client.delete_object(Bucket=s3.bucket, Key=f"{conn.base}d/{keys[2]}")  # the page, not its record
    client.put_object(Bucket=s3.bucket, Key=f"{conn.base}d/{keys[4]}", Body=b"")  # zero-length
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == [True, True, False, True, False, True]
    for i in (0, 1, 3, 5):
        assert pages.matches(i, keys[i])
    failed = conn.stats()["ops"]["get"]["failed"]
    assert sum(failed.values()) == 2 and failed.get("miss") == 1, failed


def test_obj_without_checksum_short_objects_are_misses(s3: S3Engine, namespace: Namespace,
                                                      opened: list[Any]) -> None:
    conn = open_connector("nixl", namespace, {**s3.settings, "checksum": "none"})
    opened.append(conn)
    keys = [f"n{i}" for i in range(4)]
    pages = _stored(conn, keys)
    client = s3.client()
    client.put_object(Bucket=s3.bucket, Key=f"{conn.base}d/{keys[1]}", Body=b"")
    client.put_object(Bucket=s3.bucket, Key=f"{conn.base}d/{keys[2]}", Body=b"x" * (PAGE - 1))
    pages.wipe()
    assert conn.batch_get(keys, pages.pages) == [True, False, False, True]
    assert pages.matches(0, keys[0]) and pages.matches(3, keys[3])
    objects = client.list_objects_v2(Bucket=s3.bucket, Prefix=conn.base)["Contents"]
    assert len(objects) == 4  # one object per page, no records


def test_obj_dead_endpoint_fails_within_timeout(namespace: Namespace) -> None:
    with S3Engine() as engine:
        conn = open_connector("nixl", namespace, {**engine.settings, "timeout_s": 2.0,
                                                  "connect_timeout_s": 0.5})
        try:
            keys = ["d0", "d1", "d2"]
            pages = _stored(conn, keys)
            for proc in engine.processes:
                proc.stop()
            for op in ("get", "exists", "get", "set"):
                start = time.monotonic()
                if op == "exists":
                    got = conn.batch_exists(keys)
                elif op == "get":
                    got = conn.batch_get(keys, pages.pages)
                else:
                    got = conn.batch_set(["d3", "d4", "d5"], pages.pages)
                assert got == [False] * 3
                assert time.monotonic() - start < 4.0, op
            start = time.monotonic()
        finally:
            conn.close()
        assert time.monotonic() - start < 1.0  # close does not wait for the SDK's retries


def test_obj_three_threads_and_eviction_bound(s3: S3Engine, namespace: Namespace,
                                              opened: list[Any]) -> None:
    conn = open_connector("nixl", namespace, {**s3.settings, "capacity_bytes": 24 * PAGE})
    opened.append(conn)
    errors: list[str] = []

    def writer(t: int) -> None:
        pages = Pages(conn, PAGE, 8)
        for r in range(3):
            keys = [f"t{t}-{r}-{i}" for i in range(8)]
            pages.fill(keys)
            if conn.batch_set(keys, pages.pages) != [True] * 8:
                errors.append(f"set {t} {r}")

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors
    objects = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=conn.base + "d/").get("Contents", [])
    assert len(objects) == 24
    assert conn.stats()["engine"]["evictions"] == 72 - 24


def test_only_the_plugin_in_use_is_loaded_and_no_ucx_env(s3: S3Engine, namespace: Namespace,
                                                         tmp_path: Path, opened: list[Any]) -> None:
    before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    file_conn = open_connector("nixl", namespace, {"root": str(tmp_path)})
    obj_conn = open_connector("nixl", namespace, s3.settings)
    opened += [file_conn, obj_conn]
    assert set(file_conn.agent.agent.backends) == {"POSIX"}
    assert set(obj_conn.agent.agent.backends) == {"OBJ"}
    assert {k: v for k, v in os.environ.items() if k.startswith("UCX_")} == before


def test_obj_staging_buffer_that_failed_to_register_is_made_again(
        s3: S3Engine, namespace: Namespace, opened: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache_l3.common.memory import HostBuffer
    from hicache_l3.connectors.nixl.obj import SCRATCH_BUFFERS, STAGE_PAGES
    conn = open_connector("nixl", namespace, s3.settings)
    opened.append(conn)
    pages = Pages(conn, PAGE, 2)
    halves = [[(a, n // 2), (a + n // 2, n // 2)] for (a, n), in pages.pages]  # staged: two segments
    pages.fill(["h0", "h1"])

    def refuse(region: Any) -> None:
        raise RuntimeError("registration refused")

    with monkeypatch.context() as patch:
        patch.setattr(conn.agent, "register_dram", refuse)
        for attempt in range(SCRATCH_BUFFERS):  # each would keep a count without the fix
            assert conn.batch_set([f"h{attempt}-x"], halves[:1]) == [False]
    done: list[list[bool]] = []
    setter = threading.Thread(target=lambda: done.append(conn.batch_set(["h0", "h1"], halves)), daemon=True)
    setter.start()
    setter.join(timeout=60)
    if not done:  # let the stuck set go (an unregistered buffer: it fails), so teardown does not hang
        conn._stages.put(HostBuffer(STAGE_PAGES * PAGE))
        setter.join(timeout=60)
    assert done == [[True, True]], "a set waited for a staging buffer that was never made"
    pages.wipe()
    assert conn.batch_get(["h0", "h1"], halves) == [True, True]
    assert pages.matches(0, "h0") and pages.matches(1, "h1")
