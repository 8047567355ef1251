"""`dph-async ablate divergence`: DPH divergence mode x coefficient x seeds, from one base model."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.ablate_common import add_common_arguments, run
from dph_async.cli.commands.common import fail
from dph_async.tools.ablate.cells import divergence_sweep, frontier_sweep

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

--frontier asks the question at matched strength: every run over a ladder of coefficients (multiples
of its objective's reference coefficient, --ladder), with two PPO mini-batches per batch, and the
summary adds Pass@16 against Pass@1 per objective (plots/frontier.png) with each run's difference to
the control (grpo@d_exp) and to the reverse-KL frontier at the same Pass@1. --shares with
--share-runs adds the reference samples' share of the batch as a second axis (replay.reference_ratio
= share / (1 - share)) for the runs named.

Resumable like `ablate staleness`: finished cells are never rerun. Output: summary.md, summary.json,
seeds.csv (one row per cell, what `ablate confirm` reads), plots/ in --output.

examples:
  dph-async ablate divergence                          # grpo grpo@d_exp reverse_kl forward js_low_var alpha
  dph-async ablate divergence --modes forward --coeffs 0.01 0.02 0.05
  dph-async ablate divergence --modes grpo@d_exp js_low_var:0.2 alpha:0.05 learner.loss.alpha=0.5
  dph-async ablate divergence learner.mini_batches=4 --seeds 0 1 2 3
  dph-async ablate divergence --frontier                # grpo@d_exp, forward, js_low_var, alpha, reverse_kl
                                                         # at 1, 10, 100 and 1000 x their reference
  dph-async ablate divergence --frontier --shares 0.25 0.5 --share-runs js_low_var:2 forward:0.1
"""

DEFAULT_MODES = ["grpo", "grpo@d_exp", "reverse_kl", "forward", "js_low_var", "alpha"]
FRONTIER_MODES = ["grpo@d_exp", "forward", "js_low_var", "alpha", "reverse_kl"]
LADDER = [1.0, 10.0, 100.0, 1000.0]
# The frontier's cells update twice per batch, so that the PPO clip and pi_prox act.
FRONTIER_DEFAULTS = ("learner.mini_batches=2",)
DIVERGENCE_OUT, FRONTIER_OUT = Path("runs/ablate/divergence"), Path("runs/ablate/frontier")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--modes", nargs="+", metavar="SPEC",
                   help=f"runs as OBJECTIVE[:COEFF][@all|@d_exp] (default: {' '.join(DEFAULT_MODES)}; with "
                   f"--frontier {' '.join(FRONTIER_MODES)})")
    p.add_argument("--coeffs", type=float, nargs="+",
                   help="coefficients for every run with a divergence and no coefficient of its own "
                   "(default: each objective's reference values)")
    p.add_argument("--frontier", action="store_true",
                   help="every run over a ladder of coefficients; the summary adds the Pass@k-Pass@1 frontier "
                   f"(default --output {FRONTIER_OUT})")
    p.add_argument("--ladder", type=float, nargs="+", default=LADDER, metavar="X",
                   help="with --frontier: multiples of each objective's reference coefficient (default: %(default)s)")
    p.add_argument("--shares", type=float, nargs="+", default=[], metavar="SHARE",
                   help="with --frontier: reference samples' shares of the batch for the --share-runs")
    p.add_argument("--share-runs", nargs="+", default=[], metavar="SPEC",
                   help="with --frontier: runs (OBJECTIVE:COEFF, with a reference pool) tried at every --shares")
    add_common_arguments(p, str(DIVERGENCE_OUT))


def main(args: argparse.Namespace) -> int:
    if not args.frontier:
        if args.shares or args.share_runs:
            return fail("--shares and --share-runs belong to --frontier")
        modes = args.modes or DEFAULT_MODES
        return run(args, lambda _spec, _cfg: divergence_sweep(modes, args.coeffs, args.seeds))
    if args.coeffs:
        return fail("--coeffs does not apply to --frontier: give --ladder, or OBJECTIVE:COEFF runs")
    if bool(args.shares) != bool(args.share_runs):
        return fail("--shares and --share-runs go together")
    if args.output == DIVERGENCE_OUT:
        args.output = FRONTIER_OUT
    modes = args.modes or FRONTIER_MODES
    return run(args, lambda _spec, cfg: frontier_sweep(modes, args.ladder, args.seeds, cfg.replay.reference_ratio,
                                                        args.shares, args.share_runs), FRONTIER_DEFAULTS)
