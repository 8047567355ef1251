"""The `dph-async` command: discovers the command modules in dph_async/app/commands and dispatches."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from types import ModuleType

from dph_async import __version__
from dph_async.app import commands


def _command_modules() -> list[ModuleType]:
    mods = [importlib.import_module(f"{commands.__name__}.{m.name}") for m in pkgutil.iter_modules(commands.__path__)]
    return sorted((m for m in mods if hasattr(m, "NAME")), key=lambda m: m.NAME)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dph-async",
        description=(
            "Asynchronous off-policy RL for language models with verifiable rewards, and the reference "
            "DPH-RL implementation. `dph-async run` with no arguments trains and evaluates the embedded "
            "default end to end on this machine."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dph-async {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, argparse._SubParsersAction] = {}
    commands: dict[str, argparse.ArgumentParser] = {}
    for mod in _command_modules():
        words = mod.NAME.split()
        if len(words) == 1:
            sub = commands[words[0]] = top.add_parser(words[0], help=mod.HELP, description=mod.DESCRIPTION,
                                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        else:
            if words[0] not in groups:
                # A command named like the group ("bench") runs when no subcommand is given.
                group = commands.get(words[0]) or top.add_parser(words[0], help=f"{words[0]} subcommands")
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND",
                                                        required=words[0] not in commands)
            sub = groups[words[0]].add_parser(words[1], help=mod.HELP, description=mod.DESCRIPTION,
                                              formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sub)
        sub.set_defaults(_main=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
