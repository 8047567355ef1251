"""`dph-async run`: the whole DPH-RL pipeline."""

from __future__ import annotations

import argparse

from dph_async.cli.commands.common import add_config_arguments, add_output_argument, guarded
from dph_async.config import load_config

DESCRIPTION = """\
Run the whole DPH-RL pipeline. With no arguments it uses the embedded default, made locally from a
seed (a procedural digit task with an out-of-domain rule variant, a character tokenizer, a tiny
Llama): supervised warm start to a base policy pi_0 -> pre-sampling (k samples per prompt; prompts
pi_0 always solves become the preserved reference pool D_pef with their pi_0 log-probs, the rest are
D_exp) -> asynchronous RL with vLLM actors and a DeepSpeed learner under Ray -> evaluation (greedy
accuracy and unbiased Pass@k for k = 1..16, in-domain and OOD, base against trained) -> a report
(summary.json, summary.md, plots/, an offline wandb run) in the output directory.

Re-running the same command resumes: finished stages are skipped and RL continues from its newest
checkpoint.

examples:
  dph-async run                                          # the embedded default
  dph-async run --compare grpo,grpo@d_exp,js_low_var     # the paper-style comparison, with its control
  dph-async run --compare forward:0.05,js_low_var:0.05   # objectives at chosen coefficients
  dph-async run --preset forward learner.steps=200 replay.max_staleness=2
  dph-async run --model path/to/hf_model --data train.parquet task.test_data.bird_dev=dev.parquet
  dph-async run --model M --data D task.test_data.dev=E --preset grpo learner.lr=1e-4   # any order
  dph-async run --model M --data D rewards.plugins=[my_reward.py]   # a reward of your own (docs/rewards.md)
  dph-async run mode=sync                                # the synchronous GRPO baseline, same code
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, "dotted config overrides, e.g. learner.loss.objective=forward")
    add_output_argument(p, "run directory (default: output_dir of the config, runs/default)")
    p.add_argument("--model", help="a Hugging Face causal-LM directory (sets model.path)")
    p.add_argument("--data", help="training prompts: parquet in the verl row format (sets task.data)")
    p.add_argument("--compare", help="comma-separated runs trained from the same base, each "
                   "OBJECTIVE[:COEFF][@all|@d_exp]: grpo, dapo, reverse_kl, forward, js_low_var, js, alpha, "
                   "dpo, ipo, dpo_rev_kl "
                   "(without :COEFF, the objective's reference coefficient; @d_exp trains on D_exp only)")


def main(args: argparse.Namespace) -> int:
    flags = {"output_dir": args.output, "model.path": args.model, "task.data": args.data}
    cfg = load_config(args.preset, [*args.overrides, *(f"{k}={v}" for k, v in flags.items() if v)])
    compare = [m.strip() for m in args.compare.split(",") if m.strip()] if args.compare else None
    # Heavy (Ray and the pipeline, ~1 s): imported once the config is valid, so that `run --help` and a
    # config error come back at once.
    from dph_async.pipeline.stages import run_pipeline

    return guarded(lambda: run_pipeline(cfg, compare), "processes stopped; run the same command again to resume")
