"""``hicache-l3 bench --scale``: how the file connector's costs grow with the store size.

Per store size N: one process fills a fresh store with N pages (capacity ``N + S`` slots,
``S`` = :func:`sample_size`); fresh subprocesses open it and report memory growth and open
time; the filling process then times ``exists``, ``get`` (first and warm, each beside a raw
``os.preadv`` contender batch for batch), ``set`` to capacity and the evicting ``set``.
``--scale-index-only`` writes each store as one log over sparse slabs and measures only
open, memory and ``exists``. Every op must succeed for every key (else :class:`BenchError`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hicache_l3.bench.runner import BenchError, format_columns, print_results, progress, quantile
from hicache_l3.bench.targets import bench_namespace
from hicache_l3.common.errors import ConfigError, HiCacheL3Error
from hicache_l3.common.keys import Namespace
from hicache_l3.common.memory import HostBuffer
from hicache_l3.common.pages import contiguous_pages
from hicache_l3.common.registry import open_connector
from hicache_l3.slab.format import RECORD, Geometry

BATCH = 128  # pages per timed batch call (SGLang's prefetch batch)
FILL_BATCH = 4096  # pages per batch call while filling
MAX_SAMPLE = 16384  # keys per timed measure, at most
OPENS = 3  # fresh processes that open each store
PROCS_PER_NODE = 8  # processes sharing one namespace on a node, for index_node_bytes_per_page
LOG_SLACK = 2 * RECORD.size + 64  # disk per page for its index log record(s), generously
SETTLE_TIMEOUT = 600.0  # seconds the fill's last index checkpoint may take
EXISTS_SECONDS = 0.5  # exists is timed over passes of its sample for at least this long
MAX_PASSES = 1000  # a bound on the passes of a measure whose batches take ~no time
MEASURES = ("index_rss_bytes_per_page", "index_shared_bytes_per_page", "index_node_bytes_per_page",
            "open_s", "open_full_replay_s", "exists_keys_per_s", "get_pages_per_s", "get_warm_pages_per_s",
            "set_pages_per_s", "evict_set_pages_per_s")
RAW_MEASURES = {"get_pages_per_s": "raw_get_pages_per_s",  # plotted with the connector's
                "get_warm_pages_per_s": "raw_get_warm_pages_per_s"}
INDEX_ONLY_MEASURES = MEASURES[:6]  # --scale-index-only: no page bytes to get or set


def parse_counts(text: str) -> list[int]:
    """Store sizes from ``"1e4,1e5"`` or ``"10000,100000"``: positive whole numbers."""
    out = []
    for item in (v.strip() for v in text.split(",")):
        if not item:
            continue
        try:
            value = float(item)
        except ValueError:
            raise ConfigError(f"--scale-sizes: {item!r} is not a number (e.g. 1e4,1e5)") from None
        if value != int(value) or value < 1:
            raise ConfigError(f"--scale-sizes: {item!r} is not a positive whole number of pages")
        out.append(int(value))
    if not out:
        raise ConfigError("--scale-sizes: give at least one store size, e.g. 1e4,1e5")
    return out


def scale_namespace(page_bytes: int) -> Namespace:
    """The namespace the sweep's pages are stored in."""
    return bench_namespace(page_bytes, "bench-scale")


