"""Materialised-logits paths: the float64 oracle for tests and the naive baseline for benchmarks.

Both build the full [N, V] logits, which the fused kernels exist to avoid; use them only at small
shapes (the oracle) or to measure what the fused path saves (the naive baseline).
"""

from __future__ import annotations

import torch
from torch import Tensor


def reference_logprobs(
    hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Float64 log p(target) and entropy of softmax(hidden @ weight.T / temperature); 0 where masked.

    Differentiable: the float64 copies it makes are leaves of the caller's graph, so
    `torch.autograd.grad` on its outputs gives the exact gradients the fused kernels must match.
    """
    if mask is not None:
        targets = torch.where(mask, targets, 0)  # masked targets may be ignore ids such as -100
    logits = (hidden.double() @ weight.double().T) / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    if mask is not None:
        logp = torch.where(mask, logp, 0.0)
        entropy = torch.where(mask, entropy, 0.0)
    return logp, entropy


def naive_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """The usual unfused path: logits in fp32, log_softmax, gather. Autograd keeps [N, V] tensors alive."""
    logits = (hidden @ weight.T).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def reference_with_grads(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float,
    mask: Tensor | None,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Float64 (logp, entropy, d hidden, d weight) of sum(grad_logp * logp + grad_entropy * entropy)."""
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    logp, entropy = reference_logprobs(h, w, targets, temperature, mask)
    objective = (grad_logp.double() * logp).sum()
    if grad_entropy is not None:
        objective = objective + (grad_entropy.double() * entropy).sum()
    d_hidden, d_weight = torch.autograd.grad(objective, (h, w))
    return logp.detach(), entropy.detach(), d_hidden, d_weight


def rel_error(actual: Tensor, expected: Tensor) -> float:
    """max |actual - expected| / max |expected|, in float64 (0 when both are 0)."""
    scale = expected.abs().max().item()
    err = (actual.double() - expected.double()).abs().max().item()
    return err / scale if scale > 0 else err
