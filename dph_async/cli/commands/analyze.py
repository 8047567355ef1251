"""`dph-async analyze`: how the weights moved, matrix by matrix, from a base model to trained checkpoints."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.common import add_output_argument, fail
from dph_async.progress import console
from dph_async.tools.analyze.checkpoints import default_out, expand

DESCRIPTION = """\
Compare every weight matrix (attention q/k/v/o, MLP gate/up/down, embeddings, LM head) of one or more
trained checkpoints with the base model's, using float64 SVDs:
  - the singular value spectra of base, trained, and of the update trained - base;
  - the principal angles between the base's and the trained matrix's top-k singular subspaces, left
    (column space) and right (row space);
  - the relative change ||W - W_base|| / ||W_base||, the change of the top-k singular values, the share
    of the update inside the base's top-k subspaces (and of it, the share that only rescales the base's
    directions), the update's stable rank.
Per layer and type, with means per type, a summary table (analysis.md), every number (analysis.json),
all singular values (spectra.npz) and plots (plots/). Several checkpoints are a trajectory: give them
in order, or give an RL run directory (rl/<run>), which stands for its learner checkpoints in version
order (read directly, no export needed) followed by its final model.

BASE and TRAINED: a Hugging Face model directory, a learner checkpoint (rl/<run>/checkpoints/v<N>), or
(TRAINED only) an RL run directory. Output goes to --output, by default <run>/analysis/<name> where <run> is
the run directory holding TRAINED (the one with config.yaml), else runs/analysis/<name>.

examples:
  dph-async analyze runs/default/base_model runs/default/rl/js_low_var/final_model
  dph-async analyze runs/default/base_model runs/default/rl/js_low_var          # the run's trajectory
  dph-async analyze base_model rl/grpo/final_model rl/forward/final_model --top-k 32 -o runs/cmp
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("base", type=Path, help="the base model (pi_0)")
    p.add_argument("trained", type=Path, nargs="+", help="trained checkpoints, in order (a trajectory)")
    p.add_argument("--top-k", type=int, default=16, help="size of the compared singular subspaces, capped per "
                   "matrix at its smaller side (default: %(default)s)")
    add_output_argument(p, "output directory (default: <run>/analysis/<name>)", out_alias=True, type=Path)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the SVDs; more pays off only for "
                   "large matrices on idle cores (default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    # heavy (torch: about 2 s): on running, so that --help is quick
    import torch

    from dph_async.tools.analyze.drift import analyze
    from dph_async.tools.analyze.report import write_analysis
    torch.set_num_threads(max(1, args.threads))
    try:
        base = expand(args.base)
        if len(base) != 1:
            raise ValueError(f"BASE {args.base} is an RL run directory; give one model or checkpoint")
        checkpoints = [c for path in args.trained for c in expand(path)]
        labels = [c.label for c in checkpoints]
        if len(set(labels)) < len(labels):
            raise ValueError(f"TRAINED names a checkpoint twice: {', '.join(labels)}")
        if args.top_k < 1:
            raise ValueError(f"--top-k must be >= 1, got {args.top_k}")
        out = args.output or default_out(args.trained, "analysis")
        console.print(f"analysing {len(checkpoints)} checkpoint(s) against {base[0].path}: {', '.join(labels)}")
        report = write_analysis(analyze(base[0], checkpoints, args.top_k), out)
    except (FileNotFoundError, ValueError, KeyError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted")
        return 130
    console.print(f"report: {report} (plots in {out / 'plots'})")
    return 0
