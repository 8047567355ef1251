"""Per-step diagnostics of the off-policy correction: pure functions of [B, T] tensors and a mask.

All return detached scalar tensors. Empty masks give 0 (1 for the effective sample size).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dph_async.learner.losses import PolicyLoss, log_ratio, masked_mean


def is_weight_stats(is_weight: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, max) of the importance weight w = pi_prox / pi_mu over the masked tokens."""
    w = is_weight.detach()
    mask = mask.bool()
    peak = w[mask].max() if mask.any() else w.new_zeros(())
    return masked_mean(w, mask.to(w.dtype)), peak


def clipped_fraction(clipped: Tensor, mask: Tensor) -> Tensor:
    """Share of masked tokens where the clip is active (their ratio carries no gradient)."""
    return masked_mean(clipped.to(torch.float32), mask.to(torch.float32))


def effective_sample_size(weights: Tensor, mask: Tensor) -> Tensor:
    """Normalised ESS of importance weights, (sum w)^2 / (n sum w^2), in (0, 1]: 1 when all weights
    are equal, 1/n when one token carries all the weight."""
    w = weights.detach().double() * mask
    n = mask.sum()
    if n == 0:
        return torch.ones((), dtype=torch.float64)
    return (w.sum() ** 2 / (n * (w * w).sum()).clamp(min=1e-300)).float()


def mismatch_kl(logp_learner: Tensor, logp_mu: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(k1, k3) estimates of KL(pi_mu || pi_learner) on the behaviour's own samples, r = pi_learner / pi_mu:

        k1 = mean(log pi_mu - log pi_learner)     unbiased, can be negative
        k3 = mean(r - 1 - log r)                  unbiased, >= 0 per token, lower variance

    With logp_learner the proximal log-probs this measures how stale and how engine-mismatched the
    behaviour is (vLLM versus the learner's numerics adds to it even at zero staleness).
    """
    log_r = log_ratio(logp_learner.detach(), logp_mu)
    mask = mask.to(log_r.dtype)
    return masked_mean(-log_r, mask), masked_mean(log_r.exp() - 1.0 - log_r, mask)


def entropy_mean(entropy: Tensor, mask: Tensor) -> Tensor:
    """Mean per-token entropy of the learner's distribution over the masked tokens."""
    return masked_mean(entropy.detach(), mask.to(entropy.dtype))


def policy_diagnostics(
    out: PolicyLoss, mask: Tensor, logp_prox: Tensor, logp_mu: Tensor, entropy: Tensor | None = None
) -> dict[str, float]:
    """Everything above for one batch of fresh tokens, as floats for logging. `mask` is the input mask
    (before the `masked` correction drops tokens); `out.mask` gives the kept share."""
    w_mean, w_max = is_weight_stats(out.is_weight, mask)
    k1, k3 = mismatch_kl(logp_prox, logp_mu, mask)
    stats = {
        "is_weight_mean": w_mean,
        "is_weight_max": w_max,
        "ess": effective_sample_size(out.is_weight, mask),
        "clip_frac": clipped_fraction(out.clipped, out.mask),
        # How far pi_theta moved from the ratio's denominator within the batch: 0 with one update.
        "ratio_dev": masked_mean((out.ratio - 1.0).abs(), mask.to(out.ratio.dtype)),
        "dual_clip_frac": clipped_fraction(out.dual_clipped, out.mask),
        "kept_frac": out.mask.sum() / mask.sum().clamp(min=1),
        "mismatch_kl_k1": k1,
        "mismatch_kl_k3": k3,
    }
    if entropy is not None:
        stats["entropy"] = entropy_mean(entropy, mask)
    return {k: float(v) for k, v in stats.items()}
