"""`dph-async eval`: greedy accuracy, Pass@k and diversity of a model on test sets."""

from __future__ import annotations

import argparse
from pathlib import Path

from dph_async.cli.commands.common import add_config_arguments, add_output_argument
from dph_async.config import load_config
from dph_async.pipeline.inputs import check_datasets, check_model_dir
from dph_async.pipeline.preflight import preflight
from dph_async.pipeline.report import print_tables
from dph_async.runtime.evaluate import evaluate

DESCRIPTION = """\
Evaluate one model on one or more test sets (parquet in the verl row format). For each prompt: one
greedy answer, and eval.k_max samples at eval.temperature, scored by the reward registered for the
row's data_source. Reports greedy accuracy, unbiased Pass@k for every k up to eval.k_max, and the
number of distinct correct answers per prompt.

examples:
  dph-async eval --model runs/default/rl/js_low_var/final_model --data runs/default/data/test.parquet
  dph-async eval --model m --data dev=bird_dev.parquet --data spider=spider_dev.parquet -o results.json
  dph-async eval --model m --data examples/sql/sql_fixture.parquet rewards.sql.db_root=examples/sql/databases
  dph-async eval --model m --data my_test.parquet rewards.plugins=[my_reward.py]   # a reward of your own
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p)
    p.add_argument("--model", required=True, help="a Hugging Face causal-LM directory")
    p.add_argument("--data", required=True, action="append", metavar="[NAME=]PATH",
                   help="a test set; repeat for several (NAME defaults to the file's stem)")
    add_output_argument(p, "write the results as JSON here")


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, [*args.overrides, f"model.path={args.model}"])
    tests = {}
    for item in args.data:
        name, _, path = item.rpartition("=")
        tests[name or Path(path).stem] = Path(path)

    model = check_model_dir(args.model, "--model")
    preflight(cfg)  # the model against what the engine runs, before any process starts
    check_datasets({f"--data {name}": path for name, path in tests.items()}, cfg.rewards)

    results = evaluate(cfg, model, tests, Path(args.output) if args.output else None)
    print_tables({model.name: results})
    return 0
