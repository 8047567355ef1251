"""Benchmark of the learner's linear layers: oneDNN (`learner.cpu_gemm=onednn`) against torch's F.linear.

Every size runs through both, below `learner.cpu_gemm.MIN_MACS` too, where the learner keeps F.linear:
the table shows where that threshold falls on a machine.

One measurement = the forward and backward of one linear layer, y = x W^T, then dx and dW from a
fixed dy: three products of rows x in x out multiply-adds, 6 x rows x in x out floating-point
operations. Both paths run in one process on the same inputs, in rounds that alternate which goes
first; each cell reports the medians.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from dph_async.learner.cpu_gemm import onednn_linear


@dataclass
class Cell:
    n_in: int
    n_out: int
    rows: int
    torch_ms: float  # forward + backward, median over the rounds
    onednn_ms: float
    torch_gflops: float
    onednn_gflops: float
    speedup: float  # torch_ms / onednn_ms


def model_shapes(model_dir: Path) -> list[tuple[int, int]]:
    """The distinct (in, out) of a Hugging Face model's linear layers, from its config alone."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return sorted({(m.in_features, m.out_features) for m in model.modules() if isinstance(m, nn.Linear)})


def measure(n_in: int, n_out: int, rows: int, rounds: int) -> Cell:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n_in, generator=g).requires_grad_()
    weight = (torch.randn(n_out, n_in, generator=g) * n_in**-0.5).requires_grad_()
    dy = torch.randn(rows, n_out, generator=g)

    def step(linear) -> None:
        x.grad = weight.grad = None
        linear(x, weight).backward(dy)

    paths = {"torch": F.linear, "onednn": onednn_linear}
    for linear in paths.values():  # the first calls: oneDNN builds its kernels for the shape
        step(linear)
        step(linear)
    times: dict[str, list[float]] = {name: [] for name in paths}
    inner = max(1, int(2e8 / (6 * rows * n_in * n_out)))  # about 2 ms of work per timing at 100 GFLOP/s
    for r in range(rounds):
        for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
            start = time.perf_counter()
            for _ in range(inner):
                step(paths[name])
            times[name].append((time.perf_counter() - start) / inner)
    t_torch, t_onednn = statistics.median(times["torch"]), statistics.median(times["onednn"])
    flops = 6 * rows * n_in * n_out
    return Cell(n_in, n_out, rows, 1e3 * t_torch, 1e3 * t_onednn, flops / t_torch / 1e9, flops / t_onednn / 1e9,
                t_torch / t_onednn)


def run(shapes: list[tuple[int, int]], rows: list[int], rounds: int, on_cell=None) -> list[Cell]:
    cells = []
    for n_in, n_out in shapes:
        for m in rows:
            cells.append(measure(n_in, n_out, m, rounds))
            if on_cell is not None:
                on_cell(cells[-1])
    return cells


def markdown(cells: list[Cell]) -> str:
    lines = ["| in x out | rows | torch ms | oneDNN ms | torch GFLOP/s | oneDNN GFLOP/s | oneDNN speedup |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for c in cells:
        lines.append(f"| {c.n_in} x {c.n_out} | {c.rows} | {c.torch_ms:.3f} | {c.onednn_ms:.3f} | "
                     f"{c.torch_gflops:.0f} | {c.onednn_gflops:.0f} | {c.speedup:.2f}x |")
    return "\n".join(lines)
