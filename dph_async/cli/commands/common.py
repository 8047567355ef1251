"""What the command modules share: the config arguments, error lines, Ctrl-C, a bench's table of cells
(not a command: no line in COMMANDS)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dph_async.progress import console


def add_config_arguments(p: argparse.ArgumentParser, overrides: str = "dotted config overrides") -> None:
    """KEY=VALUE overrides (anywhere among the options, see dph_async.cli.main) and the preset they apply to."""
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help=f"{overrides}, e.g. learner.lr=1e-4 (see `dph-async config`)")
    p.add_argument("--preset", "--config", dest="preset", default="default",
                   help="a preset name (dph-async config --list) or a YAML file (default: %(default)s)")


def add_output_argument(p: argparse.ArgumentParser, help: str, *, out_alias: bool = False, **kwargs: Any) -> None:
    """-o/--output: where a command writes, spelled alike in every command (`args.output`). `out_alias`
    also accepts --out, unlisted, for the commands that took --out before."""
    p.add_argument("-o", "--output", dest="output", help=help, **kwargs)
    if out_alias:
        p.add_argument("--out", dest="output", type=kwargs.get("type"), default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)


def fail(message: str, status: int = 2) -> int:
    """Print `error: <message>` on stderr (a longer message goes on in indented lines); return `status`."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return status


def guarded(work: Callable[[], object], interrupted: str) -> int:
    """Run `work`: exit status 0 when it finishes, 130 after printing `interrupted` on Ctrl-C."""
    try:
        work()
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: {interrupted}")
        return 130
    return 0


def write_cells(out: Path, meta: dict, cells: list, table: str) -> int:
    """Write a bench's `meta` and its dataclass `cells` to `out` as JSON, print its markdown `table`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "cells": [asdict(c) for c in cells]}, indent=2))
    print()
    print(table)
    print(f"\nwritten to {out}")
    return 0
