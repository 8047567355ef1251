"""`dph-async eval`: greedy accuracy, Pass@k and diversity of a model on test sets."""

from __future__ import annotations

import argparse

NAME = "eval"
HELP = "evaluate a model: greedy accuracy, unbiased Pass@k (k = 1..eval.k_max), distinct correct answers"
DESCRIPTION = """\
Evaluate one model on one or more test sets (parquet in the verl row format). For each prompt: one
greedy answer, and eval.k_max samples at eval.temperature, scored by the reward registered for the
row's data_source. Reports greedy accuracy, unbiased Pass@k for every k up to eval.k_max, and the
number of distinct correct answers per prompt.

examples:
  dph-async eval --model runs/default/rl/js_low_var/final_model --data runs/default/data/test.parquet
  dph-async eval --model m --data dev=bird_dev.parquet --data spider=spider_dev.parquet -o results.json
  dph-async eval --model m --data examples/sql/sql_fixture.parquet rewards.sql.db_root=examples/sql/databases
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    p.add_argument("--model", required=True, help="a Hugging Face causal-LM directory")
    p.add_argument("--data", required=True, action="append", metavar="[NAME=]PATH",
                   help="a test set; repeat for several (NAME defaults to the file's stem)")
    p.add_argument("--output", "-o", help="write the results as JSON here")
    p.add_argument("--preset", default="default", help="a preset name or a YAML file")


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from dph_async.app.commands.common import load_cli_config

    cfg = load_cli_config(args.preset, args.overrides)
    if cfg is None:
        return 2
    from dph_async.app.evaluate import evaluate
    from dph_async.app.progress import console
    from dph_async.app.report import print_tables
    from dph_async.tasks.dataset import DatasetError

    tests = {}
    for item in args.data:
        name, _, path = item.rpartition("=")
        tests[name or Path(path).stem] = Path(path)
    model = Path(args.model)
    if not (model / "config.json").is_file():
        console.print(f"[red]error:[/red] --model {model} is not a Hugging Face model directory (no config.json)")
        return 2
    try:
        results = evaluate(cfg, model, tests, Path(args.output) if args.output else None)
    except DatasetError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    print_tables({model.name: results})
    return 0
