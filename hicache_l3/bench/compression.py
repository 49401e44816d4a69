"""``hicache-l3 bench --compression``: each connector with ``compression=zstd`` against itself
with ``none``, interleaved repetition by repetition (order swapped), on random bytes or a real
model's KV: stored ratio, effective GB/s of set and get per setting, get zstd / none. Every
get is verified.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from hicache_l3.bench.link import LimitedLink
from hicache_l3.bench.runner import BenchError, balanced_ratio, fill, format_columns, page_buffer, verify
from hicache_l3.common.compression import PageCodec
from hicache_l3.common.connector import Connector
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.registry import open_connector

if TYPE_CHECKING:
    from hicache_l3.engines import S3Engine

BACKENDS = ("memory", "nixl-obj", "mooncake", "file-fsspec", "s3-fsspec", "file")
LINKED = ("nixl-obj", "s3-fsspec")  # the backends --compression-link-rate applies to


def require_s3fs() -> None:
    """Raise :class:`BenchError` naming the fix when ``s3fs`` (fsspec's ``s3://``) cannot be imported."""
    try:
        importlib.import_module("s3fs")
    except ImportError as exc:
        raise BenchError(
            f"--compression s3-fsspec needs s3fs for the file connector's s3:// root: pip install s3fs "
            f"(its aiobotocore pins botocore to a narrow range, so pip may move boto3 and botocore to "
            f"an older matching pair; or install it with --target into a separate folder and run the "
            f"bench with that folder on PYTHONPATH) ({exc})"
        ) from None


@contextlib.contextmanager
def s3_storage_options(endpoint: str, access_key: str, secret_key: str,
                       region: str = "us-east-1") -> Iterator[dict[str, Any]]:
    """fsspec's defaults for ``s3://`` (``fsspec.config.conf["s3"]``) set to reach ``endpoint``
    with these keys for the block, then put back as they were; yields the options."""
    import fsspec.config

    options: dict[str, Any] = {"endpoint_url": endpoint, "key": access_key, "secret": secret_key,
                               "client_kwargs": {"region_name": region}}
    had = "s3" in fsspec.config.conf
    before = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = options
    try:
        yield options
    finally:
        if had:
            fsspec.config.conf["s3"] = before
        else:
            fsspec.config.conf.pop("s3", None)


def check_link(backends: list[str], link_rate: float) -> None:
    """Raise :class:`BenchError` naming the option when ``link_rate`` is set for a backend
    with no S3 link to limit."""
    unlinked = sorted(set(backends) - set(LINKED)) if link_rate else []
    if unlinked:
        raise BenchError(f"--compression-link-rate limits the S3 server's link, which "
                         f"{', '.join(unlinked)} lack; pass --compression-backends {','.join(LINKED)}")


@contextlib.contextmanager
def _s3_endpoint(s3: S3Engine, link_rate: float) -> Iterator[str]:
    """The URL reaching ``s3``: its own, or a :class:`LimitedLink` of ``link_rate`` bytes/s
    in front of it."""
    if not link_rate:
        yield s3.endpoint
        return
    with LimitedLink(("127.0.0.1", s3.port), link_rate) as link:
        yield f"http://127.0.0.1:{link.port}"


@contextlib.contextmanager
def backend_settings(backend: str, store_bytes: int,
                     link_rate: float = 0) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(connector name, settings)`` of ``backend``, its engine started for the run; the S3
    backends reach their server through a link of ``link_rate`` bytes/s each way (0: no
    limit), which the others refuse."""
    check_link([backend], link_rate)
    if backend == "memory":
        yield "memory", {"store": f"bench-{uuid.uuid4().hex[:8]}"}
    elif backend == "nixl-obj":
        from hicache_l3.engines import S3Engine

        s3 = S3Engine()
        with s3, _s3_endpoint(s3, link_rate) as endpoint:
            yield "nixl", {**s3.settings, "endpoint": endpoint}
    elif backend == "s3-fsspec":
        require_s3fs()
        from hicache_l3.engines import S3Engine

        s3 = S3Engine()
        with s3, _s3_endpoint(s3, link_rate) as endpoint, \
                s3_storage_options(endpoint, s3.access_key, s3.secret_key):
            yield "file", {"root": f"s3://{s3.bucket}/bench-{uuid.uuid4().hex[:8]}"}
    elif backend == "mooncake":
        from hicache_l3.engines import MooncakeEngine

        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        with MooncakeEngine(holder=True, segment_size=f"{(3 * store_bytes >> 20) + 64} MB") as mc:
            yield "mooncake", {**mc.settings, "global_segment_size": 0}  # pages in the holder: TCP
    elif backend in ("file-fsspec", "file"):
        with tempfile.TemporaryDirectory(prefix="hicache-bench-z-") as tmp:
            root = f"file://{tmp}/fs" if backend == "file-fsspec" else f"{tmp}/slab"
            yield "file", {"root": root}
    else:
        raise BenchError(f"--compression: unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")


def fill_kv(buffer: HostBuffer, page_bytes: int, pages: int, kv: str) -> None:
    """Random bytes (``kv="random"``) or the real model's KV (``"real"``) in every page."""
    if kv == "real":
        from hicache_l3.bench.real_kv import fill_real

        fill_real(buffer.view(), page_bytes, pages)
    else:
        fill(buffer, page_bytes)


def stored_ratio(buffer: HostBuffer, page_bytes: int, pages: int, kv_dtype: str) -> float:
    """Raw bytes over stored bytes of the pages with ``compression=zstd``."""
    codec = PageCodec("zstd", kv_dtype)
    view = buffer.view()
    stored = 0
    for i in range(pages):
        frame = codec.encode([view[i * page_bytes:(i + 1) * page_bytes]])
        stored += page_bytes if frame is None else len(frame)
    return pages * page_bytes / stored


def _timed(call: Callable[[list[str], list[Any]], list[bool]], keys: list[str], pages: list[Any],
           batch: int) -> float:
    start = time.perf_counter()
    for lo in range(0, len(keys), batch):
        got = call(keys[lo:lo + batch], pages[lo:lo + batch])
        if not all(got):
            raise BenchError(f"{got.count(False)} of a batch's pages failed")
    return time.perf_counter() - start


def run_backend(backend: str, page_bytes: int, pages: int, batch: int, reps: int, kv: str,
                kv_dtype: str = "bfloat16", link_rate: float = 0) -> dict[str, Any]:
    """One backend's row: ratio, effective GB/s per setting and op, get zstd / none; through a
    link of ``link_rate`` bytes/s for the S3 backends (:func:`backend_settings`)."""
    src, src_pages = page_buffer(pages, page_bytes, name="bench-z-src")
    dst, dst_pages = page_buffer(pages, page_bytes, name="bench-z-dst")
    fill_kv(src, page_bytes, pages, kv)
    rates: dict[tuple[str, str], list[float]] = {}
    run = uuid.uuid4().hex[:8]
    with backend_settings(backend, pages * page_bytes, link_rate) as (name, settings):
        conns: dict[str, Connector[Any]] = {}
        with contextlib.ExitStack() as stack:
            for setting in ("none", "zstd"):
                ns = Namespace(model="bench/compression", kv_dtype=kv_dtype, layout="page_first",
                               page_size=64, tag=f"{run}-{setting}")
                conn = open_connector(name, ns, {**settings, "compression": setting})
                stack.callback(conn.close)
                conn.register(src)
                conn.register(dst)
                conns[setting] = conn
            for rep in range(reps):
                order = ["none", "zstd"] if rep % 2 == 0 else ["zstd", "none"]
                for setting in order:
                    conn = conns[setting]
                    keys = [f"{run}-{rep}-{i}" for i in range(pages)]
                    t_set = _timed(conn.batch_set, keys, src_pages, batch)
                    t_get = _timed(conn.batch_get, keys, dst_pages, batch)
                    verify(f"{backend} compression={setting}", src, dst, page_bytes)
                    conn.delete(keys)
                    moved = pages * page_bytes / 1e9
                    rates.setdefault((setting, "set"), []).append(moved / t_set)
                    rates.setdefault((setting, "get"), []).append(moved / t_get)
    ratio = stored_ratio(src, page_bytes, pages, kv_dtype)
    row: dict[str, Any] = {"backend": backend, "kv": kv, "page_bytes": page_bytes, "pages": pages,
                           "batch": batch, "reps": reps, "link_rate": int(link_rate),
                           "ratio": round(ratio, 3)}
    for (setting, op), values in rates.items():
        row[f"{op}_{setting}_gbps"] = round(statistics.median(values), 3)
    for op in ("set", "get"):
        per_rep = [z / n for z, n in zip(rates[("zstd", op)], rates[("none", op)])]
        row[f"{op}_zstd_over_none"] = round(balanced_ratio(per_rep), 3)
    return row


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A plain table of :func:`run_backend` rows."""
    rates = [f"{op} {setting}" for op in ("set", "get") for setting in ("none", "zstd")]
    columns = [("backend", "{}"), ("kv", "{}"), ("page", "{}"), ("link", "{}"), ("ratio", "{:.3f}"),
               *((f"{rate.replace(' ', '_')}_gbps", "{:.3f}") for rate in rates),
               ("get_zstd_over_none", "{:.2f}x"), ("set_zstd_over_none", "{:.2f}x")]
    header = ["backend", "kv", "page", "link", "ratio", *rates, "get z/n", "set z/n"]
    shown = [{**r, "page": f"{r['page_bytes'] >> 10} KiB",
              "link": f"{r['link_rate'] / 1e6:g} MB/s" if r.get("link_rate") else "-"} for r in rows]
    table = format_columns(shown, columns, header)
    return (f"{table}\n(GB/s: raw page bytes moved per second, medians; z/n: zstd over none, median over "
            "pairs of repetitions with the order swapped)")
