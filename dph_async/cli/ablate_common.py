"""What `dph-async ablate staleness` and `ablate divergence` share: arguments, defaults, the run."""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable
from pathlib import Path

from dph_async.cli.commands.common import add_config_arguments, add_output_argument, fail, guarded
from dph_async.config import RunConfig, load_config
from dph_async.pipeline.specs import RunSpec
from dph_async.progress import console
from dph_async.tools.ablate.report import write_summary
from dph_async.tools.ablate.sweep import run_sweep

# Applied before the user's overrides: cells cheap enough for a grid on a small machine (docs/ablations.md).
SWEEP_DEFAULTS = ("learner.steps=100", "eval.max_prompts=100", "logging.wandb_mode=disabled")


def add_common_arguments(p: argparse.ArgumentParser, out: str) -> None:
    add_config_arguments(p, "dotted config overrides for every cell")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds per cell (default: 0 1 2)")
    p.add_argument("--steps", type=int, help="learner steps per cell (default: 100, or learner.steps=...)")
    p.add_argument("--eval-points", type=int, default=3,
                   help="evaluations along each run, the last of the final model (default: %(default)s)")
    add_output_argument(p, "sweep directory (default: %(default)s)", out_alias=True, type=Path, default=Path(out))
    p.add_argument("--model", help="a Hugging Face causal-LM directory (sets model.path)")
    p.add_argument("--data", help="training prompts: parquet in the verl row format (sets task.data)")
    p.add_argument("--fresh", action="store_true", help="delete the finished cells in --output and run them again "
                   "(with a different base config, the shared base model and pre-sampling too)")
    p.add_argument("--report-only", action="store_true", help="only rewrite the summary from the finished cells")


def run(args: argparse.Namespace, make_sweep: Callable[[str, RunConfig], object], defaults: tuple[str, ...] = ()
        ) -> int:
    """Build the sweep (make_sweep gets the base config's run spec and the config), run it, write the
    report. `defaults`: overrides of the sweep's own, before the user's."""
    flags = {"learner.steps": args.steps, "model.path": args.model, "task.data": args.data}
    overrides = [*SWEEP_DEFAULTS, *defaults, *args.overrides, f"output_dir={args.output}",
                 *(f"{k}={v}" for k, v in flags.items() if v is not None)]
    cfg = load_config(args.preset, overrides)

    if args.eval_points < 1:
        return fail(f"--eval-points must be >= 1 (got {args.eval_points})")
    try:
        sweep = make_sweep(RunSpec.of(cfg).name, cfg)
    except ValueError as e:
        return fail(str(e))

    def work() -> None:
        if args.fresh and (args.output / "rl").exists():
            shutil.rmtree(args.output / "rl")
        if not args.report_only:
            run_sweep(cfg, sweep, args.output, args.eval_points, fresh=args.fresh)
        write_summary(args.output)
        console.print(f"report: {args.output / 'summary.md'}")

    return guarded(work, "finished cells are kept; the same command goes on from there")
