"""`dph-async score`: score a file of responses with the verifiable rewards and summarise."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dph_async.cli.commands.common import add_config_arguments, add_output_argument
from dph_async.config import load_config
from dph_async.rewards.batch_file import read_requests, scorer_failures, summarize
from dph_async.rewards.scorer import make_scorer

DESCRIPTION = """\
Score responses with the rewards registered for their data_source, in sandboxed worker processes
(or on scorer services when rewards.scorer_urls is set), and print per-source accuracy, mean score,
format rate, statuses and latency. Each row: data_source, response, reward_model.ground_truth,
extra_info (a verl dataset row plus the response). Example, on the SQL fixture:

    dph-async score examples/sql/responses.jsonl rewards.sql.db_root=examples/sql/databases

A reward of your own (docs/rewards.md, Plugins):

    dph-async score examples/custom_reward/responses.jsonl rewards.plugins=[examples/custom_reward/reward.py]
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="responses, .jsonl or .parquet")
    add_config_arguments(parser, "config overrides (rewards.*)")
    add_output_argument(parser, "write one JSON result per row here", out_alias=True, type=Path)


def main(args: argparse.Namespace) -> int:
    cfg = load_config(args.preset, args.overrides).rewards

    requests = read_requests(args.file)
    start = time.perf_counter()
    with make_scorer(cfg) as scorer:
        results = scorer.score_many(requests)
    elapsed = time.perf_counter() - start
    if args.output:
        with open(args.output, "w") as f:
            for i, result in enumerate(results):
                f.write(json.dumps({"index": i, **asdict(result)}) + "\n")

    summary = summarize(requests, results)
    table = Table(title=f"{args.file}: {len(results)} responses in {elapsed:.2f} s")
    for column in ("data_source", "n", "accuracy", "mean score", "format ok", "p50 ms", "p95 ms"):
        table.add_column(column, justify="left" if column == "data_source" else "right")
    for row in summary:
        table.add_row(row.data_source, str(row.n), f"{row.accuracy:.3f}", f"{row.mean_score:.3f}",
                      f"{row.format_ok:.3f}", f"{row.latency_p50_s * 1e3:.1f}",
                      f"{row.latency_p95_s * 1e3:.1f}")
    console = Console()
    console.print(table)
    for row in summary:
        counts = ", ".join(f"{k} {v}" for k, v in row.statuses.items())
        console.print(f"statuses {row.data_source}: {counts}")
    for detail, n in scorer_failures(results):
        print(f"error: {n} of {len(results)} responses not scored: {detail}", file=sys.stderr)
    return 0
