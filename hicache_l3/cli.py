"""The ``hicache-l3`` command line: bench, replay, engines, sglang-args, check.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs (or for
``--help``), so a missing engine package never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NamedTuple


class Command(NamedTuple):
    """One subcommand: its module and the names of its two functions there."""

    module: str
    help: str
    add_arguments: str = "add_arguments"
    run: str = "run"


COMMANDS: dict[str, Command] = {
    "bench": Command("hicache_l3.bench.cli", "measure connectors against their raw engines"),
    "replay": Command("hicache_l3.bench.replay", "replay an agentic workload through L1/L2 + a connector"),
    "engines": Command("hicache_l3.engines", "start local engines (mooncake, s3) for development"),
    "sglang-args": Command("hicache_l3.sglang.cli", "print SGLang flags and write the config file"),
    "check": Command("hicache_l3.sglang.cli", "validate a config file with a round trip of a few pages",
                     "add_check_arguments", "run_check"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hicache-l3`` console script."""
    parser = argparse.ArgumentParser(
        prog="hicache-l3",
        description="L3 KV-cache storage connectors for SGLang HiCache.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, command in COMMANDS.items():
        try:
            module = importlib.import_module(command.module)
        except ImportError:
            continue  # not built yet, or its optional dependency is missing
        p = sub.add_parser(name, help=command.help, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        adder = getattr(module, command.add_arguments, None)
        if adder is not None:
            adder(p)
        modules[name] = module
    args = parser.parse_args(argv)
    runner = getattr(modules[args.command], COMMANDS[args.command].run)
    code: int = runner(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
