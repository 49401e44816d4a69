"""Launchers of the real engines the suite and the bench run against: context managers
that start local processes on free loopback ports, wait until they answer, expose the
connector settings reaching them (:attr:`Engine.settings`) and stop them by PID on exit.
``hicache-l3 engines up NAME`` runs one in the foreground; :mod:`.containers` starts the
same engines as containers.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from hicache_l3.engines.base import Engine, ManagedProcess, free_port
from hicache_l3.engines.glusterfs import GlusterEngine
from hicache_l3.engines.mooncake import MooncakeEngine
from hicache_l3.engines.s3 import S3Engine

__all__ = ["ENGINES", "Engine", "GlusterEngine", "ManagedProcess", "MooncakeEngine", "S3Engine",
           "free_port"]

# name -> local launcher
ENGINES: dict[str, type[Engine]] = {
    "mooncake": MooncakeEngine,
    "s3": S3Engine,
    "glusterfs": GlusterEngine,
}


def add_arguments(parser: Any) -> None:
    """``hicache-l3 engines up NAME``: arguments."""
    parser.add_argument("action", choices=["up"], help="'up': start and run until Ctrl-C")
    parser.add_argument("engine", help="engine to start: " + ", ".join(sorted(ENGINES) or ["(none)"]))


def run(args: Any) -> int:
    """Start an engine, print its settings as TOML, and run until interrupted."""
    cls = ENGINES.get(args.engine)
    if cls is None:
        print(f"unknown engine {args.engine!r}; choose one of {sorted(ENGINES)}", file=sys.stderr)
        return 2
    with cls() as engine:
        print(f"# {engine.name} is up; connector settings:")
        for key, value in engine.settings.items():
            print(f"{key} = {value!r}")
        print("# Ctrl-C to stop", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while all(p.alive() for p in engine.processes):
                time.sleep(0.5)
    return 0
