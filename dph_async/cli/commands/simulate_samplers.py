"""`dph-async simulate samplers`: the samplers paper's tabular bandit, DPO's convergence per sampler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dph_async.cli.commands.common import add_output_argument
from dph_async.progress import progress
from dph_async.samplers import SAMPLERS
from dph_async.tools.sampler_bandit import BanditConfig, simulate, write

DESCRIPTION = """\
Train a tabular policy with DPO from pairs drawn by each sampler and plot the gap to the optimal
KL-regularised value, V* - V(pi), per update (the samplers paper's numerical simulation; formulas in
dph_async/tools/sampler_bandit.py). Writes bandit.json and bandit_gap.png to --output. Examples:

    dph-async simulate samplers                                 # the samplers paper's exact setting
    dph-async simulate samplers --empirical-pairs 8192 --lr 0.05 --updates 3000
    dph-async simulate samplers --samplers online mixp --beta 1
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BanditConfig()
    parser.add_argument("--actions", type=int, default=d.actions, help="K (default: %(default)s)")
    parser.add_argument("--beta", type=float, default=d.beta, help="DPO's beta (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=d.lr, help="gradient-descent step (default: %(default)s)")
    parser.add_argument("--updates", type=int, default=d.updates, help="updates per sampler (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the rewards and the draws")
    parser.add_argument("--empirical-pairs", type=int, default=0, metavar="N",
                        help="sample N pairs and labels per update instead of the exact gradient")
    parser.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=list(SAMPLERS))
    add_output_argument(parser, "output directory (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/simulate_samplers"))


def main(args: argparse.Namespace) -> int:
    if args.actions < 2 or args.beta <= 0 or args.lr <= 0 or args.updates < 1 or args.empirical_pairs < 0:
        print("error: need --actions >= 2, --beta > 0, --lr > 0, --updates >= 1, --empirical-pairs >= 0",
              file=sys.stderr)
        return 2
    cfg = BanditConfig(args.actions, args.beta, args.lr, args.updates, args.seed, args.empirical_pairs,
                       tuple(args.samplers))
    with progress() as bar:
        task = bar.add_task("DPO on the bandit", total=cfg.updates * len(cfg.samplers))
        result = simulate(cfg, on_update=lambda: bar.advance(task))
    for path in write(result, args.output):
        print(path)
    print(f"V* = {result.optimal_value:.4f}; gap after {cfg.updates} updates:")
    for name, gap in result.gap.items():
        print(f"  {name:7s} {gap[-1]:.3e}")
    return 0
