"""The ``hicache-l3`` command line: bench, replay, engines, sglang-args, check.

Each subcommand lives in its own module, which provides ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their subcommand runs (or for
``--help``), so a missing engine package never breaks the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("hicache_l3.bench.cli", "measure connectors against their raw engines"),
    "replay": ("hicache_l3.bench.replay", "replay an agentic workload through L1/L2 + a connector"),
    "engines": ("hicache_l3.engines", "start local engines (mooncake, s3) for development"),
    "sglang-args": ("hicache_l3.sglang_config", "print SGLang flags and write the config file"),
    "check": ("hicache_l3.sglang_config", "validate a config file with a round trip of a few pages"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hicache-l3`` console script."""
    parser = argparse.ArgumentParser(
        prog="hicache-l3",
        description="L3 KV-cache storage connectors for SGLang HiCache.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue  # not built yet, or its optional dependency is missing
        command = name if name != "check" else "check"
        p = sub.add_parser(command, help=help_text, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        adder = getattr(module, "add_check_arguments" if name == "check" else "add_arguments", None)
        if adder is not None:
            adder(p)
        modules[name] = module
    args = parser.parse_args(argv)
    module = modules[args.command]
    runner = getattr(module, "run_check" if args.command == "check" else "run")
    code: int = runner(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
