"""`dph-async bench kernels`: fused log-prob kernels against the naive materialised-logits path."""

from __future__ import annotations

import argparse
import fcntl
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from dph_async.cli.commands.common import add_output_argument, fail
from dph_async.tools.bench.machine import machine

DESCRIPTION = """\
Forward + backward of log p(target) = log_softmax(hidden @ weight.T)[target] at N tokens, hidden size
H and vocabulary V: the fused torch path (vocabulary blocks, online log-sum-exp, recomputing backward)
against the naive path (materialised [N, V] logits, log_softmax, gather), each in a fresh process,
on this CPU. With a GPU, also the Triton kernel against the naive path and its torch.compile.
Prints a table of the ratios and writes JSON. Targets on the CPU: peak extra memory <= 15% of the
naive path's, time <= 1.5x. The defaults need ~8 GB of free memory for the naive path; only one
copy runs at a time. Example:

    dph-async bench kernels -o runs/bench/kernels.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--n", type=int, default=4096, help="tokens (default: %(default)s)")
    parser.add_argument("--hidden", type=int, default=1024, help="hidden size H (default: %(default)s)")
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary size V (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="input dtype on the CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="fresh processes per path, alternating their order (default: %(default)s)",
    )
    parser.add_argument("--iters", type=int, default=2, help="forward+backward per process (default: %(default)s)")
    parser.add_argument("--block-v", type=int, default=None, help="vocabulary block (default: 128 MiB of logits)")
    add_output_argument(parser, "JSON results (default: %(default)s)", out_alias=True, type=Path,
                        default=Path("runs/bench/kernels.json"))


def _cpu_table(args: argparse.Namespace, cpu: dict, console: Console) -> None:
    table = Table(title=f"fused (torch path) vs naive, N={args.n} H={args.hidden} V={args.vocab} {args.dtype}, CPU")
    for col in ("path", "median s", "min s", "CPU s", "peak extra MiB", "CPU share"):
        table.add_column(col, justify="right")
    for path, p in cpu["paths"].items():
        shares = f"{min(p['cpu_share']):.0%}-{max(p['cpu_share']):.0%}"
        table.add_row(path, f"{p['time_median_s']:.2f}", f"{p['time_min_s']:.2f}", f"{p['cpu_s_median']:.1f}",
                      f"{p['peak_extra_bytes'] / 2**20:,.0f}", shares)
    table.add_row("fused / naive", f"{cpu['time_ratio']:.2f}x", f"{cpu['time_ratio_min']:.2f}x",
                  f"{cpu['cpu_time_ratio']:.2f}x", f"{cpu['memory_ratio']:.1%}", "")
    console.print(table)
    console.print(
        f"targets: time <= 1.5x ({'met' if cpu['time_ratio'] <= 1.5 else 'NOT met'}), "
        f"memory <= 15% ({'met' if cpu['memory_ratio'] <= 0.15 else 'NOT met'}); "
        f"max |d log p| = {cpu['max_abs_diff_logp']:.1e}, d hidden rel. {cpu['max_rel_diff_d_hidden']:.1e}"
    )


def _gpu_table(gpu: dict, device: str, console: Console) -> None:
    table = Table(title=f"Triton kernel on {device}")
    for col in ("dtype", "naive s", "compiled s", "triton s", "vs naive (time, mem)", "vs compiled (time, mem)"):
        table.add_column(col, justify="right")
    for dtype, g in gpu.items():
        p = g["paths"]
        table.add_row(dtype, *(f"{p[k]['time_median_s'] * 1e3:.1f} ms" for k in ("naive", "compiled", "triton")),
                      f"{g['time_ratio_vs_naive']:.2f}x, {g['memory_ratio_vs_naive']:.1%}",
                      f"{g['time_ratio_vs_compiled']:.2f}x, {g['memory_ratio_vs_compiled']:.1%}")
    console.print(table)


def main(args: argparse.Namespace) -> int:
    # heavy (torch: about 2 s): on running, so that --help is quick
    import torch

    from dph_async.tools.bench import kernels as bench
    console = Console()
    need = bench.naive_bytes_estimate(args.n, args.hidden, args.vocab)
    free = bench.available_memory()
    if need > 0.9 * free:
        return fail(f"the naive path needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available", 1)
    # Two large runs would each hold the naive path's [N, V] tensors and skew each other's timings.
    lock = open(Path(tempfile.gettempdir()) / "dph-async-bench-kernels.lock", "w")  # noqa: SIM115
    try:
        if need > 2**30:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return fail("another large `dph-async bench kernels` is running on this machine", 1)

    def report(path: str, run: dict) -> None:
        pairs = zip(run["times_s"], run["cpu_share"], strict=True)
        times = ", ".join(f"{t:.2f} s ({s:.0%} CPU)" for t, s in pairs)
        console.print(f"  {path}: peak extra {run['peak_extra_bytes'] / 2**20:,.0f} MiB, times {times}")

    console.print(f"N={args.n} H={args.hidden} V={args.vocab} {args.dtype}, {args.rounds} rounds x {args.iters}")
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine(),
        "shape": {"n": args.n, "hidden": args.hidden, "vocab": args.vocab, "dtype": args.dtype,
                  "block_v": args.block_v},
        "cpu": bench.bench_cpu(args, on_run=report),
    }
    _cpu_table(args, result["cpu"], console)
    if torch.cuda.is_available():
        result["gpu"] = {dtype: bench.bench_gpu(args, dtype) for dtype in ("float32", "bfloat16")}
        _gpu_table(result["gpu"], torch.cuda.get_device_name(), console)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.output}")
    return 0
