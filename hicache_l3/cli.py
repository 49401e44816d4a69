"""The ``hicache-l3`` command line. Each subcommand's module provides ``add_arguments(parser)``
and ``run(args) -> int`` (:data:`COMMANDS`); one whose module cannot be imported is still
listed with what to install, and running it prints that and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any, NamedTuple


class Command(NamedTuple):
    """One subcommand: its module and the names of its two functions there."""

    module: str
    help: str
    add_arguments: str = "add_arguments"
    run: str = "run"


# Packages an optional extra brings -> that extra (for the install hint of a command).
EXTRAS = {"mooncake": "mooncake", "nixl": "nixl", "nixl_cu12": "nixl", "fsspec": "fsspec",
          "matplotlib": "plot", "boto3": "nixl", "pytest": "test", "moto": "test"}

COMMANDS: dict[str, Command] = {
    "bench": Command("hicache_l3.bench.cli", "measure connectors against their raw engines"),
    "replay": Command("hicache_l3.bench.replay", "replay an agentic workload through L1/L2 + a connector"),
    "engines": Command("hicache_l3.engines", "start local engines (mooncake, s3, glusterfs) for development"),
    "sglang-args": Command("hicache_l3.sglang.cli", "print SGLang flags and write the config file"),
    "check": Command("hicache_l3.sglang.cli", "validate a config file with a round trip of a few pages",
                     "add_check_arguments", "run_check"),
}


def install_hint(exc: ImportError) -> str:
    """What to install for a command whose module raised ``exc`` on import."""
    missing = (exc.name or "").split(".")[0]
    if not missing or missing == "hicache_l3":
        return f"{exc}: reinstall hicache-l3"
    extra = EXTRAS.get(missing)
    return (f"needs {missing}: pip install 'hicache-l3[{extra}]'" if extra
            else f"needs {missing}: pip install {missing}")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``hicache-l3`` console script."""
    parser = argparse.ArgumentParser(
        prog="hicache-l3",
        description="L3 KV-cache storage connectors for SGLang HiCache.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules: dict[str, Any] = {}
    for name, command in COMMANDS.items():
        try:
            module = importlib.import_module(command.module)
        except ImportError as exc:
            hint = install_hint(exc)
            sub.add_parser(name, help=f"{command.help} [unavailable: {hint}]",
                           description=f"{command.help}\n\nunavailable here: {hint}")
            modules[name] = hint
            continue
        p = sub.add_parser(name, help=command.help, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        adder = getattr(module, command.add_arguments, None)
        if adder is not None:
            adder(p)
        modules[name] = module
    args, rest = parser.parse_known_args(argv)
    module = modules[args.command]
    if isinstance(module, str):  # its arguments are unknown: say what to install
        print(f"hicache-l3 {args.command}: unavailable: {module}", file=sys.stderr)
        return 2
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    runner = getattr(module, COMMANDS[args.command].run)
    code: int = runner(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
