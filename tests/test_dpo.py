"""Online DPO: the pair losses against float64 closed forms (value and gradient), pair formation
against brute force, and the DPO objectives' micro-batch shares adding up to the mean pair loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dph_async.config.loss import LossConfig
from dph_async.learner import dpo
from dph_async.learner import losses as L
from dph_async.learner.batching import Counts, Sequence
from dph_async.learner.objectives import make_objective

F64 = torch.float64


def _sigma(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


# name -> (loss(h, beta, margin), closed-form value, closed-form d/dh), scalar math in float64
CLOSED = {
    "sigmoid": (lambda h, b, m: dpo.sigmoid_loss(h, b),
                lambda h, b, m: -math.log(_sigma(b * h)),
                lambda h, b, m: -b * (1.0 - _sigma(b * h))),
    "ipo": (lambda h, b, m: dpo.ipo_loss(h, b),
            lambda h, b, m: (h - 1.0 / (2.0 * b)) ** 2,
            lambda h, b, m: 2.0 * (h - 1.0 / (2.0 * b))),
    "rev_kl": (lambda h, b, m: dpo.rev_kl_loss(h, b, m),
               lambda h, b, m: -_sigma(m) * math.log(_sigma(b * h)) - (1 - _sigma(m)) * math.log(_sigma(-b * h)),
               lambda h, b, m: b * (_sigma(b * h) - _sigma(m))),
}


@pytest.mark.parametrize("name", CLOSED)
def test_pair_losses_match_closed_forms_in_value_and_gradient(name):
    fn, value, grad = CLOSED[name]
    g = torch.Generator().manual_seed(7)
    h = (torch.randn(40, generator=g, dtype=F64) * 6).requires_grad_(True)
    margin = torch.rand(40, generator=g, dtype=F64) * 3
    for beta in (0.05, 0.5, 3.0):
        out = fn(h, beta, margin)
        (dh,) = torch.autograd.grad(out.sum(), h)
        want = [value(x, beta, m) for x, m in zip(h.tolist(), margin.tolist(), strict=True)]
        want_grad = [grad(x, beta, m) for x, m in zip(h.tolist(), margin.tolist(), strict=True)]
        torch.testing.assert_close(out.detach(), torch.tensor(want, dtype=F64), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(dh, torch.tensor(want_grad, dtype=F64), rtol=1e-9, atol=1e-9)


def test_losses_stay_finite_far_out():
    h = torch.tensor([-1e4, 1e4], dtype=F64)
    for out in (dpo.sigmoid_loss(h, 1.0), dpo.rev_kl_loss(h, 1.0, torch.ones(2, dtype=F64))):
        assert torch.isfinite(out).all()
    # sigmoid: ~ beta |h| where the model prefers the loser, ~0 where it prefers the winner.
    torch.testing.assert_close(dpo.sigmoid_loss(h, 1.0), torch.tensor([1e4, 0.0], dtype=F64))


def test_rev_kl_is_minimised_where_the_implicit_preference_equals_the_rewards():
    beta, margin = 0.4, torch.tensor([1.3], dtype=F64)
    hs = torch.linspace(-10, 20, 30001, dtype=F64)
    best = hs[dpo.rev_kl_loss(hs, beta, margin.expand_as(hs)).argmin()]
    assert abs(float(best) - 1.3 / beta) < 2e-3


def _seq(reward: float, tag: int) -> Sequence:
    return Sequence(np.array([1, 2]), np.array([tag]), np.zeros(1, np.float32), 0.0, reward=reward)


def test_pairs_are_highest_against_lowest_and_ties_are_counted():
    rng = np.random.default_rng(0)
    groups = [[_seq(float(r), i) for i, r in enumerate(rng.integers(0, 3, size=rng.integers(1, 6)))]
              for _ in range(200)]
    pairs, ties = dpo.form_pairs(groups)
    want_ties = sum(len({s.reward for s in g}) == 1 for g in groups)
    assert ties == want_ties and len(pairs) == len(groups) - want_ties
    kept = [g for g in groups if len({s.reward for s in g}) > 1]
    for (w, lo), g in zip(pairs, kept, strict=True):
        rewards = [s.reward for s in g]
        assert w.reward == max(rewards) and lo.reward == min(rewards)
        # the first of the best and the first of the worst, by position
        assert int(w.response_ids[0]) == rewards.index(max(rewards))
        assert int(lo.response_ids[0]) == rewards.index(min(rewards))
        assert w.advantage == -lo.advantage == max(rewards) - min(rewards) > 0
    assert all(s.advantage == 0.0 for g in groups for s in g)  # the inputs are left alone


def test_split_pairs_refuses_a_broken_layout():
    v = torch.arange(4.0)
    w, lo, m = dpo.split_pairs(v, torch.tensor([2.0, -2.0, 1.0, -1.0]))
    assert w.tolist() == [0.0, 2.0] and lo.tolist() == [1.0, 3.0] and m.tolist() == [2.0, 1.0]
    with pytest.raises(ValueError, match="split"):
        dpo.split_pairs(v[:3], torch.tensor([2.0, -2.0, 1.0]))
    with pytest.raises(ValueError, match="split"):
        dpo.split_pairs(v, torch.tensor([2.0, 1.0, -2.0, -1.0]))


@pytest.mark.parametrize("name,loss", [("dpo", "sigmoid"), ("ipo", "ipo"), ("dpo_rev_kl", "rev_kl")])
def test_dpo_objective_shares_add_up_to_the_mean_pair_loss(name, loss):
    """Per-token log-probs of 5 pairs, split 2 + 3 over micro-batches: the shares sum to the mean over
    pairs of the loss of h, computed here from per-sequence sums in float64."""
    g = torch.Generator().manual_seed(11)
    pairs, t, beta = 5, 4, 0.3
    lengths = torch.randint(1, t + 1, (2 * pairs,), generator=g)
    mask = torch.arange(t)[None] < lengths[:, None]
    logp = (-torch.rand(2 * pairs, t, generator=g, dtype=F64) * 3).requires_grad_(True)
    logp_ref = -torch.rand(2 * pairs, t, generator=g, dtype=F64) * 3
    margins = torch.rand(pairs, dtype=F64, generator=g) + 0.5
    adv = torch.stack([margins, -margins], 1).reshape(-1)
    obj = make_objective(LossConfig(objective=name, coeff=beta))
    counts = Counts(n_fresh=2 * pairs, fresh_tokens=int(mask.sum()), n_reference=0, reference_tokens=0)
    dummy = L.PolicyLoss(*(torch.zeros(2 * pairs, t),) * 6)
    total = sum(obj.fresh_share(dummy, mask[s], counts, t, logp=logp[s], logp_ref=logp_ref[s],
                                advantages=adv[s]).loss for s in (slice(0, 4), slice(4, 10)))

    seq = [float((logp[i].detach() - logp_ref[i])[mask[i]].sum()) for i in range(2 * pairs)]
    _, value, dval = CLOSED[loss]
    want = sum(value(seq[2 * k] - seq[2 * k + 1], beta, float(margins[k])) for k in range(pairs)) / pairs
    assert float(total.detach()) == pytest.approx(want, rel=1e-12)
    # gradient: d/d logp of y_w's tokens = dL/dh / P, of y_l's = -dL/dh / P, 0 on padding
    (grad,) = torch.autograd.grad(total, logp)
    for k in range(pairs):
        d = dval(seq[2 * k] - seq[2 * k + 1], beta, float(margins[k])) / pairs
        torch.testing.assert_close(grad[2 * k], d * mask[2 * k].to(F64))
        torch.testing.assert_close(grad[2 * k + 1], -d * mask[2 * k + 1].to(F64))


def test_dpo_preset_loads_with_each_sampler():
    from dph_async.config import ConfigError, load_config

    for sampler in ("online", "ref", "gshf", "mixp"):
        cfg = load_config("dpo", [f"actors.sampler={sampler}"])
        assert cfg.learner.loss.objective == "dpo" and cfg.actors.sampler == sampler and cfg.learner.kl_every > 0
    with pytest.raises(ConfigError, match=r"actors\.sampler"):
        load_config("dpo", ["actors.sampler=mix"])


def test_groups_from_two_distributions_pair_one_response_from_each():
    """gshf / mixp groups: brute force over every cross pair for the largest positive margin."""
    rng = np.random.default_rng(5)
    groups = []
    for _ in range(300):
        n = int(rng.integers(2, 7))
        g = [_seq(float(rng.integers(0, 3)), i) for i in range(n)]
        for s, w in zip(g, rng.choice([1.0, 0.0], size=n), strict=True):
            s.policy_weight = float(w)
        groups.append(g)
    pairs, ties = dpo.form_pairs(groups)
    kept = iter(pairs)
    want_ties = 0
    for g in groups:
        if len({s.policy_weight for s in g}) == 1:
            best = max(s.reward for s in g) - min(s.reward for s in g)
        else:
            best = max(a.reward - b.reward for a in g for b in g if a.policy_weight != b.policy_weight)
        if best <= 0:
            want_ties += 1
            continue
        w, lo = next(kept)
        assert w.reward - lo.reward == best == w.advantage
        if len({s.policy_weight for s in g}) == 2:
            assert w.policy_weight != lo.policy_weight
    assert ties == want_ties and next(kept, None) is None
