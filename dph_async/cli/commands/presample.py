"""`dph-async presample`: split training prompts into D_pef and D_exp by sampling the base policy."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.common import add_config_arguments, add_output_argument
from dph_async.config import load_config
from dph_async.pipeline.inputs import check_datasets, check_model_dir
from dph_async.pipeline.preflight import preflight
from dph_async.progress import console

DESCRIPTION = """\
Pre-sampling, the first stage of DPH-RL, on its own. The base model answers every training prompt k
times (presample.k). Prompts it always solves (presample.min_correct of k, default all) form D_pef:
their correct samples are written with their per-token pi_0 log-probs as the reference pool. The
rest form D_exp, the RL training set, in the same verl row format as the input.

Outputs in OUT: reference_pool.parquet, d_exp.parquet, samples.parquet (every sample with its
score), summary.json.

examples:
  dph-async presample --model runs/default/base_model --data runs/default/data/train.parquet -o presample
  dph-async presample --model my_model --data bird_train.parquet -o out presample.k=16 rewards.sql.db_root=dbs
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--model", required=True, help="the base model pi_0 (a Hugging Face model directory)")
    p.add_argument("--data", required=True, help="training prompts, parquet in the verl row format")
    add_output_argument(p, "output directory", required=True)


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, [*args.overrides, f"model.path={args.model}", f"task.data={args.data}"])

    model = check_model_dir(args.model, "--model")
    preflight(cfg)  # the model against what the engine runs, before any process starts
    check_datasets({"--data": args.data}, cfg.rewards)
    # Heavy (torch and transformers, ~5 s): imported once the inputs are checked, so that a wrong --model
    # or --data is one line at once.
    from dph_async.runtime.presample import presample

    s = presample(cfg, model, Path(args.data), Path(args.output))
    console.print(f"{s.prompts} prompts x {s.samples_per_prompt} samples (accuracy {s.sample_accuracy:.1%}): "
                  f"D_pef {s.d_pef_prompts} prompts ({s.reference_samples} reference samples), "
                  f"D_exp {s.d_exp_prompts} prompts -> {args.output}")
    return 0
