"""oneDNN's float32 product on the CPU, which torch carries: `a @ b^T`, with AVX-512 kernels where the
CPU has them (MKL's sgemm, torch's default, keeps to AVX2 on AMD processors: about half the speed on
the EPYC the benchmarks run on; docs/benchmarks.md, "The learner's linear layers")."""

from __future__ import annotations

import torch


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b^T (+ bias) through oneDNN; a and b may be transposed views."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")
