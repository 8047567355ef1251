"""`dph-async ablate samplers`: the DPO pair samplers x seeds, from one base model."""

from __future__ import annotations

import argparse

from dph_async.cli.ablate_common import add_common_arguments, run
from dph_async.samplers import SAMPLERS
from dph_async.tools.ablate.cells import samplers_sweep

DESCRIPTION = """\
A grid of online-DPO runs (the `dpo` preset unless --preset says otherwise) that differ only in
actors.sampler, the distribution the actors sample from: online (pi_theta), ref (the frozen pi_0),
gshf (half each), mixp (the samplers paper's logit mixtures; actors/mixture.py), each with several
seeds, all from the same base model. The summary gives greedy accuracy, Pass@k and distinct correct
answers of each sampler's final model, mean ± standard error over seeds, with training curves.

Resumable like the other sweeps: finished cells are never rerun.

examples:
  dph-async ablate samplers                                # 4 samplers x 3 seeds, DPO
  dph-async ablate samplers --samplers online mixp --seeds 0 1 2 3 4
  dph-async ablate samplers learner.loss.objective=ipo     # IPO instead of DPO
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--samplers", nargs="+", default=list(SAMPLERS), choices=SAMPLERS,
                   help=f"actors.sampler values (default: {' '.join(SAMPLERS)})")
    add_common_arguments(p, "runs/ablate/samplers")
    p.set_defaults(preset="dpo")


def main(args: argparse.Namespace) -> int:
    return run(args, lambda mode, _cfg: samplers_sweep(args.samplers, args.seeds, mode))
