"""`dph-async bench`: RL throughput, sync against async, on a named workload."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dph_async.cli.commands.common import add_output_argument, fail, guarded
from dph_async.config import load_config
from dph_async.progress import console
from dph_async.tools.bench.machine import machine
from dph_async.tools.bench.pipeline import BENCH_DEFAULTS, run_bench
from dph_async.tools.bench.pipeline_report import write_report

DESCRIPTION = """\
Benchmark the RL pipeline on a workload: the embedded default, or --model/--data. Both runs start
from the same base model and do the same work (learner.steps x learner.groups_per_step prompts x
sampling.n samples): first in sync mode (generate a batch, train, publish, repeat), then in async
mode (actors generate while the learner trains, within replay.max_staleness). In both, each batch
is split evenly over the actors (actors.max_inflight_prompts at most groups_per_step / actors).
With --actors, more async runs at other actor counts check the scaling model (docs/scaling.md). On
a shared machine, --repeats runs several sync/async pairs (alternating which goes first) and
reports medians.

Reported over each run's steady state (the first --skip learner steps are left out): seconds per
step, samples and tokens per second, per-component tokens/s (actor generation, learner training),
busy and waiting shares of the learner and of every actor, weight-sync time and bytes, rollout and
weight transport rates, CPU cores used per component, and the async speedup against the ideal
(g + t) / max(g, t) from the sync run's generation (g) and training (t) time per step; and against
that ideal with the CPU floor (a step's CPU work over the cores), which is what a machine whose
cores the actors and the learner share can reach. docs/benchmarks.md explains the method.

Output in --output: bench.json, bench.md, plots/timeline.png (who was busy when), plots/busy.png,
plots/scaling.png, and each run's directory under rl/. Finished runs are kept: running the same
command again only redoes the report (--fresh starts over).

Sub-benchmarks: `dph-async bench kernels`, `bench transport`, `bench scorer` (see their --help).

examples:
  dph-async bench                                   # embedded default, 100 steps per mode
  dph-async bench --repeats 3 --actors 1 2 3        # 3 sync/async pairs; scaling at 1 and 3 actors
  dph-async bench replay.max_staleness=2 learner.groups_per_step=32 -o runs/bench/eta2
  dph-async bench --model path/to/hf_model --data train.parquet --steps 20 -o runs/bench/qwen
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_output_argument(p, "output directory (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/pipeline"))
    p.add_argument("--steps", type=int, help="learner steps per run (default: 100, or learner.steps=...)")
    p.add_argument("--skip", type=int, default=5, help="first learner steps left out of the steady state "
                   "(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1, help="sync/async pairs, their order alternating; the "
                   "comparison is the median over pairs (default: %(default)s)")
    p.add_argument("--actors", type=int, nargs="+", default=[], metavar="N",
                   help="also run async with these actor counts, for the scaling check (e.g. 1 2 3)")
    p.add_argument("--model", help="a Hugging Face causal-LM directory (sets model.path)")
    p.add_argument("--data", help="training prompts: parquet in the verl row format (sets task.data)")
    p.add_argument("--preset", "--config", dest="preset", default="default",
                   help="a preset name or a YAML file (default: %(default)s)")
    # No KEY=VALUE positional next to the subcommands: dph_async.cli.main takes bare overrides out first.
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override; a bare KEY=VALUE anywhere does the same")
    p.add_argument("--fresh", action="store_true", help="delete earlier runs in --output and measure again")


def main(args: argparse.Namespace) -> int:
    flags = {"learner.steps": args.steps, "model.path": args.model, "task.data": args.data}
    cfg = load_config(args.preset, [*BENCH_DEFAULTS, *args.overrides, f"output_dir={args.output}",
                                    *(f"{k}={v}" for k, v in flags.items() if v is not None)])
    if cfg.learner.steps <= args.skip:
        return fail(f"learner.steps ({cfg.learner.steps}) must be more than --skip ({args.skip})")
    if args.fresh and (args.output / "rl").exists():
        shutil.rmtree(args.output / "rl")

    def work() -> None:
        res = run_bench(cfg, args.output, args.actors, args.skip, machine(), args.repeats)
        write_report(res, args.output)
        c = res.comparison
        bound = f"; CPU-bound ideal {c.ideal_cpu_bound:.2f}x -> {c.of_ideal_cpu_bound:.0%}" if c.ideal_cpu_bound else ""
        console.print(f"async speedup {c.speedup:.2f}x; ideal (g+t)/max(g,t) {c.ideal:.2f}x -> {c.of_ideal:.0%} of "
                      f"ideal{bound}", highlight=False)
        console.print(f"report: {args.output / 'bench.md'}")

    return guarded(work, "finished runs are kept; the same command goes on from there")
