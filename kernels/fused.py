"""The autograd function behind `kernels.fused_logprobs`, and the dispatch between implementations.

Both implementations (chunked torch, Triton) share one contract:
    forward(hidden, weight, targets, temperature, with_entropy, block_v) -> (logp, lse, entropy | None)
    backward(hidden, weight, targets, temperature, lse, entropy, g_logp, g_entropy, block_v,
             need_hidden, need_weight) -> (d_hidden | None, d_weight | None)
"""

from __future__ import annotations

import os
from types import ModuleType, SimpleNamespace

import torch
from torch import Tensor

from dph_async.kernels import onednn, torch_logprob

# Elements in one [N, block] fp32 logits buffer (128 MiB): the default block size follows from N.
BLOCK_BUDGET = 1 << 25
# On the CPU blocks of 8 MiB, which stay in the caches between a block's product and the passes over
# it: the forward and backward at N = 1,024, V = 32,768 took 0.16-0.95 s of one core against
# 0.36-1.10 s with 128 MiB blocks (H = 32 to 512), at N = 4,096 0.69-3.7 s against 1.5-4.6 s.
CPU_BLOCK_BUDGET = 1 << 21
MIN_BLOCK_V = 256


def default_block_v(n: int, v: int, budget: int = BLOCK_BUDGET) -> int:
    """Vocabulary rows per block: as many as fit `budget` elements for n tokens, a multiple of 256, at
    most V."""
    block = max(MIN_BLOCK_V, (budget // max(n, 1)) // MIN_BLOCK_V * MIN_BLOCK_V)
    return min(block, v)


def _implementation(impl: str, device: torch.device) -> ModuleType | SimpleNamespace:
    if impl == "auto":
        impl = "triton" if device.type == "cuda" else "torch"
    if impl == "torch":
        return torch_logprob
    if impl == "onednn":
        if device.type != "cpu" or not onednn.available():
            raise ValueError("impl='onednn' needs CPU tensors and a torch with oneDNN (torch.backends.mkldnn)")
        return torch_logprob.onednn_impl
    if impl == "triton":
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported"
            )
        from dph_async.kernels import (
            triton_logprob,  # heavy and optional (triton): a CUDA device's (or the interpreter's)
        )

        return triton_logprob
    raise ValueError(f"impl must be 'auto', 'torch', 'onednn' or 'triton', not {impl!r}")


class FusedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, with_entropy, impl, block_v):
        logp, lse, entropy = impl.forward(hidden, weight, targets, temperature, with_entropy, block_v)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy)
        ctx.args = (impl, temperature, block_v)
        ctx.set_materialize_grads(False)
        if entropy is None:
            entropy = logp.new_empty(0)
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        impl, temperature, block_v = ctx.args
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        if (grad_logp is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None, None, None, None
        d_hidden, d_weight = impl.backward(
            hidden, weight, targets, temperature, lse, entropy, grad_logp, grad_entropy, block_v,
            need_hidden, need_weight,
        )
        return d_hidden, d_weight, None, None, None, None, None


def fused_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    mask: Tensor | None = None,
    with_entropy: bool = False,
    impl: str = "auto",
    block_v: int | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(hidden @ weight.T / temperature)[target], and optionally the entropy, never
    materialising the [N, V] logits.

    hidden [..., H] (fp32 or bf16), weight [V, H], targets [...] int64, mask [...] bool (True = keep).
    Returns fp32 log-probs [...] (<= 0; exactly 0 at masked positions) and fp32 entropy [...] (0 at
    masked positions) or None. Both are differentiable with respect to hidden and weight; masked
    positions get exactly zero gradient and their targets are never read. impl: "auto" (Triton on
    CUDA, torch otherwise), "torch", "onednn" (the torch path with oneDNN's products, CPU), or
    "triton" (CUDA, or CPU under TRITON_INTERPRET=1).
    block_v: vocabulary rows per block (default: an 8 MiB fp32 block of logits on the CPU, 128 MiB
    elsewhere).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden [..., H] and weight [V, H] disagree: {tuple(hidden.shape)}, {tuple(weight.shape)}"
        )
    if targets.shape != hidden.shape[:-1] or (mask is not None and mask.shape != targets.shape):
        raise ValueError("targets (and mask) must have hidden's leading shape")
    if hidden.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != hidden.dtype:
        raise ValueError(
            f"hidden and weight must both be float32 or both bfloat16, got {hidden.dtype}, {weight.dtype}"
        )
    lead = targets.shape
    h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    keep = None
    if mask is not None:
        keep = mask.reshape(-1).nonzero().squeeze(1)
        h, t = h.index_select(0, keep), t.index_select(0, keep)
    v = weight.shape[0]
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= v):
        raise ValueError(f"targets must lie in [0, {v}) at unmasked positions")
    block = block_v or default_block_v(t.numel(), v, CPU_BLOCK_BUDGET if hidden.device.type == "cpu" else BLOCK_BUDGET)
    impl_mod = _implementation(impl, hidden.device)
    logp, entropy = FusedLogprob.apply(
        h.contiguous(), weight.contiguous(), t.contiguous(), float(temperature), with_entropy, impl_mod, block
    )
    if keep is not None:
        logp = logp.new_zeros(lead.numel()).index_copy(0, keep, logp)
        if with_entropy:
            entropy = entropy.new_zeros(lead.numel()).index_copy(0, keep, entropy)
    return logp.view(lead), (entropy.view(lead) if with_entropy else None)