def sample_size(pages: int) -> int:
    """S: keys per timed measure for a store of ``pages`` (whole batches of :data:`BATCH`)."""
    return -(-min(pages, MAX_SAMPLE) // BATCH) * BATCH


def disk_needed(pages: int, page_bytes: int, index_only: bool = False) -> int:
    """Bytes of disk a store of ``pages`` needs, the sweep's extra sets included (with
    ``index_only``: its log and index checkpoint, the slabs being sparse)."""
    if index_only:
        return pages * 2 * LOG_SLACK
    slots = pages + sample_size(pages)
    return slots * (Geometry(page_bytes).stride + LOG_SLACK)


def check_disk(workdir: Path, sizes: list[int], page_bytes: int, index_only: bool = False) -> None:
    """Refuse (ConfigError) when ``workdir``'s filesystem cannot hold the largest store."""
    need = disk_needed(max(sizes), page_bytes, index_only)
    free = shutil.disk_usage(workdir).free
    if free < need:
        raise ConfigError(
            f"--scale-sizes {max(sizes):,} pages of {page_bytes} bytes need {need / 2**30:.1f} GiB "
            f"free in {workdir}, only {free / 2**30:.1f} GiB is: lower --scale-sizes or "
            "--scale-page-bytes, or point --workdir at a bigger disk")


def key(i: int) -> str:
    """The key of page ``i`` of the sweep."""
    return f"scale{i:011d}"


def run_sweep(sizes: list[int], page_bytes: int, workdir: Path, settings: dict[str, Any],
              progress: bool = True, index_only: bool = False) -> list[dict[str, Any]]:
    """One result row per store size (see the module docstring); stores are removed after."""
    if "root" in settings or "capacity_bytes" in settings:
        raise ConfigError("--scale: file.root and file.capacity_bytes are set by the sweep; "
                          "use --workdir to choose the disk")
    check_disk(workdir, sizes, page_bytes, index_only)
    rows = []
    for n in sizes:
        root = Path(tempfile.mkdtemp(prefix=f"scale-{n}-", dir=workdir))
        try:
            measure = _measure_index_only if index_only else _measure_size
            rows.append(measure(n, page_bytes, root, settings, progress))
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def write_index_only_store(store: Path, n: int, page_bytes: int) -> None:
    """A store whose one writer's log publishes ``n`` pages (keys :func:`key`) in sparse
    slab files: enough to open it and answer ``exists``."""
    from hicache_l3.slab.files import make_dir, open_file, slab_file_name
    from hicache_l3.slab.format import PUT, Entry, encode_record, namespace_dir, write_namespace_file

    namespace = scale_namespace(page_bytes)
    directory = namespace_dir(store, namespace)
    make_dir(store, exist_ok=True)
    geometry = write_namespace_file(directory, namespace, page_bytes)
    wdir = directory / "writers" / "w0000"
    make_dir(directory / "writers", exist_ok=True)
    make_dir(wdir, exist_ok=True)
    per_slab = max(1, (256 << 20) // geometry.stride)
    fd = open_file(wdir / "index.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for lo in range(0, n, 65536):
            os.write(fd, b"".join([encode_record(PUT, key(i), Entry(0, i // per_slab, i % per_slab,
                                                                   i + 1, page_bytes, 0))
                                   for i in range(lo, min(n, lo + 65536))]))
    finally:
        os.close(fd)
    for slab in range(-(-n // per_slab)):
        fd = open_file(wdir / slab_file_name(slab, geometry.packed), os.O_WRONLY | os.O_CREAT)
        try:
            os.ftruncate(fd, geometry.bytes_for(per_slab))
        finally:
            os.close(fd)


def _measure_index_only(n: int, page_bytes: int, root: Path, settings: dict[str, Any],
                        progress: bool) -> dict[str, Any]:
    from hicache_l3.slab.store import SlabStore

    s = sample_size(n)
    row: dict[str, Any] = {"pages": n, "page_bytes": page_bytes, "sample": s, "batch": BATCH,
                           "index_only": True}
    started = time.perf_counter()
    write_index_only_store(root / "store", n, page_bytes)
    row["fill_s"] = time.perf_counter() - started
    store = SlabStore(root / "store", scale_namespace(page_bytes), page_bytes)
    try:
        store.refresh()
        started = time.perf_counter()
        with store.index.lock:
            if not store.index.checkpoints.save():
                raise BenchError(f"store of {n:,} pages: no index checkpoint written")
        row["checkpoint_write_s"] = time.perf_counter() - started
    finally:
        store.close()
    capacity = {"capacity_bytes": (n + s) * Geometry(page_bytes).stride}  # as a full sweep's store
    _probe_all(row, root / "store", page_bytes, {**settings, **capacity}, key(n - 1))
    rng = random.Random(0x5CA1E)
    stored = [key(rng.randrange(n)) for _ in range(s)]
    with contextlib.closing(open_connector("file", scale_namespace(page_bytes),
                                           {**settings, **capacity, "root": str(root / "store")})) as conn:
        _all_ok(conn.batch_exists(stored[:1]), "exists")
        _rates(row, [("exists", stored, conn.batch_exists, "exists")], EXISTS_SECONDS, "keys")
    for measure in (*MEASURES[len(INDEX_ONLY_MEASURES):], *RAW_MEASURES.values()):
        row[measure] = None
    return row


def _probe_all(row: dict[str, Any], store: Path, page_bytes: int, settings: dict[str, Any],
               last_key: str) -> None:
    """Open ``store`` in fresh processes, :data:`OPENS` times and once ignoring the index
    checkpoint (a full log replay); the figures go into ``row``."""
    n = row["pages"]
    probes = [_probe(store, page_bytes, settings, last_key) for _ in range(OPENS)]
    row["open_s"] = statistics.median(p["open_s"] for p in probes)
    row["index_rss_bytes_per_page"] = statistics.median(p["private_bytes"] for p in probes) / n
    row["index_shared_bytes_per_page"] = statistics.median(p["shared_bytes"] for p in probes) / n
    row["index_resident_bytes_per_page"] = statistics.median(p["rss_bytes"] for p in probes) / n
    # a node where PROCS_PER_NODE processes share the namespace: the image once, the rest each
    row["index_node_bytes_per_page"] = (row["index_shared_bytes_per_page"]
                                        + PROCS_PER_NODE * row["index_rss_bytes_per_page"])
    row["open_s_all"] = [p["open_s"] for p in probes]
    row["open_checkpoint_pages"] = statistics.median(p["checkpoint_pages"] for p in probes)
    row["open_replayed_records"] = statistics.median(p["replayed_records"] for p in probes)
    row["open_full_replay_s"] = _probe(store, page_bytes, settings, last_key, replay=True)["open_s"]


def _measure_size(n: int, page_bytes: int, root: Path, settings: dict[str, Any],
                  show_progress: bool) -> dict[str, Any]:
    s = sample_size(n)
    settings = {**settings, "capacity_bytes": (n + s) * Geometry(page_bytes).stride}
    buffer = HostBuffer(FILL_BATCH * page_bytes)
    buffer.view()[:] = random.Random(n).randbytes(buffer.size)
    rng = random.Random(0x5CA1E)
    row: dict[str, Any] = {"pages": n, "page_bytes": page_bytes, "sample": s, "batch": BATCH}
    with contextlib.closing(open_connector("file", scale_namespace(page_bytes),
                                           {**settings, "root": str(root / "store")})) as conn:
        conn.register(buffer)
        started = time.perf_counter()
        with progress(n, not show_progress, f"fill {n:,}", "page", unit_scale=True) as tick:
            for lo in range(0, n, FILL_BATCH):
                count = min(FILL_BATCH, n - lo)
                ok = conn.batch_set([key(i) for i in range(lo, lo + count)],
                                    contiguous_pages(buffer.address, page_bytes, range(count)))
                _all_ok(ok, f"fill of {n:,} pages")
                tick(count)
        row["fill_s"] = time.perf_counter() - started
        os.sync()  # the fill's writeback out of the measures
        _probe_all(row, root / "store", page_bytes, settings, key(n - 1))
        row["settle_s"] = _settle(conn)
        pages = contiguous_pages(buffer.address, page_bytes, range(BATCH))
        stored = [key(rng.randrange(n)) for _ in range(s)]
        others = [key(rng.randrange(n)) for _ in range(s)]  # the raw first pass's (own draws)
        _rates(row, [("exists", stored, conn.batch_exists, "exists")], EXISTS_SECONDS, "keys")

        def get(ks: list[str]) -> list[bool]:
            return conn.batch_get(ks, pages)

        _rates(row, [("get", stored, get, "get"),
                     ("raw_get", others, _raw_reader(conn, page_bytes, others), "raw get")])
        # the same keys again: their slots in the page cache, the index's cost without the disk's
        _rates(row, [("get_warm", stored, get, "get (warm)"),
                     ("raw_get_warm", stored, _raw_reader(conn, page_bytes, stored), "raw get (warm)")])
        fresh = [key(i) for i in range(n, n + 2 * s)]
        _rates(row, [("set", fresh[:s], lambda ks: conn.batch_set(ks, pages), "set")])
        before = conn.stats()["engine"].get("evictions", 0)
        _rates(row, [("evict_set", fresh[s:], lambda ks: conn.batch_set(ks, pages), "set at capacity")])
        row["evictions"] = conn.stats()["engine"].get("evictions", 0) - before
    if row["evictions"] != s:
        raise BenchError(f"store of {n:,} pages: {row['evictions']} evictions while setting {s} "
                         "new pages at capacity (expected one per page)")
    return row


def _settle(conn: Any, timeout: float = SETTLE_TIMEOUT) -> float:
    """Let the index work the fill made due (its last checkpoint) end before any measure;
    seconds it took. :class:`BenchError` past ``timeout``."""
    store = conn._store_for_io()
    started = time.perf_counter()
    store.refresh()  # starts what the fill made due
    while store.index.checkpoints.busy():
        if time.perf_counter() - started > timeout:
            raise BenchError(f"the index's background work did not end within {timeout:g} s")
        store.index.checkpoints.wait(1.0)
        store.refresh()  # adopts what ended (a long journal: caught up off the lock first)
    return time.perf_counter() - started


def _all_ok(results: list[bool], what: str) -> None:
    if not all(results):
        raise BenchError(f"{what}: {results.count(False)} of {len(results)} keys failed")


Contender = tuple[str, list[str], Callable[[list[str]], list[bool]], str]  # name, keys, call, what


def _rates(row: dict[str, Any], contenders: list[Contender], seconds: float = 0.0,
           unit: str = "pages") -> None:
    """Time each contender's ``call`` over its keys (equally many) in batches of :data:`BATCH`,
    interleaved batch by batch with the order turning every batch, passes repeated for
    ``seconds`` (at least one); every key must succeed (``what`` names a failure). Into ``row``
    per ``name``: keys per second as ``{name}_{unit}_per_s``, the batch latencies as
    ``{name}_batch_ms`` (p50, p99, max), the passes as ``{name}_passes``."""
    results: dict[str, list[bool]] = {name: [] for name, *_ in contenders}
    latencies: dict[str, list[float]] = {name: [] for name, *_ in contenders}
    clock = time.perf_counter
    total = 0.0
    passes = 0
    n = len(contenders[0][1])
    while passes < MAX_PASSES and (not passes or total < seconds):
        for b, lo in enumerate(range(0, n, BATCH)):
            turn = b % len(contenders)
            for name, keys, call, _ in contenders[turn:] + contenders[:turn]:
                t0 = clock()
                results[name] += call(keys[lo : lo + BATCH])
                spent = clock() - t0
                latencies[name].append(spent)
                total += spent
        passes += 1
    for name, keys, _, what in contenders:
        _all_ok(results[name], what)
        row[f"{name}_{unit}_per_s"] = passes * len(keys) / sum(latencies[name])
        ms = [1e3 * t for t in latencies[name]]
        row[f"{name}_batch_ms"] = {"p50": quantile(ms, 0.5), "p99": quantile(ms, 0.99), "max": max(ms)}
        row[f"{name}_passes"] = passes


def _raw_reader(conn: Any, page_bytes: int, keys: list[str]) -> Callable[[list[str]], list[bool]]:
    """The raw contender of ``conn``'s gets of ``keys``: ``os.preadv`` of each page's data area
    into one buffer, one call per page, slots looked up before any clock; True per page read."""
    store = conn._store_for_io()
    geometry = store.geometry
    where = {k: (loc[0], geometry.data_offset(loc[1][2])) for k, loc in zip(keys, store.lookup(keys))
             if loc is not None}
    into = [memoryview(bytearray(page_bytes))]
    preadv = os.preadv

    def read(batch: list[str]) -> list[bool]:
        return [at is not None and preadv(at[0], into, at[1]) == page_bytes for at in map(where.get, batch)]

    return read


def _probe(store: Path, page_bytes: int, settings: dict[str, Any], last_key: str,
           replay: bool = False) -> dict[str, Any]:
    """Open the store in a fresh process (see :func:`probe_main`); its JSON answer."""
    args = [sys.executable, "-m", "hicache_l3.bench.scale", str(store), str(page_bytes),
            json.dumps(settings), last_key] + (["replay"] if replay else [])
    done = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise BenchError(f"opening {store} in a fresh process failed: {done.stderr.strip()[-2000:]}")
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def _statm() -> tuple[int, int]:
    """(resident, resident shared) bytes of this process."""
    fields = Path("/proc/self/statm").read_text().split()
    size = os.sysconf("SC_PAGE_SIZE")
    return int(fields[1]) * size, int(fields[2]) * size


def _shared_mappings() -> int:
    """Total size of this process's ``MAP_SHARED`` mappings (``/proc/self/maps``)."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        if perms.endswith("s"):
            lo, hi = span.split("-")
            total += int(hi, 16) - int(lo, 16)
    return total


def probe_main(argv: list[str]) -> int:
    """Fresh-process side of a probe: ``STORE PAGE_BYTES SETTINGS_JSON KEY [replay]``. After
    opening a throw-away store (imports, threads), times opening STORE and finding KEY; prints
    ``{"open_s", "rss_bytes", "private_bytes", "shared_bytes", "checkpoint_pages",
    "replayed_records"}`` as one JSON line. ``replay``: the index checkpoint is ignored."""
    import gc

    if argv[4:] == ["replay"]:
        from hicache_l3.slab import checkpoint

        checkpoint.read = lambda directory: None  # this probe process only
    store, page_bytes, settings = Path(argv[0]), int(argv[1]), json.loads(argv[2])
    namespace = scale_namespace(page_bytes)
    with tempfile.TemporaryDirectory(dir=store.parent) as warm, \
            contextlib.closing(open_connector("file", namespace, {**settings, "root": warm})) as conn:
        conn.batch_exists([argv[3]])
    gc.collect()
    (rss0, resident_shared0), shared_maps0 = _statm(), _shared_mappings()
    started = time.perf_counter()
    conn = open_connector("file", namespace, {**settings, "root": str(store)})
    found = conn.batch_exists([argv[3]])
    open_s = time.perf_counter() - started
    (rss1, resident_shared1), shared_maps1 = _statm(), _shared_mappings()
    engine = conn.stats()["engine"]
    conn.close()
    if found != [True]:
        print(f"key {argv[3]} not found after opening {store}", file=sys.stderr)
        return 1
    print(json.dumps({"open_s": open_s, "rss_bytes": rss1 - rss0,
                      "private_bytes": (rss1 - resident_shared1) - (rss0 - resident_shared0),
                      "shared_bytes": shared_maps1 - shared_maps0,
                      "checkpoint_pages": engine.get("index_checkpoint_pages", -1),
                      "replayed_records": engine.get("index_replayed_records", -1)}))
    return 0


def format_rows(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of sweep rows."""
    cols = [("pages", "{:,}"), ("index_rss_bytes_per_page", "{:.1f}"),
            ("index_shared_bytes_per_page", "{:.1f}"), ("index_node_bytes_per_page", "{:.1f}"),
            ("open_s", "{:.3f}"),
            ("open_replayed_records", "{:,.0f}"), ("open_full_replay_s", "{:.3f}"),
            ("exists_keys_per_s", "{:,.0f}"), ("get_pages_per_s", "{:,.0f}"),
            ("get_warm_pages_per_s", "{:,.0f}"), ("raw_get_pages_per_s", "{:,.0f}"),
            ("raw_get_warm_pages_per_s", "{:,.0f}"), ("set_pages_per_s", "{:,.0f}"),
            ("evict_set_pages_per_s", "{:,.0f}")]
    return format_columns(rows, cols, blank="-")


def plot_scale(rows: list[dict[str, Any]], path: Path) -> None:
    """PNG: one panel per measure against the store size (log x); rates on a linear y axis
    from 0, sizes and times on a log y axis."""
    from hicache_l3.bench.plot import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(4, 3, figsize=(14, 13), squeeze=False)
    xs = [r["pages"] for r in rows]
    for ax in axes.flat[len(MEASURES):]:
        ax.set_axis_off()
    for ax, measure in zip(axes.flat, MEASURES):
        if any(r[measure] is None for r in rows):
            ax.set_axis_off()  # not measured (--scale-index-only)
            continue
        ax.plot(xs, [r[measure] for r in rows], marker="o", label="hicache-l3")
        raw = RAW_MEASURES.get(measure)
        if raw is not None:
            ax.plot(xs, [r[raw] for r in rows], marker="s", linestyle="--", label="raw preadv")
            ax.legend(fontsize=8)
        ax.set_xscale("log")
        if measure.endswith("_per_s"):
            ax.set_ylim(bottom=0)
        elif all(r[measure] > 0 for r in rows):
            ax.set_yscale("log")
        ax.set_xlabel("pages in the store")
        ax.set_title(measure.replace("_", " "), fontsize=10)
        ax.grid(True, alpha=0.3)
    kind = " (index only: logs over sparse slabs)" if rows[0].get("index_only") else ""
    fig.suptitle(f"hicache-l3 bench --scale: file connector, {rows[0]['page_bytes']} B pages{kind}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_scale(sizes: list[int], page_bytes: int, workdir: Path | None, settings: dict[str, Any],
              json_path: Path | None, plot_path: Path | None, quiet: bool,
              index_only: bool = False) -> int:
    """The ``--scale`` command: sweep, print the table, write JSON/plot. Exit 1 on failure."""
    own = workdir is None
    root = workdir or Path(tempfile.mkdtemp(prefix="hicache-l3-scale-"))
    try:
        root.mkdir(parents=True, exist_ok=True)
        rows = run_sweep(sizes, page_bytes, root, settings, progress=not quiet,
                         index_only=index_only)
    except (HiCacheL3Error, OSError, subprocess.TimeoutExpired) as exc:
        print(f"bench --scale failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    load = os.getloadavg()
    meta = {"mode": "scale", "page_bytes": page_bytes, "sizes": sizes, "batch": BATCH, "opens": OPENS,
            "loadavg": list(load), "index_only": index_only}
    print_results("load average: {:.2f} {:.2f} {:.2f}\n".format(*load) + format_rows(rows), meta, rows,
                  json_path)
    if plot_path:
        plot_scale(rows, plot_path)
    return 0


if __name__ == "__main__":
    sys.exit(probe_main(sys.argv[1:]))
