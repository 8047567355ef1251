"""`dph-async bench scorer`: reward throughput and latency, local worker pool against the HTTP service."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dph_async.cli.commands.common import add_output_argument, write_cells
from dph_async.tools.bench import scorer as bench
from dph_async.tools.bench.machine import machine

DESCRIPTION = """\
Requests/s and call-latency percentiles of scoring SQL (the local fixture) and math (math-verify)
responses at several numbers of concurrent callers (one request per call), plus one caller sending
batches, for the local worker pool and for `dph-async serve scorer` with the same number of workers.
Writes JSON and prints a markdown table (docs/benchmarks.md, section Scorer). Example:

    dph-async bench scorer --workers 2 --concurrency 1 4 16 64 --seconds 3
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="concurrent callers (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=64,
                        help="requests per call for the batched row; 1 leaves it out (default: %(default)s)")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="duration of each cell (default: %(default)s)")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="per-request deadline (default: %(default)s)")
    parser.add_argument("--backends", nargs="+", choices=["pool", "http"], default=["pool", "http"])
    parser.add_argument("--workloads", nargs="+", choices=["sql", "math"], default=["sql", "math"])
    add_output_argument(parser, "JSON results (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/scorer.json"))


def main(args: argparse.Namespace) -> int:
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "command": "dph-async " + " ".join(sys.argv[1:]),
            "machine": machine(), "workers": args.workers}
    cells = bench.run(args.workers, args.concurrency, args.batch, args.seconds, args.timeout_s,
                      args.backends, args.workloads)
    return write_cells(args.output, meta, cells, bench.markdown(cells))
