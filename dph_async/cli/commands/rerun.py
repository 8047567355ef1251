"""`dph-async rerun`: re-execute a recorded run's learner, bitwise or as a counterfactual."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.common import add_config_arguments, add_output_argument, fail
from dph_async.learner.recording import RUN_INFO, RecordingError
from dph_async.pipeline.rerun_report import verdict
from dph_async.progress import console
from dph_async.safe_files import UnsafeFile, output_dir

DESCRIPTION = """\
Every RL run records the batches its learner trained on (rl/<mode>/batches.rec). `rerun` builds the
learner as the run built it (its config, model, seed and threads), starts from pi_0 (or --from a
checkpoint of the run) and trains on the recorded batches in order: no actors, engines, replay or Ray.

With no overrides it checks the run repeats: every logged metric but the wall-clock ones, and the
weights at each checkpoint of the run and at its final model, must equal the run's bit for bit (on
the machine that ran it). Exit status 1 when one does not.

With learner overrides (learner.*: objective, coefficient, lr, correction, mini-batches...) it trains
a counterfactual learner on exactly the same data, into its own directory (metrics.jsonl,
final_model/), and reports its metrics beside the run's and the distance of its weights from the
run's. --diagnose STEP also writes, before that step trains, each group's contribution to the norm of
the step's gradient and the tokens of largest importance weight (diagnose_vSTEP.json).

Output in -o/--output (default RUN_DIR/rerun/<overrides or "same">): report.md, report.json, metrics.jsonl.
A symbolic link on the way down from the run directory to it, or in place of a file it writes, is
refused, never followed: a run directory may be a stranger's.

examples:
  dph-async rerun runs/default/rl/js_low_var                       # is it bitwise the run?
  dph-async rerun runs/default/rl/js_low_var learner.loss.coeff=0.5  # the same data, another coefficient
  dph-async rerun runs/default/rl/grpo --until 40 --diagnose 37     # a spike at step 37, looked into
  dph-async rerun runs/default/rl/grpo --from 100 learner.lr=1e-4   # from the run's checkpoint v100
"""
# Learner keys that only the loop reads (batch size, publishing, checkpoints): a rerun has no loop.
LOOP_ONLY = ("steps", "groups_per_step", "sync_every", "weight_bucket_mb", "weight_transport", "checkpoint_every",
             "keep_checkpoints", "keep_versions", "record_batches")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=Path, help="the RL run's directory (rl/<mode>), or a run directory with one mode")
    add_config_arguments(p, "learner overrides for a counterfactual (learner.*)")
    p.add_argument("--from", dest="start", type=int, default=0, metavar="STEP",
                   help="start from the run's checkpoint of this version (default: pi_0, version 0)")
    p.add_argument("--until", type=int, metavar="STEP", help="stop once the learner reaches this version")
    p.add_argument("--diagnose", type=int, metavar="STEP", help="diagnose the step taken at this version")
    p.add_argument("--top-tokens", type=int, default=20, help="tokens listed by --diagnose (default: %(default)s)")
    add_output_argument(p, "output directory (default: RUN_DIR/rerun/<label>)", type=Path)


def override_problem(overrides: list[str]) -> str | None:
    for item in overrides:
        key = item.split("=", 1)[0]
        if not key.startswith("learner."):
            return f"{item}: a rerun changes only the learner (learner.* keys); the data is the run's"
        if key.split(".")[1] in LOOP_ONLY:
            return f"{item}: {key} has no effect on a rerun (no loop: the batches are the recorded ones)"
    return None


def run_directory(path: Path) -> Path:
    """`path` itself if it is a recorded RL run, else its one recorded mode under rl/."""
    if (path / RUN_INFO).is_file():
        return path
    modes = sorted(p.parent for p in path.glob(f"rl/*/{RUN_INFO}"))
    if len(modes) == 1:
        return modes[0]
    if modes:
        raise FileNotFoundError(f"{path} holds {len(modes)} recorded runs: name one of "
                                + ", ".join(str(m) for m in modes))
    raise FileNotFoundError(f"{path}: no recorded RL run there ({RUN_INFO} not found, nor rl/<mode>/{RUN_INFO})")


def _label(overrides: list[str]) -> str:
    return "-".join(o.removeprefix("learner.").replace("=", "-").replace("/", "_") for o in overrides) or "same"


def output_path(rl_dir: Path, output: Path | None, overrides: list[str]) -> Path:
    """The output directory, made: -o/--output, or RUN_DIR/rerun/<label>. Below the run directory, which
    may be a stranger's, no directory on the way may be a link (UnsafeFile): the output stays in the run."""
    out = output or rl_dir / "rerun" / _label(overrides)
    return output_dir(rl_dir if out.is_relative_to(rl_dir) else out.parent, out)


def main(args: argparse.Namespace) -> int:
    # heavy (torch, transformers, DeepSpeed: about 4 s): on running, so that --help is quick
    from transformers.utils import logging as hf_logging

    from dph_async.pipeline.rerun import rerun
    if args.preset != "default":
        return fail("--preset: a rerun takes the run's own config; give learner overrides instead")
    if (problem := override_problem(args.overrides)) is not None:
        return fail(problem)
    if args.start < 0 or (args.until is not None and args.until <= args.start):
        return fail(f"--until ({args.until}) must be past --from ({args.start}), which must be >= 0")
    if args.diagnose is not None and not args.start <= args.diagnose < (args.until or 1 << 62):
        return fail(f"--diagnose {args.diagnose}: not a step between --from and --until")
    try:
        rl_dir = run_directory(args.run_dir)
        out = output_path(rl_dir, args.output, args.overrides)
    except (FileNotFoundError, UnsafeFile) as e:
        return fail(str(e))

    hf_logging.disable_progress_bar()  # the command's output is its verdict
    try:
        report = rerun(rl_dir, out, args.overrides, start=args.start, until=args.until, diagnose=args.diagnose,
                       top_tokens=args.top_tokens)
    except (RecordingError, FileNotFoundError, UnsafeFile) as e:
        return fail(str(e))
    if not report.steps:
        return fail(f"no step re-executed from version {report.start}: {report.stopped}")
    console.print(f"{verdict(report)}\nreport: {out / 'report.md'}")
    if args.diagnose is not None and not (out / f"diagnose_v{args.diagnose}.json").is_file():
        return fail(f"--diagnose {args.diagnose}: the rerun stopped at version {report.end} ({report.stopped})")
    return 1 if not report.counterfactual and report.differs else 0
