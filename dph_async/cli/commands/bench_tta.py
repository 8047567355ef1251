"""`dph-async bench tta`: wall-clock to a held-out Pass@1, async against sync and TRL."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.bench_peer import add_setup_arguments
from dph_async.cli.commands.common import add_output_argument, fail, guarded
from dph_async.config import load_config
from dph_async.errors import UserError
from dph_async.progress import console
from dph_async.safe_files import output_dir, write_output
from dph_async.tools.bench.tta_data import DEFAULT_GAIN, SPLIT, SYSTEMS, load

# The embedded task, on which GRPO raises held-out Pass@1 (docs/benchmarks.md, Time to accuracy);
# STRIDE gives the long-tailed lengths, whose pi_0 does not yet learn held out.
TTA_DEFAULTS = ("logging.wandb_mode=disabled", "learner.steps=200", "eval.max_prompts=100")
STRIDE = ("task.name=stride", "sampling.max_tokens=400", "model.max_model_len=411")

DESCRIPTION = """\
Time to accuracy: how long each system takes, on the wall clock, to bring the same pi_0 to a
held-out Pass@1 target. The same work on every side (learner.steps steps of learner.groups_per_step
prompts x sampling.n completions, the same prompts, lr, temperature and max tokens):
  async   dph-async as configured (vLLM actors generating while the learner trains, within eta)
  sync    dph-async with mode=sync (generate the batch, train, publish, repeat)
  trl     TRL's GRPOTrainer (HF generate, fp32, beta 0, no gradient checkpointing), installed on
          first use into its own environment under --cache, as `bench peer` does
Every run keeps its weights every --every steps and at the last, with its clock then (seconds since
its first generation began); the project's evaluator then scores each kept version on the same
held-out prompts (eval.max_prompts x eval.k_max samples, the same seed), off the clock. Seeds rotate
the systems' order.

Time to target: the first evaluation at or above --target, interpolated linearly from the one
before; a run that never gets there is censored and counted apart. async's speed-up over a peer is
t_peer / t_async per seed: the geometric mean over the seeds where both reached it, with its 95%
interval. The default workload is the embedded task with plain GRPO, 200 steps; --stride takes
the stride task instead (answers of 2 to 100 terms, a long tail: docs/decisions.md), on which
pi_0's held-out Pass@1 does not yet rise (docs/benchmarks.md).

Output in --output: tta.json (every curve), tta.md (the tables), plots/tta.png (Pass@1 against the
wall clock, one colour per system), rl/ (dph-async's runs), peers/ (TRL's), eval/. Finished runs
and evaluations are kept: the same command again runs only what is missing; --report-only redoes the
report (another --target included) from tta.json.

examples:
  dph-async bench tta                                  # embedded task, 5 seeds, async/sync/TRL
  dph-async bench tta --stride -o runs/bench/tta-stride  # the long-tailed lengths
  dph-async bench tta --seeds 0 1 --systems async sync --steps 60
  dph-async bench tta --report-only --target 0.30
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_output_argument(p, "output directory (default: %(default)s)", type=Path, default=Path("runs/bench/tta"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="RL seeds (default: 0 1 2 3 4)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS), help="which systems (default: all)")
    p.add_argument("--steps", type=int, help="steps per run (default: 200, or learner.steps=...)")
    p.add_argument("--stride", action="store_true", help="the stride task: " + " ".join(STRIDE))
    p.add_argument("--every", type=int, default=20, help="steps between kept, evaluated versions "
                   "(default: %(default)s)")
    p.add_argument("--target", type=float, help="held-out Pass@1 to reach (default: pi_0's plus --gain)")
    p.add_argument("--gain", type=float, default=DEFAULT_GAIN, help="the default target's rise over pi_0 "
                   "(default: %(default)s)")
    add_setup_arguments(p)
    p.add_argument("--report-only", action="store_true", help="redo the report from --output/tta.json")
    p.add_argument("--fresh", action="store_true", help="delete earlier runs in --output and measure again")


def main(args: argparse.Namespace) -> int:
    if args.every < 1:
        return fail(f"--every must be >= 1 (got {args.every})")
    if args.target is not None and not 0 < args.target <= 1:
        return fail(f"--target is a Pass@1 in (0, 1] (got {args.target})")
    if not 0 < args.gain < 1:
        return fail(f"--gain is a rise of Pass@1 in (0, 1) (got {args.gain})")
    for name in ("seeds", "systems"):
        given = getattr(args, name)
        if len(set(given)) != len(given):
            return fail(f"--{name} names one twice: {' '.join(map(str, given))}")
    summary = args.output / "tta.json"
    if args.report_only:
        if not summary.is_file():
            return fail(f"--report-only: no {summary} (run the bench first)")
        return _report(args, summary)
    flags = {"learner.steps": args.steps}
    task = STRIDE if args.stride else ()
    cfg = load_config(args.preset, [*TTA_DEFAULTS, *task, *args.overrides, f"output_dir={args.output}",
                                    *(f"{k}={v}" for k, v in flags.items() if v is not None)])
    if cfg.model.path is not None and SPLIT not in cfg.task.test_data:
        return fail(f"the target is a held-out Pass@1 on the test split named {SPLIT}: give its prompts as "
                    f"task.test_data.{SPLIT}=PATH (given: {', '.join(cfg.task.test_data) or 'none'})")
    if cfg.learner.steps < args.every:
        return fail(f"learner.steps ({cfg.learner.steps}) is fewer than --every ({args.every}): nothing would be "
                    "evaluated along the run")

    def work() -> None:
        from dph_async.tools.bench import tta  # heavy: Ray, torch

        if args.fresh:
            tta.clear(args.output)
        tta.run(cfg, args.output, args.seeds, args.systems, args.every, args.cache,
                log=lambda m: console.print(m, highlight=False))
        _report(args, summary)

    return guarded(work, "finished runs and evaluations are kept; the same command goes on from there")


def _report(args: argparse.Namespace, summary: Path) -> int:
    from dph_async.tools.bench import tta_report  # matplotlib

    res = load(summary)
    if args.target is None:
        target = tta_report.default_target(res, args.gain)
        # the default gain is fixed before any run; another may have been chosen after seeing the curves
        how = "the default gain, fixed before any run" if args.gain == DEFAULT_GAIN else "--gain given"
        source = f"pi_0's {res.base_pass1:.3f} + {args.gain:g}, {how}"
    else:
        target, source = args.target, "given with --target"
    if target <= res.base_pass1 or target > 1:  # raised: after a run too, the command must fail
        raise UserError(f"target {target:.3f}: pi_0's held-out Pass@1 is {res.base_pass1:.3f}, so it must lie in "
                        f"({res.base_pass1:.3f}, 1]")
    write_output(args.output / "tta.md", tta_report.markdown(res, target, source))
    tta_report.plot(res, target, output_dir(args.output, args.output / "plots") / "tta.png")
    for comp in (tta_report.compare(res.curves, target, p) for p in dict.fromkeys(c.system for c in res.curves)
                 if p != tta_report.BASELINE):
        shown = comp.interval.fmt() if comp.interval else f"no interval ({comp.both} seeds reached on both sides)"
        console.print(f"t_{comp.peer} / t_async to Pass@1 {target:.3f}: {shown}; only async reached it on "
                      f"{comp.only_async} seeds, only {comp.peer} on {comp.only_peer}, neither on {comp.neither}",
                      highlight=False)
    console.print(f"report: {args.output / 'tta.md'}; figure: {args.output / 'plots' / 'tta.png'}")
    return 0
