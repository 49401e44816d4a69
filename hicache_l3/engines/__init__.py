"""Start and stop the real engines the suite and the bench run against.

Each engine is a context manager that starts local processes on free loopback ports,
waits until they answer, exposes the connector settings to reach them
(:attr:`Engine.settings`), and stops them by PID on exit, leaving nothing behind.
``hicache-l3 engines up NAME`` runs one in the foreground for development.

Engines: :data:`ENGINES`, one module each. ``hicache_l3.engines.containers`` starts the
same engines as containers (from a checkout's ``docker/``); ``hicache_l3.engines.loopback``
is the shim preloaded into every engine process, so that it listens on loopback only.
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

# name -> local launcher (``hicache-l3 engines up NAME``, the bench's and replay's engines)
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
