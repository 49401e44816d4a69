"""``hicache-l3 sglang-args`` (write the extra-config file and print the SGLang launch
command) and ``hicache-l3 check`` (validate such a file with a round trip of a few pages).
Imports no SGLang.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hicache_l3.common.config import parse_sets
from hicache_l3.common.errors import ConfigError, HiCacheL3Error
from hicache_l3.common.keys import Namespace
from hicache_l3.common.registry import available_connectors, config_class, resolve_name
from hicache_l3.sglang.config import (
    ADAPTER_CLASS,
    ADAPTER_MODULE,
    LOCAL_DEFAULTS,
    AdapterConfig,
    build_namespace,
    dump_config,
    extra_config_for,
    load_config_file,
)

log = logging.getLogger("hicache_l3.sglang.cli")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hicache-l3 sglang-args``."""
    parser.add_argument("--backend", required=True, help="connector: " + ", ".join(available_connectors()))
    parser.add_argument("--config", default=None,
                        help="config file to write (.toml, .json or .yaml; default hicache-l3-NAME.toml)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a connector setting (repeatable), over the local defaults")
    parser.add_argument("--tag", default="", help="extra_backend_tag: user tag in the key namespace")
    parser.add_argument("--model-path", default="MODEL", help="model path shown in the launch command")


def run(args: argparse.Namespace) -> int:
    """Write the config file and print the SGLang launch flags that load it."""
    try:
        connector = resolve_name(args.backend)
        settings = dict(LOCAL_DEFAULTS.get(connector, {}))
        settings.update(parse_sets(args.sets))
        adapter = AdapterConfig.from_extra_config(extra_config_for(connector, settings, args.tag))
        adapter.validate_settings()
        path = Path(os.path.abspath(args.config or f"hicache-l3-{connector}.toml"))  # links not followed
        dump_config(extra_config_for(connector, settings, args.tag), path)
    except HiCacheL3Error as exc:
        print(f"hicache-l3 sglang-args: {exc}", file=sys.stderr)
        return 2
    env = launch_env(adapter)
    flags = [
        "--enable-hierarchical-cache",
        "--hicache-mem-layout", "page_first",
        "--hicache-storage-backend", "dynamic",
        "--hicache-storage-backend-extra-config", f"@{path}",
    ]
    print(f"# wrote {path}", file=sys.stderr)
    print(" ".join([*map(shlex.quote, env), "python -m sglang.launch_server --model-path",
                    shlex.quote(args.model_path), *map(shlex.quote, flags)]))
    return 0


def _is_loopback(host: str) -> bool:
    return host == "localhost" or host.startswith("127.") or host == "::1"


