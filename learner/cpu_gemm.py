"""The learner's linear layers on the CPU through oneDNN (`learner.cpu_gemm`).

torch runs a float32 `F.linear` on the CPU through MKL's sgemm, which on AMD processors keeps to
its AVX2 code: on the AVX-512 EPYC the benchmarks run on, 84-112 GFLOP/s on one core whatever the
size. oneDNN, which torch also carries, picks its kernels by the CPU's features: 230-250 GFLOP/s
on the learner's shapes there (docs/benchmarks.md). So a linear layer here computes

    forward   y   = x W^T + b
    backward  dx  = dy W,   dW = dy^T x,   db = sum_rows dy

with the three products through oneDNN where the layer is large enough to gain (oneDNN costs about
10 us a call more; below MIN_MACS multiply-adds MKL is faster) and through `F.linear` otherwise. The
parameters stay those of the `nn.Linear`, so DeepSpeed, checkpoints and `save_pretrained` see the
model unchanged; only the float rounding of the products differs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dph_async.kernels.onednn import available
from dph_async.kernels.onednn import product as _product

CpuGemm = Literal["onednn", "torch"]
# Multiply-adds (rows x in x out) from which a layer's forward and backward through oneDNN beat
# MKL's on one core (`dph-async bench gemm`): equal at 128 x 128 x 128, 0.80x at 64 x 128 x 128,
# 1.17x at 64 x 128 x 336, 1.6-1.9x from 256 rows.
MIN_MACS = 1 << 21


def resolve(cpu_gemm: CpuGemm | Literal["auto"], *, device: str, zero_stage: int, dtype: torch.dtype) -> CpuGemm:
    """`auto`: oneDNN for a float32 model trained on the CPU (`device`, DeepSpeed's accelerator) where
    torch has it, below ZeRO-3. torch already runs bfloat16 products through oneDNN, and ZeRO-3
    replaces the linear layers' function with its own (the config refuses `onednn` with it)."""
    if cpu_gemm == "auto":
        return "onednn" if device == "cpu" and available() and zero_stage < 3 and dtype == torch.float32 else "torch"
    if cpu_gemm == "onednn" and device != "cpu":
        raise ValueError(f"learner.cpu_gemm=onednn: the learner trains on {device}, and oneDNN's products are "
                         "the CPU's; use learner.cpu_gemm=torch or auto")
    if cpu_gemm == "onednn" and not available():
        raise ValueError("learner.cpu_gemm=onednn: this torch build has no oneDNN (torch.backends.mkldnn); "
                         "use learner.cpu_gemm=torch")
    return cpu_gemm


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, weight)
        ctx.has_bias = bias is not None
        return _product(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _product(dy2, weight.t()).view(*dy.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = _product(dy2.t(), x2.t())
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy2.sum(0)
        return dx, dw, db


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with its forward and backward products through oneDNN, whatever the size."""
    return _LinearFunction.apply(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An `nn.Linear` whose products run through oneDNN from MIN_MACS multiply-adds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows * self.in_features * self.out_features < MIN_MACS:
            return F.linear(x, self.weight, self.bias)
        return onednn_linear(x, self.weight, self.bias)


def use_onednn(model: nn.Module) -> int:
    """Make every `nn.Linear` of `model` a `OneDNNLinear` in place (same parameters); returns how many."""
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    for m in layers:
        m.__class__ = OneDNNLinear
    return len(layers)
