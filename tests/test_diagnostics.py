"""Diagnostics against closed forms and float64 recomputation on fresh random inputs."""

from __future__ import annotations

import math

import torch

from dph_async.config.loss import LossConfig
from dph_async.learner import diagnostics as D
from dph_async.learner.losses import policy_loss

F64 = torch.float64


def test_effective_sample_size_extremes_and_formula():
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert D.effective_sample_size(torch.full((3, 4), 0.7), mask) == 1.0
    one_hot = torch.zeros(3, 4)
    one_hot[1, 2] = 5.0
    torch.testing.assert_close(D.effective_sample_size(one_hot, mask).item(), 1 / 12)
    g = torch.Generator().manual_seed(0)
    w = torch.rand(5, 6, generator=g, dtype=F64) * 3
    m = torch.rand(5, 6, generator=g) < 0.6
    wm = w[m]
    torch.testing.assert_close(
        D.effective_sample_size(w, m).double(), wm.sum() ** 2 / (len(wm) * (wm**2).sum()), rtol=1e-6, atol=0
    )
    assert D.effective_sample_size(w, torch.zeros_like(m)) == 1.0


def test_is_weight_and_clip_fractions():
    g = torch.Generator().manual_seed(1)
    w = torch.rand(4, 5, generator=g, dtype=F64) * 2
    mask = torch.rand(4, 5, generator=g) < 0.7
    w[~mask] = 100.0  # padding must not leak into the max
    mean, peak = D.is_weight_stats(w, mask)
    torch.testing.assert_close(mean, w[mask].mean())
    torch.testing.assert_close(peak, w[mask].max())
    clipped = torch.rand(4, 5, generator=g) < 0.3
    torch.testing.assert_close(
        D.clipped_fraction(clipped, mask).item(), (clipped & mask).sum().item() / mask.sum().item()
    )


def test_mismatch_kl_estimates_kl_of_behaviour_to_learner():
    """On a categorical, the exact expectations under pi_mu of k1 and k3 equal KL(pi_mu || pi_learner)."""
    g = torch.Generator().manual_seed(2)
    log_mu = torch.log_softmax(torch.randn(9, generator=g, dtype=F64), 0)
    log_learner = torch.log_softmax(torch.randn(9, generator=g, dtype=F64), 0)
    exact = (log_mu.exp() * (log_mu - log_learner)).sum()
    # each outcome once, as a [1, 9] batch; weight the per-token terms by pi_mu through the mask
    k1, k3 = D.mismatch_kl(log_learner[None], log_mu[None], log_mu.exp()[None] * 9)
    torch.testing.assert_close(k1, exact)
    torch.testing.assert_close(k3, exact)
    k1, k3 = D.mismatch_kl(log_mu[None], log_mu[None], torch.ones(1, 9))
    assert k1 == 0 and k3 == 0


def test_policy_diagnostics_summary():
    g = torch.Generator().manual_seed(3)
    logp = -torch.rand(4, 6, generator=g, dtype=F64) * 2
    logp_mu = logp + 0.5 * torch.randn(4, 6, generator=g, dtype=F64)
    mask = torch.rand(4, 6, generator=g) < 0.8
    entropy = torch.rand(4, 6, generator=g, dtype=F64)
    cfg = LossConfig(correction="masked", is_cap=1.5)
    out = policy_loss(logp, logp_mu, torch.randn(4, generator=g, dtype=F64), mask, cfg, logp.clone())
    stats = D.policy_diagnostics(out, mask, logp, logp_mu, entropy)
    w = (logp - logp_mu).exp()
    assert math.isclose(stats["is_weight_max"], w[mask].max().item(), rel_tol=1e-9)
    assert math.isclose(stats["entropy"], entropy[mask].mean().item(), rel_tol=1e-9)
    kept = (mask & ((logp - logp_mu).abs() <= math.log(1.5))).sum().item() / mask.sum().item()
    assert math.isclose(stats["kept_frac"], kept, rel_tol=1e-9)
    assert 0 < stats["ess"] <= 1 and stats["mismatch_kl_k3"] >= 0
    assert stats["clip_frac"] == 0  # r = 1 on every token: nothing clipped
