"""`dph-async ablate divergence`: DPH divergence mode x coefficient x seeds, from one base model."""

from __future__ import annotations

import argparse

from dph_async.app.ablate.command import add_common_arguments, run

NAME = "ablate divergence"
HELP = "sweep the DPH divergence x its coefficient x seeds; the paper's table on the embedded task"
DESCRIPTION = """\
A grid of RL runs that differ only in learner.loss.divergence (grpo: none; reverse_kl: k3 KL to a
frozen reference on fresh tokens; forward: DPH-F; js_low_var: DPH-JS; alpha; js) and its coefficient
learner.loss.coeff (grpo takes none), each with several seeds, all from the same base model pi_0.
The summary is the shape of the DPH-RL paper's tables: greedy accuracy, Pass@k and distinct correct
answers in-domain and out-of-domain, base model first, mean ± standard error over seeds; plus
training curves, Pass@k along the runs and IS diagnostics. docs/ablations.md explains the defaults.

Resumable like `ablate staleness`: finished cells are never rerun.

examples:
  dph-async ablate divergence                                 # grpo, reverse_kl, forward, js_low_var
  dph-async ablate divergence --modes forward --coeffs 0.01 0.02 0.05
  dph-async ablate divergence --modes grpo js_low_var alpha learner.loss.alpha=0.5
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", nargs="+", default=["grpo", "reverse_kl", "forward", "js_low_var"],
                   help="divergence modes (default: grpo reverse_kl forward js_low_var)")
    p.add_argument("--coeffs", type=float, nargs="+", default=[0.05, 0.2],
                   help="learner.loss.coeff values for every mode but grpo (default: 0.05 0.2)")
    add_common_arguments(p, "runs/ablate/divergence")


def main(args: argparse.Namespace) -> int:
    from dph_async.app.ablate.cells import divergence_sweep

    return run(args, lambda _mode: divergence_sweep(args.modes, args.coeffs, args.seeds))
