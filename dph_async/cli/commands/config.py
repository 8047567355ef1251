"""`dph-async config`: show the resolved config, or the presets."""

from __future__ import annotations

import argparse

from dph_async.cli.commands.common import add_config_arguments
from dph_async.config import dump_config, load_config, presets

DESCRIPTION = """\
Print the config a run would use: a preset (default: the embedded CPU default) with dotted overrides
applied and validated, exactly as `dph-async run` would see it. A wrong key or value is reported with
its dotted name and what is allowed.

examples:
  dph-async config --list
  dph-async config --preset forward learner.loss.coeff=0.05
  dph-async config replay.max_staleness=4 --preset grpo learner.loss.correction=masked
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--list", action="store_true", help="list the presets and exit")


def main(args: argparse.Namespace) -> int:
    if args.list:
        print("\n".join(presets()))
        return 0
    print(dump_config(load_config(args.preset, args.overrides)), end="")
    return 0
