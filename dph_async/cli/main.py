"""The `dph-async` command: the commands of dph_async/cli/commands (its table, COMMANDS), their
parsers, and the dispatch. A command line imports only the module of the command it names.

Dotted `KEY=VALUE` config overrides may stand anywhere among a command's options (`CommandParser`).
A user's mistake (`UserError`: a bad key, file or data source) ends as one `error: ...` line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any

from dph_async import __version__
from dph_async.cli.commands import COMMANDS, command_module
from dph_async.cli.commands.common import fail
from dph_async.errors import UserError

# A dotted config override: `learner.lr=1e-4`, `task.test_data.dev=dev.parquet`, `mode=sync`.
OVERRIDE = re.compile(r"[A-Za-z_][\w-]*(\.[\w-]+)*=")


class CommandParser(argparse.ArgumentParser):
    """A parser whose `KEY=VALUE` overrides may stand before, between or after its options.

    argparse alone lets a list option (`--etas 0 4`) swallow the overrides after it and refuses
    overrides after an option once a positional was read. So the overrides are taken out of the
    arguments first, keeping their order, and everything else is parsed as usual. A token is an
    override when it looks like one and is not the value of the option before it (`--data dev=x.parquet`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Set before argparse's own __init__, which adds --help through add_argument.
        self._values_after: dict[str, int] = {}  # option string -> values that must follow it
        self._override_options: set[str] = set()  # options whose value is an override (bench's --set)
        self._takes_overrides = False
        self._subcommands: set[str] = set()
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.dest == "overrides":
            self._takes_overrides = True
            self._override_options.update(action.option_strings)
        for option in action.option_strings:
            n = action.nargs
            # None: one value; an int: that many; "?", "*" and "+" take what follows up to the next override.
            self._values_after[option] = 1 if n is None else n if isinstance(n, int) else 0
        return action

    def add_subcommand(self, subparsers: argparse._SubParsersAction, name: str, **kwargs: Any) -> CommandParser:
        self._subcommands.add(name)
        return subparsers.add_parser(name, **kwargs)

    def split_overrides(self, args: Sequence[str]) -> tuple[list[str], list[str]]:
        """(the overrides, the other arguments), each in the order given."""
        overrides: list[str] = []
        rest: list[str] = []
        args = list(args)
        i = 0
        while i < len(args):
            token = args[i]
            if token == "--" or token in self._subcommands:  # a subcommand parses its own
                rest += args[i:]
                break
            if token in self._override_options and i + 1 < len(args):
                overrides.append(args[i + 1])
                i += 2
                continue
            if token.startswith("-"):
                n = self._values_of(token)
                rest += args[i:i + 1 + n]
                i += 1 + n
                continue
            (overrides if OVERRIDE.match(token) else rest).append(token)
            i += 1
        return overrides, rest

    def _values_of(self, option: str) -> int:
        """How many values follow `option` (none after `--opt=value`, a flag or an unknown option)."""
        known = [o for o in self._values_after if o == option]
        if not known and self.allow_abbrev and option.startswith("--"):  # argparse takes unique prefixes
            known = [o for o in self._values_after if o.startswith(option)]
        return self._values_after[known[0]] if len(known) == 1 else 0

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        if not self._takes_overrides:
            return super().parse_known_args(args, namespace)
        overrides, rest = self.split_overrides(sys.argv[1:] if args is None else args)
        ns, extras = super().parse_known_args(rest, namespace)
        # Anything argparse still put there is no override (no "="): load_config names it.
        ns.overrides = [*overrides, *(ns.overrides or [])]
        return ns, extras


def _command_words(argv: list[str]) -> list[str]:
    """The leading words of a command line that name its command ("bench", "peer" of `bench peer ...`)."""
    words = []
    for token in argv[:2]:
        if token.startswith("-") or "=" in token:
            break
        words.append(token)
    return words


def build_parser(argv: list[str] | None = None) -> CommandParser:
    """The whole command line. Given `argv`, only the commands it names are imported and get their
    options and --help text; the others are a name and a help line from COMMANDS. So `dph-async --help`
    imports no command, and a long-lived service started from this command line carries no other
    command's imports (presets, samplers, torch). Without `argv`, every command is imported."""
    named = None if argv is None else _command_words(argv)
    parser = CommandParser(
        prog="dph-async",
        description=(
            "Asynchronous off-policy RL for language models with verifiable rewards, and the reference "
            "DPH-RL implementation. `dph-async run` with no arguments trains and evaluates the embedded "
            "default end to end on this machine. Every command takes dotted config overrides "
            "(KEY=VALUE) anywhere among its options; `dph-async COMMAND --help` shows examples."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"dph-async {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, parser_class=CommandParser)
    groups: dict[str, argparse._SubParsersAction] = {}
    parsers: dict[str, CommandParser] = {}
    text = {"formatter_class": argparse.RawDescriptionHelpFormatter}
    for name, help_line in sorted(COMMANDS.items()):  # a group's own command ("bench") before its subcommands
        words = name.split()
        mod = command_module(name) if named is None or named[:len(words)] == words else None
        description = mod.DESCRIPTION if mod is not None else None
        if len(words) == 1:
            sub = parsers[words[0]] = parser.add_subcommand(top, words[0], help=help_line, description=description,
                                                            **text)
        else:
            if words[0] not in groups:
                # A command named like the group ("bench") runs when no subcommand is given.
                group = parsers.get(words[0]) or parser.add_subcommand(top, words[0], help=f"{words[0]} subcommands")
                parsers[words[0]] = group
                groups[words[0]] = group.add_subparsers(dest="subcommand", metavar="SUBCOMMAND",
                                                        required=words[0] not in COMMANDS)
            sub = parsers[words[0]].add_subcommand(groups[words[0]], words[1], help=help_line,
                                                   description=description, **text)
        if mod is not None:
            mod.add_arguments(sub)
        sub.set_defaults(_command=name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    try:
        return int(command_module(args._command).main(args) or 0)
    except UserError as e:
        # Raised in a Ray worker, it arrives wrapped; the wrapper keeps the original as `cause`.
        cause = getattr(e, "cause", None)
        return fail(str(cause if isinstance(cause, UserError) else e))


if __name__ == "__main__":
    sys.exit(main())
