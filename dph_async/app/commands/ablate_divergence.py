"""`dph-async ablate divergence`: DPH divergence mode x coefficient x seeds, from one base model."""

from __future__ import annotations

import argparse

from dph_async.app.ablate.command import add_common_arguments, run

NAME = "ablate divergence"
HELP = "sweep training objectives x their coefficients x seeds; the DPH-RL paper's table on your task"
DESCRIPTION = """\
A grid of RL runs that differ only in their objective (learner/objectives.py), its coefficient and
the prompts it trains on, each with several seeds, all from the same base model pi_0. A run is
written OBJECTIVE[:COEFF][@all|@d_exp]: grpo (GRPO on every prompt), grpo@d_exp (GRPO on D_exp, the
control for the DPH objectives, which train on D_exp), dapo, reverse_kl (k3 KL to a frozen pi_0 on
fresh tokens), forward (DPH-F), js_low_var (DPH-JS), js, alpha. Without a coefficient a run tries
its objective's reference values (forward 0.01 0.05; js_low_var 0.05 0.2; alpha 0.01 0.05;
reverse_kl 0.01 0.1), or every --coeffs value. The summary has the shape of the paper's tables:
greedy accuracy, Pass@k and distinct correct answers in-domain and out-of-domain, base model first,
mean ± standard error over seeds; plus training curves, Pass@k along the runs and IS diagnostics.
docs/ablations.md explains the defaults.

Resumable like `ablate staleness`: finished cells are never rerun.

examples:
  dph-async ablate divergence                          # grpo grpo@d_exp reverse_kl forward js_low_var alpha
  dph-async ablate divergence --modes forward --coeffs 0.01 0.02 0.05
  dph-async ablate divergence --modes grpo@d_exp js_low_var:0.2 alpha:0.05 learner.loss.alpha=0.5
  dph-async ablate divergence learner.mini_batches=4 --seeds 0 1 2 3
"""

DEFAULT_MODES = ["grpo", "grpo@d_exp", "reverse_kl", "forward", "js_low_var", "alpha"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", nargs="+", default=DEFAULT_MODES, metavar="SPEC",
                   help=f"runs as OBJECTIVE[:COEFF][@all|@d_exp] (default: {' '.join(DEFAULT_MODES)})")
    p.add_argument("--coeffs", type=float, nargs="+",
                   help="coefficients for every run with a divergence and no coefficient of its own "
                   "(default: each objective's reference values)")
    add_common_arguments(p, "runs/ablate/divergence")


def main(args: argparse.Namespace) -> int:
    from dph_async.app.ablate.cells import divergence_sweep

    return run(args, lambda _spec: divergence_sweep(args.modes, args.coeffs, args.seeds))
