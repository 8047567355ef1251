"""The objectives: what each registered mode declares and uses, and that micro-batch shares add up to
the DPH-RL objective as the reference implementation weights it (float64)."""

from __future__ import annotations

import pytest
import torch

from dph_async.config.loss import LossConfig
from learner import losses as L
from learner.batching import Counts
from learner.objectives import OBJECTIVES, UnknownObjective, make_objective, objective_class

F64 = torch.float64

# name -> (uses_pool, uses_reference_model, reference divergence, fresh divergence)
EXPECTED = {
    "grpo": (False, False, None, None),
    "dapo": (False, True, None, L.reverse_kl),
    "reverse_kl": (False, True, None, L.reverse_kl),
    "forward": (True, False, L.forward_kl, None),
    "js_low_var": (True, False, L.js_low_var, None),
    "js": (True, True, L.js_reference_half, L.js_online_half),
    "alpha": (True, False, lambda a, b: L.alpha_divergence(a, b, 0.35), None),
    # online DPO: pair losses on sequence log-probs (tests/test_dpo.py), no per-token divergence
    "dpo": (False, True, None, None),
    "ipo": (False, True, None, None),
    "dpo_rev_kl": (False, True, None, None),
}


def test_every_objective_is_registered_once_with_its_needs():
    assert set(OBJECTIVES) == set(EXPECTED)
    for name, (pool, model, _, _) in EXPECTED.items():
        cls = objective_class(name)
        assert cls.name == name and cls.uses_pool == pool and cls.uses_reference_model == model
        assert cls.has_divergence() == (pool or model)
        assert (cls.default_coeff > 0) == cls.has_divergence()
        assert all(c > 0 for c in cls.sweep_coeffs) and bool(cls.sweep_coeffs) == cls.has_divergence()


def test_unknown_objective_names_the_registered_ones():
    with pytest.raises(UnknownObjective, match=r"'forwrd'.*js_low_var"):
        make_objective(LossConfig(objective="forwrd"))


@pytest.mark.parametrize("name", EXPECTED)
def test_objectives_use_their_per_token_divergences(name):
    _, _, ref_fn, fresh_fn = EXPECTED[name]
    obj = make_objective(LossConfig(objective=name, alpha=0.35))
    g = torch.Generator().manual_seed(1)
    logp, logp_ref = -torch.rand(30, generator=g, dtype=F64) * 4, -torch.rand(30, generator=g, dtype=F64) * 4
    for fn, method in ((ref_fn, obj.reference_divergence), (fresh_fn, obj.fresh_divergence)):
        if fn is None:
            with pytest.raises(NotImplementedError):
                method(logp, logp_ref)
        else:
            torch.testing.assert_close(method(logp, logp_ref), fn(logp, logp_ref), atol=0, rtol=0)


def test_coefficient_defaults_to_the_objectives_and_can_be_overridden():
    assert make_objective(LossConfig(objective="forward")).coeff == 0.01
    assert make_objective(LossConfig(objective="js_low_var")).coeff == 0.2
    assert make_objective(LossConfig(objective="forward", coeff=0.3)).coeff == 0.3


def _out(pg_tok: torch.Tensor) -> L.PolicyLoss:
    ones = torch.ones_like(pg_tok)
    return L.PolicyLoss(pg_tok, ones, ones, ones, ones.bool(), ones.bool())


def test_micro_batch_shares_equal_the_reference_micro_batch_average():
    """The reference trains micro-batches of one type each and averages their losses: with equal
    lengths, that average equals [n_f L_pg + n_r eta D_ref] / (n_f + n_r). Our shares, summed over
    micro-batches of any sizes, give the same number."""
    g = torch.Generator().manual_seed(22)
    n_f, n_r, t, micro, eta = 16, 4, 6, 2, 0.05
    pg_tok = torch.randn(n_f, t, generator=g, dtype=F64)
    logp_ref = -torch.rand(n_r, t, generator=g, dtype=F64)
    logp = logp_ref + 0.3 * torch.randn(n_r, t, generator=g, dtype=F64)
    div_tok = L.js_low_var(logp, logp_ref)
    full = torch.ones(micro, t)
    per_mb = [L.aggregate(pg_tok[i:i + micro], full, "token-mean") for i in range(0, n_f, micro)]
    per_mb += [eta * L.aggregate(div_tok[i:i + micro], full, "token-mean") for i in range(0, n_r, micro)]
    reference = torch.stack(per_mb).mean()

    obj = make_objective(LossConfig(objective="js_low_var", coeff=eta))
    counts = Counts(n_fresh=n_f, fresh_tokens=n_f * t, n_reference=n_r, reference_tokens=n_r * t)
    ours = sum(obj.fresh_share(_out(pg_tok[s]), torch.ones_like(pg_tok[s]), counts, norm=t).loss
               for s in (slice(0, 5), slice(5, 16)))
    ours = ours + sum(obj.reference_share(logp[s], logp_ref[s], torch.ones_like(logp[s]), counts, t).loss
                      for s in (slice(0, 1), slice(1, 4)))
    torch.testing.assert_close(ours, reference)


def test_fresh_terms_and_their_weights():
    g = torch.Generator().manual_seed(3)
    b, t = 6, 5
    pg_tok = torch.randn(b, t, generator=g, dtype=F64)
    logp, logp_ref = -torch.rand(b, t, generator=g, dtype=F64), -torch.rand(b, t, generator=g, dtype=F64)
    entropy = torch.rand(b, t, generator=g, dtype=F64)
    mask = torch.ones(b, t)
    mean = lambda x: x.sum() / (b * t)  # noqa: E731
    counts = Counts(n_fresh=b, fresh_tokens=b * t, n_reference=2, reference_tokens=2 * t)
    w = b / (b + 2)

    rkl = make_objective(LossConfig(objective="reverse_kl", coeff=0.02, entropy_coeff=0.01))
    share = rkl.fresh_share(_out(pg_tok), mask, counts, t, entropy=entropy, logp=logp, logp_ref=logp_ref)
    want = w * (mean(pg_tok) - 0.01 * mean(entropy) + 0.02 * mean(L.reverse_kl(logp, logp_ref)))
    torch.testing.assert_close(share.loss, want)
    assert set(share.parts) == {"pg", "entropy", "divergence_fresh"}

    js = make_objective(LossConfig(objective="js", coeff=0.1, js_online_fraction=0.1))
    share = js.fresh_share(_out(pg_tok), mask, counts, t, logp=logp, logp_ref=logp_ref)
    torch.testing.assert_close(share.loss, w * (mean(pg_tok) + 0.01 * mean(L.js_online_half(logp, logp_ref))))

    grpo = make_objective(LossConfig(objective="grpo"))
    torch.testing.assert_close(grpo.fresh_share(_out(pg_tok), mask, counts, t).loss, w * mean(pg_tok))
    with pytest.raises(ValueError, match="reference model"):
        rkl.fresh_share(_out(pg_tok), mask, counts, t)


def test_which_objectives_may_skip_zero_advantage_tokens():
    assert not make_objective(LossConfig(objective="grpo")).needs_every_fresh_token()
    assert not make_objective(LossConfig(objective="forward")).needs_every_fresh_token()
    assert make_objective(LossConfig(objective="grpo", entropy_coeff=0.01)).needs_every_fresh_token()
    assert make_objective(LossConfig(objective="reverse_kl")).needs_every_fresh_token()
