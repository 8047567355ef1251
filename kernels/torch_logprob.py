"""Chunked torch implementation of the fused linear -> log-prob (+ entropy): the CPU path.

Logits z = hidden @ weight.T / temperature are computed one vocabulary block at a time, in fp32,
into one reused [N, block] buffer (reuse matters on the CPU: each fresh allocation this large is a
new mmap whose pages fault in again). The forward keeps per row an online log-sum-exp

    m = running max,  s = sum_j exp(z_j - m),  e = sum_j exp(z_j - m) (z_j - m)

so lse = m + log s and entropy = log s - e/s (both relative to m, which avoids cancelling two large
numbers). The backward recomputes each block's logits from the saved lse instead of storing [N, V]:

    d/dz_j [g_lp * log p_t + g_H * H] = g_lp (1[j = t] - p_j) - g_H p_j (log p_j + H).

The three products per block (the logits, d hidden, d weight) run through torch (`TORCH`: MKL's
sgemm on the CPU) or through oneDNN (`ONEDNN`, `impl="onednn"`: the CPU's AVX-512 kernels where it
has them; the learner takes it where its linear layers run through oneDNN, learner.cpu_gemm).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace

import torch
from torch import Tensor

from dph_async.kernels import onednn

# Start of the running max: finite, so that (m_old - m_new) * 0 stays 0 instead of NaN.
NEG_INIT = -1e30


@dataclass(frozen=True)
class Products:
    """The float32 products of a block: a b^T into `out`, acc += a b, a^T b into `out`."""

    onednn: bool

    def nt(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        if self.onednn:
            out.copy_(onednn.product(a, b))
        else:
            torch.mm(a, b.T, out=out)

    def add_nn(self, acc: Tensor, a: Tensor, b: Tensor) -> None:
        if self.onednn:
            acc.add_(onednn.product(a, b.T))
        else:
            acc.addmm_(a, b)

    def tn(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        if self.onednn:
            out.copy_(onednn.product(a.T, b.T))
        else:
            torch.mm(a.T, b, out=out)


TORCH, ONEDNN = Products(onednn=False), Products(onednn=True)


def _block_weight(weight: Tensor, v0: int, v1: int) -> Tensor:
    w = weight[v0:v1]
    return w if w.dtype == torch.float32 else w.float()


def _target_hits(targets: Tensor, v0: int, v1: int) -> tuple[Tensor, Tensor]:
    """Rows whose target lies in [v0, v1), and the target's column within the block."""
    rows = ((targets >= v0) & (targets < v1)).nonzero().squeeze(1)
    return rows, targets[rows] - v0


def forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, with_entropy: bool, block_v: int,
    products: Products = TORCH,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Returns (log p(target) [N] fp32, lse [N] fp32, entropy [N] fp32 or None)."""
    n, v = hidden.shape[0], weight.shape[0]
    x = hidden.float() * (1.0 / temperature)
    m = torch.full((n,), NEG_INIT, dtype=torch.float32, device=hidden.device)
    s = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    e = torch.zeros_like(s) if with_entropy else None
    z_t = torch.zeros_like(s)
    flat = torch.empty(n * min(block_v, v), dtype=torch.float32, device=hidden.device)
    flat_p = torch.empty_like(flat) if with_entropy else None
    for v0 in range(0, v, block_v):
        v1 = min(v0 + block_v, v)
        z = flat[: n * (v1 - v0)].view(n, v1 - v0)
        products.nt(x, _block_weight(weight, v0, v1), z)
        rows, cols = _target_hits(targets, v0, v1)
        z_t[rows] = z[rows, cols]
        m_new = torch.maximum(m, z.amax(dim=1))
        z.sub_(m_new[:, None])
        scale = torch.exp(m - m_new)
        if e is not None:
            p = flat_p[: z.numel()].view_as(z)
            torch.exp(z, out=p)
            e.add_((m - m_new) * s).mul_(scale).add_(torch.linalg.vecdot(p, z))
            s.mul_(scale).add_(p.sum(dim=1))
        else:
            s.mul_(scale).add_(z.exp_().sum(dim=1))
        m = m_new
    log_s = s.log()
    lse = m + log_s
    # z_t <= max <= lse in exact arithmetic and here too (s >= 1); the clamp only guards the invariant.
    logp = (z_t - lse).clamp_(max=0.0)
    entropy = (log_s - e / s).clamp_(min=0.0) if e is not None else None
    return logp, lse, entropy


def backward_setup(
    hidden: Tensor,
    weight: Tensor,
    temperature: float,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """(g_logp, g_entropy, d hidden accumulator, d weight) for either implementation's backward.

    The 1/temperature of dz/dx = W/t and dz/dW = x/t is folded into the per-row upstream gradients;
    d hidden accumulates in fp32 over the blocks; each block of d weight is written once.
    """
    n = hidden.shape[0]
    inv_t = 1.0 / temperature
    g_lp = grad_logp.float() * inv_t if grad_logp is not None else torch.zeros(n, device=hidden.device)
    g_h = grad_entropy.float() * inv_t if grad_entropy is not None else None
    d_hidden = torch.zeros(n, hidden.shape[1], device=hidden.device) if need_hidden else None
    d_weight = torch.empty_like(weight) if need_weight else None
    return g_lp, g_h, d_hidden, d_weight


def backward(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float,
    lse: Tensor,
    entropy: Tensor | None,
    grad_logp: Tensor | None,
    grad_entropy: Tensor | None,
    block_v: int,
    need_hidden: bool,
    need_weight: bool,
    products: Products = TORCH,
) -> tuple[Tensor | None, Tensor | None]:
    """Gradients (d hidden, d weight) in the inputs' dtypes; None where not needed."""
    n, v = hidden.shape[0], weight.shape[0]
    g_lp, g_h, d_hidden, d_weight = backward_setup(
        hidden, weight, temperature, grad_logp, grad_entropy, need_hidden, need_weight
    )
    x = hidden.float()
    x_scaled = x * (1.0 / temperature)
    flat = torch.empty(n * min(block_v, v), dtype=torch.float32, device=hidden.device)
    flat_p = torch.empty_like(flat) if g_h is not None else None
    for v0 in range(0, v, block_v):
        v1 = min(v0 + block_v, v)
        w = _block_weight(weight, v0, v1)
        grad = flat[: n * (v1 - v0)].view(n, v1 - v0)
        products.nt(x_scaled, w, grad)
        grad.sub_(lse[:, None])  # log p
        if g_h is None:
            grad.exp_().mul_(-g_lp[:, None])
        else:
            p = flat_p[: grad.numel()].view_as(grad)
            torch.exp(grad, out=p)
            grad.add_(entropy[:, None]).mul_(g_h[:, None]).add_(g_lp[:, None]).mul_(p).neg_()
        rows, cols = _target_hits(targets, v0, v1)
        grad.index_put_((rows, cols), g_lp[rows], accumulate=True)
        if d_hidden is not None:
            products.add_nn(d_hidden, grad, w)
        if d_weight is not None:
            if d_weight.dtype == torch.float32:
                products.tn(grad, x, d_weight[v0:v1])
            else:
                d_weight[v0:v1] = grad.T @ x
    if d_hidden is not None:
        d_hidden = d_hidden.to(hidden.dtype)
    return d_hidden, d_weight


# The implementation `impl="onednn"` names (kernels/fused.py): this path with oneDNN's products.
onednn_impl = SimpleNamespace(forward=partial(forward, products=ONEDNN), backward=partial(backward, products=ONEDNN))
