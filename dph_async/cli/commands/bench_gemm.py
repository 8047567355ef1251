"""`dph-async bench gemm`: the learner's linear layers through oneDNN against torch's F.linear."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from dph_async.cli.commands.common import add_output_argument, fail, write_cells
from dph_async.tools.bench.machine import machine

DESCRIPTION = """\
Forward and backward of one linear layer (y = x W^T, then dx and dW: 6 x rows x in x out
floating-point operations) through oneDNN, as `learner.cpu_gemm=onednn` runs the learner's, against
torch's F.linear (MKL's sgemm for float32 on the CPU), in one process on the same inputs, alternating
rounds, medians. The shapes are the embedded default's tiny Llama's, or those of --model's linear
layers (read from its config). Prints a table of GFLOP/s and oneDNN's speedup, and writes JSON
(docs/benchmarks.md, section Learner's linear layers). Run it with nothing else on the machine.
Example:

    dph-async bench gemm --rows 256 1024 -o runs/bench/gemm.json
"""


def _shape(text: str) -> tuple[int, int]:
    n_in, sep, n_out = text.partition(":")
    if not sep or not n_in.isdigit() or not n_out.isdigit() or not int(n_in) or not int(n_out):
        raise argparse.ArgumentTypeError(f"{text!r}: a shape is IN:OUT, two positive integers (e.g. 128:336)")
    return int(n_in), int(n_out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", type=_shape, nargs="+", default=[(128, 128), (128, 336), (336, 128)],
                        metavar="IN:OUT", help="linear layers' in and out features (default: the embedded "
                        "default's, 128:128 128:336 336:128)")
    parser.add_argument("--model", type=Path, help="a Hugging Face model directory: its linear layers' shapes "
                        "instead of --shapes")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024, 4096],
                        help="tokens through the layer at once (default: %(default)s; a learner micro-batch "
                        "of the embedded default is about 150-1,000)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds per cell (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads, as learner.threads (default: %(default)s)")
    add_output_argument(parser, "JSON results (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/gemm.json"))


def main(args: argparse.Namespace) -> int:
    # heavy (torch, transformers: about 4 s): on running, so that --help is quick
    import torch

    from dph_async.learner import cpu_gemm
    from dph_async.tools.bench import gemm as bench
    if not cpu_gemm.available():
        return fail("this torch build has no oneDNN (torch.backends.mkldnn): nothing to compare", 1)
    if args.model is not None and not (args.model / "config.json").is_file():
        return fail(f"--model {args.model}: no config.json there (a Hugging Face model directory)", 2)
    if min(args.rows) < 1 or args.rounds < 1 or args.threads < 1:
        return fail("--rows, --rounds and --threads must be positive", 2)
    torch.set_num_threads(args.threads)
    shapes = bench.model_shapes(args.model) if args.model is not None else args.shapes
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "command": "dph-async " + " ".join(sys.argv[1:]),
            "machine": machine(), "threads": args.threads}

    def show(c: bench.Cell) -> None:
        print(f"  {c.n_in} x {c.n_out}, {c.rows} rows: torch {c.torch_gflops:.0f}, oneDNN {c.onednn_gflops:.0f} "
              f"GFLOP/s ({c.speedup:.2f}x)", flush=True)

    cells = bench.run(shapes, args.rows, args.rounds, on_cell=show)
    meta["machine"]["load_avg_end"] = os.getloadavg()
    return write_cells(args.output, meta, cells, bench.markdown(cells))
