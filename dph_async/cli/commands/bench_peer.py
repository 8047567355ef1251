"""`dph-async bench peer`: dph-async against single-process GRPO trainers on the same work."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from dph_async.cli.commands.common import add_output_argument, fail, guarded
from dph_async.config import load_config
from dph_async.pipeline.report import rate
from dph_async.pipeline.stages import validate
from dph_async.progress import console
from dph_async.tools.bench import peer
from dph_async.tools.bench.machine import machine
from dph_async.tools.bench.pipeline import BENCH_DEFAULTS

DESCRIPTION = """\
Run the same GRPO work (learner.steps steps of learner.groups_per_step prompts x sampling.n
completions, the same model, prompts, max tokens, lr and temperature) through:
  dph-async   an RL run of the config (async, actors.num_actors vLLM actors, replay.max_staleness)
  loop        a single-process loop in this repository (HF generate, the project's GRPO loss, AdamW)
  trl         TRL's GRPOTrainer (use_vllm=False, fp32, beta=0, num_iterations=1, no gradient
              checkpointing, which GRPOConfig turns on by default), installed on first
              use into its own environment under --cache (about a minute); if that fails, the bench
              says so and reports the others
Repeats rotate the order of the systems. Every side does the same training work: dph-async runs
sequences of zero advantage through the model as the peers do (learner.skip_zero_advantage=false;
its default skips them, which changes no update but saves the work: --set
learner.skip_zero_advantage=true measures that). Reported over each run's steady state (the steps after
--skip): seconds per step, completions/s, tokens/s, per-phase times (generate, reward, forward,
backward, optimizer for the loops; the learner's wait and training for dph-async, with its timeline
in rl/), the machine's load and the cores others used; then medians over the repeats and the ratio
dph-async completions/s / the peer's. The default preset is plain GRPO (what the peers do).

The limit: dph-async's CPU-seconds per step by part (the learner's training and the rest of the
learner; the engines' model forward, vLLM's bookkeeping and the rest of the actors; Ray) and each
peer's, against what the cores allow: no schedule runs a step in less than its CPU-seconds / cores,
so the report gives the most dph-async / peer its costs allow, and the same were only some parts
left. An actor's rollout loop is one thread, so a step also takes at least the busiest actor's
thread CPU-seconds (measured over the steady state), whatever the cores; the report gives that
bound too, and the same for its engine steps alone (docs/benchmarks.md).

--user-case builds a user's case and benchmarks it: a tiny HF Llama (4 layers, hidden 128, fp32,
a 16-id character tokenizer, briefly trained), verl-format parquet prompts, 16 prompts x 8 samples,
completions of at most 8 tokens, lr 1e-4 (files under --output/user_case).

Output in --output: bench.json, bench.md, rl/ (dph-async's runs), peers/ (the peers' results and logs).
Finished runs are kept: the same command again only redoes the report (--fresh starts over).

examples:
  dph-async bench peer                                  # embedded default, 5 repeats
  dph-async bench peer --user-case --output runs/bench/peer-user
  dph-async bench peer --model path/to/hf_model --data train.parquet --steps 30
  dph-async bench peer --systems loop trl --repeats 5   # the peers alone
  dph-async bench peer --set replay.max_staleness=2
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_output_argument(p, "output directory (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/peer"))
    p.add_argument("--repeats", type=int, default=5, help="runs of every system, order rotating "
                   "(default: %(default)s)")
    p.add_argument("--model", help="a Hugging Face causal-LM directory (sets model.path)")
    p.add_argument("--data", help="training prompts: parquet in the verl row format (sets task.data)")
    p.add_argument("--user-case", action="store_true", help="build and benchmark the tiny-Llama user case")
    add_run_arguments(p, steps=40, skip=5)
    p.add_argument("--fresh", action="store_true", help="delete earlier runs in --output and measure again")


def add_run_arguments(p: argparse.ArgumentParser, steps: int, skip: int) -> None:
    """What every system's run is (`bench peer`'s and `bench scale`'s): steps, the steady state, which
    systems, dph-async's preset and overrides, and where TRL's environment lives."""

    p.add_argument("--steps", type=int, default=steps, help="steps per run, every system (default: %(default)s)")
    p.add_argument("--skip", type=int, default=skip, help="first steps left out of the steady state "
                   "(default: %(default)s)")
    p.add_argument("--systems", nargs="+", choices=peer.SYSTEMS, default=list(peer.SYSTEMS), help="which systems "
                   "(default: all)")
    add_setup_arguments(p)


def add_setup_arguments(p: argparse.ArgumentParser) -> None:
    """dph-async's preset and overrides, and where TRL's environment lives (`bench tta` too)."""
    p.add_argument("--preset", default="grpo", help="a preset name or a YAML file (default: %(default)s)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted config override, repeatable; a bare KEY=VALUE anywhere does the same")
    p.add_argument("--cache", type=Path, default=Path(".cache"), help="where TRL's environment is made "
                   "(default: %(default)s)")


def main(args: argparse.Namespace) -> int:
    if args.user_case and (args.model or args.data):
        return fail("--user-case builds its own model and data: leave out --model/--data")
    if args.steps <= args.skip:
        return fail(f"--steps ({args.steps}) must be more than --skip ({args.skip})")
    if args.fresh:
        for sub in ("rl", "peers"):
            shutil.rmtree(args.output / sub, ignore_errors=True)

    def work() -> None:
        model, data, extra = args.model, args.data, []
        if args.user_case:
            with console.status("user case: writing the prompts and training the tiny Llama briefly"):
                base, train = peer.make_user_case(args.output / "user_case", seed=0)
            model, data, extra = str(base), str(train), list(peer.USER_CASE)
        flags = {"learner.steps": args.steps, "model.path": model, "task.data": data}
        cfg = load_config(args.preset, [*BENCH_DEFAULTS, *peer.SAME_WORK, *extra, *args.overrides,
                                        f"output_dir={args.output}",
                                        *(f"{k}={v}" for k, v in flags.items() if v is not None)])
        cfg = validate(cfg, [])
        res = peer.run(cfg, args.output, args.repeats, args.skip, machine(), args.systems, args.cache,
                       log=lambda m: console.print(m, highlight=False), settings=args.overrides)
        (args.output / "bench.md").write_text(peer.markdown(res))
        for system, m in res.medians.items():
            ratio = f"; dph-async / {system}: {res.ratios[system]:.2f}x" if system in res.ratios else ""
            if system in res.intervals:
                ratio += f", per repeat {res.intervals[system].fmt()}"
            per_s = rate(m["completions_per_s"])
            console.print(f"{system}: {m['step_s']:.3f} s/step, {per_s} completions/s{ratio}", highlight=False)
        console.print(f"report: {args.output / 'bench.md'}")

    return guarded(work, "finished runs are kept; the same command goes on from there")
