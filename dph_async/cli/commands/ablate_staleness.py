"""`dph-async ablate staleness`: eta x off-policy correction x seeds, from one base model."""

from __future__ import annotations

import argparse

from dph_async.cli.ablate_common import add_common_arguments, run
from dph_async.tools.ablate.cells import staleness_sweep

DESCRIPTION = """\
A grid of RL runs that differ only in replay.max_staleness (eta: how many learner versions old a
group may be when it is consumed; eta = 0 is synchronous RL; auto: the learner steers it, see
docs/decisions.md) and learner.loss.correction (behavior:
naive PPO on stale data; decoupled: AReaL's decoupled PPO with truncated importance weights;
masked: tokens whose weights leave [1/C, C] are masked out), each with several seeds, all from the
same base model (warm-started and pre-sampled once, in --output).

Every cell reports training reward against fresh samples consumed and against wall time, Pass@k on
the test splits at --eval-points versions along the run, the staleness histogram of what the learner
consumed, and IS diagnostics (ESS, clipped fraction, kept fraction, mismatch KL). The summary gives
mean ± standard error over seeds and says, per correction, whether each eta reaches the reward of
eta = 0. docs/ablations.md explains the defaults and how to read the figures.

Resumable: a finished cell (rl/<cell>/cell.json) is never rerun; rerunning the command with more
etas or seeds runs only the new cells. Output: summary.md, summary.json, seeds.csv (one row per
cell, what `ablate confirm` reads), plots/ in --output.

examples:
  dph-async ablate staleness                                  # 5 etas x 3 corrections x 3 seeds
  dph-async ablate staleness --etas 0 4 --corrections behavior decoupled --seeds 0 1 2 3 4
  dph-async ablate staleness --etas 0 1 4 auto --corrections decoupled   # the bound steered by the learner
  dph-async ablate staleness learner.loss.objective=grpo      # plain GRPO instead of DPH-JS
  dph-async ablate staleness --report-only                    # redo the summary from finished cells
"""


def eta_value(text: str) -> int | str:
    """An --etas value: an integer >= 0, or auto (replay.max_staleness=auto)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor auto") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etas", type=eta_value, nargs="+", default=[0, 1, 2, 4, 8],
                   help="replay.max_staleness values, integers or auto (default: 0 1 2 4 8)")
    p.add_argument("--corrections", nargs="+", default=["behavior", "decoupled", "masked"],
                   help="learner.loss.correction values (default: behavior decoupled masked)")
    add_common_arguments(p, "runs/ablate/staleness")


def main(args: argparse.Namespace) -> int:
    return run(args, lambda mode, _cfg: staleness_sweep(args.etas, args.corrections, args.seeds, mode))