def launch_env(adapter: AdapterConfig) -> list[str]:
    """``NAME=VALUE`` words to put before the launch command: the loopback shim for Mooncake
    on one machine; otherwise none, with a note on stderr saying what listens where."""
    if adapter.connector != "mooncake":
        return []
    from hicache_l3.engines import loopback

    config = config_class("mooncake").load("mooncake", adapter.settings)
    master_host = str(getattr(config, "master_address", "")).rpartition(":")[0].strip("[]")
    if not (_is_loopback(master_host) and _is_loopback(str(getattr(config, "local_hostname", "")))):
        print("# note: Mooncake across machines: its transfer engine in SGLang listens on all "
              "interfaces (ports 12000-17999); firewall them to the cluster's hosts "
              "(README \"Security\")", file=sys.stderr)
        return []
    if loopback.SHIM is None:
        print(f"# warning: {loopback.WHY_NOT}; without it Mooncake's transfer engine in SGLang "
              "listens on all interfaces (README \"Security\")", file=sys.stderr)
        return []
    return [f"LD_PRELOAD={loopback.SHIM}"]


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``hicache-l3 check``."""
    parser.add_argument("--config", required=True, help="the extra-config file given to SGLang")
    parser.add_argument("--pages", type=int, default=8, help="pages to round-trip")
    parser.add_argument("--page-bytes", type=int, default=64 << 10, help="bytes per test page")


def check_config(path: str | Path, pages: int = 8, page_bytes: int = 64 << 10) -> str:
    """Validate the config file and round-trip ``pages`` random pages through its connector in
    a namespace of its own (removed afterwards). A one-line summary; HiCacheL3Error if wrong."""
    from hicache_l3.common.memory import HostBuffer
    from hicache_l3.common.registry import open_connector

    extra = load_config_file(path)
    for key, want in (("module_path", ADAPTER_MODULE), ("class_name", ADAPTER_CLASS)):
        if extra.get(key) != want:
            raise ConfigError(f"{path}: {key} must be {want!r} for SGLang to load hicache-l3, "
                              f"got {extra.get(key)!r}")
    if "backend_name" not in extra:
        raise ConfigError(f"{path}: backend_name is missing (SGLang requires it)")
    adapter = AdapterConfig.from_extra_config(extra)
    adapter.validate_settings()
    namespace = build_namespace(
        model_name="hicache-l3-check", tag=f"check-{os.getpid()}-{time.time_ns()}",
        kv_dtype="uint8", layout="page_first", page_size=1,
    )
    buf = HostBuffer(2 * pages * page_bytes, pin=False)
    view = buf.view()
    view[: pages * page_bytes] = os.urandom(pages * page_bytes)
    keys = [f"check-{i}" for i in range(pages)]
    src = [((buf.address + i * page_bytes, page_bytes),) for i in range(pages)]
    dst = [((buf.address + (pages + i) * page_bytes, page_bytes),) for i in range(pages)]
    start = time.perf_counter()
    connector = open_connector(adapter.connector, namespace, adapter.settings)
    try:
        connector.register(buf)
        problems = []
        if not all(ok := connector.batch_set(keys, src)):
            problems.append(f"set failed for {ok.count(False)} of {pages} pages")
        if connector.leading_hits(keys) != pages:
            problems.append("exists does not see every page just set")
        got = connector.batch_get(keys, dst)
        if not all(got):
            problems.append(f"get failed for {got.count(False)} of {pages} pages")
        elif view[: pages * page_bytes] != view[pages * page_bytes :]:
            problems.append("pages read back differ from the pages written")
        if problems:
            failures = connector.stats()["ops"]
            raise HiCacheL3Error(f"{adapter.connector}: " + "; ".join(problems) + f" (stats: {failures})")
        connector.delete(keys)
    finally:
        connector.close()
        view.release()
        _remove_check_namespace(connector, namespace)
    ms = (time.perf_counter() - start) * 1e3
    return (f"ok: {adapter.connector} connector, {pages} pages of {page_bytes} bytes written, "
            f"found and read back identical in {ms:.0f} ms")


def _remove_check_namespace(connector: Any, namespace: Namespace) -> None:
    """Remove the check's own ``<root>/ns-<digest>`` that file-backed connectors leave (never
    through a symlink)."""
    digest = namespace.digest()
    fs, base = getattr(connector, "fs", None), getattr(connector, "base", None)
    if fs is not None and isinstance(base, str) and base.endswith(f"/ns-{digest}"):  # fsspec roots
        try:
            fs.rm(base, recursive=True)
        except Exception as exc:
            log.debug("hicache-l3 check: could not remove %s: %r", base, exc)
        return
    root = getattr(connector, "root", None)
    if not root or "://" in str(root):
        return
    directory = Path(root) / f"ns-{digest}"
    if directory.is_symlink():
        return
    if directory.is_dir():
        shutil.rmtree(directory, ignore_errors=True)


def run_check(args: argparse.Namespace) -> int:
    """``hicache-l3 check``: print the summary, or the problem and exit 1."""
    try:
        print(check_config(args.config, args.pages, args.page_bytes))
    except (HiCacheL3Error, ImportError) as exc:
        print(f"hicache-l3 check: {args.config}: {exc}", file=sys.stderr)
        return 1
    return 0
