"""The objectives: what each registered mode declares and uses, and that micro-batch shares add up to
the DPH-RL objective as the reference implementation weights it (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dph_async.config.loss import LossConfig
from dph_async.learner import losses as L
from dph_async.learner.batching import Counts
from dph_async.learner.objectives import OBJECTIVES, UnknownObjective, make_objective, objective_class

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
    # the official script's accident as a control: PG on a share of the pool, no divergence
    "dpef_pg": (True, False, lambda a, b: torch.zeros_like(a), None),
}


def test_every_objective_is_registered_once_with_its_needs():
    assert set(OBJECTIVES) == set(EXPECTED)
    for name, (pool, model, _, _) in EXPECTED.items():
        cls = objective_class(name)
        assert cls.name == name and cls.uses_pool == pool and cls.uses_reference_model == model
        assert cls.has_divergence() == ((pool and not cls.needs_pg_share) or model)
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


# --- As run: the official script's reference samples trained as policy gradient ---------------------


def test_reference_pg_is_ppo_at_advantage_one_against_pi0_in_float64():
    """-min(u, clip(u, 1 - eps_low, 1 + eps_high)) = -min(u, 1 + eps_high), gradient -u below the
    clip and 0 above, on fresh random log-probs (float64 closed form by hand, not through ppo_clip)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    logp_ref = -torch.rand(200, generator=g, dtype=F64) * 5
    logp = (logp_ref + torch.randn(200, generator=g, dtype=F64) * 0.4).requires_grad_(True)
    loss = L.reference_pg(logp, logp_ref, 0.2, 0.28)
    u = (logp.detach() - logp_ref).exp()
    torch.testing.assert_close(loss.detach(), -torch.minimum(u, torch.full_like(u, 1.28)), atol=1e-12, rtol=0)
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.where(u < 1.28, -u, torch.zeros_like(u)), atol=1e-12, rtol=0)
    assert bool((u < 0.8).any()) and bool((u > 1.28).any())  # both sides of the clip were exercised


def _as_run_case(seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 7, 5
    logp_ref = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp = logp_ref + 0.5 * torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) > 0.2
    as_pg = (torch.rand(b, generator=g) > 0.5).to(F64)
    counts = Counts(n_fresh=9, fresh_tokens=40, n_reference=b + 3, reference_tokens=int(mask.sum()) + 11)
    return logp, logp_ref, mask, as_pg, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_as_run_reference_share_splits_samples_between_the_divergence_and_pg(seed):
    """w * [eta * sum_{div tokens} f(u) + sum_{pg tokens} -min(u, 1 + eps_high)] / (reference tokens),
    in float64 with numpy's own arithmetic, the two parts over disjoint samples."""
    logp, logp_ref, mask, as_pg, counts = _as_run_case(seed)
    eta = 0.2
    obj = make_objective(LossConfig(objective="js_low_var", coeff=eta, reference_pg_share=0.4))
    share = obj.reference_share(logp, logp_ref, mask, counts, 5.0, as_pg=as_pg)
    u = (logp - logp_ref).exp().numpy()
    f = u * np.log(u) - (u + 1) * np.log((u + 1) / 2)
    pg_rows = as_pg.numpy()[:, None] > 0
    m = mask.numpy()
    want = (eta * (f * (m & ~pg_rows)).sum() - (np.minimum(u, 1.28) * (m & pg_rows)).sum()) / counts.reference_tokens
    want *= counts.n_reference / (counts.n_fresh + counts.n_reference)
    assert abs(float(share.loss) - want) < 1e-12
    assert set(share.parts) == {"divergence_ref", "pg_ref"}
    # the control: the same PG term, no divergence
    ctl = make_objective(LossConfig(objective="dpef_pg", reference_pg_share=0.4))
    got = ctl.reference_share(logp, logp_ref, mask, counts, 5.0, as_pg=as_pg).loss
    want_ctl = -(np.minimum(u, 1.28) * (m & pg_rows)).sum() / counts.reference_tokens
    assert abs(float(got) - want_ctl * counts.n_reference / (counts.n_fresh + counts.n_reference)) < 1e-12


def test_without_a_share_the_reference_part_is_the_divergence_alone():
    logp, logp_ref, mask, as_pg, counts = _as_run_case(5)
    obj = make_objective(LossConfig(objective="forward", coeff=0.05))
    plain = obj.reference_share(logp, logp_ref, mask, counts, 5.0)
    marked = obj.reference_share(logp, logp_ref, mask, counts, 5.0, as_pg=torch.zeros_like(as_pg))
    assert torch.equal(plain.loss, marked.loss) and set(plain.parts) == {"divergence_ref"}
    want = 0.05 * L.aggregate(L.forward_kl(logp, logp_ref), mask, "token-mean", count=counts.reference_tokens)
    torch.testing.assert_close(plain.loss, counts.reference_weight * want, atol=1e-12, rtol=0)


def test_prepare_marks_the_share_of_reference_samples_over_steps():
    """floor(p n + frac(v g)) samples a batch: exactly p over steps, never more than one off per batch."""
    from dph_async.learner.batching import prepare
    from dph_async.protocol import Batch, ReferenceSample

    def ref(i: int) -> ReferenceSample:
        ids = np.array([1, 2, 3], dtype=np.int32)
        return ReferenceSample(f"s{i}", ids, ids, np.full(3, -0.5, dtype=np.float32), 1.0, "test")

    n, p, steps = 6, 0.375, 400
    marked = []
    for v in range(steps):
        batch = prepare(Batch(v, [], [ref(i) for i in range(n)], {}), use_std=True, eps=1e-6,
                        filter_zero_spread=False, reference_pg_share=p)
        flags = [s.advantage for s in batch.reference]
        k = int(sum(flags))
        assert flags == [1.0] * k + [0.0] * (n - k) and abs(k - p * n) < 1
        marked.append(k)
    assert abs(sum(marked) / (steps * n) - p) < 2 / (steps * n)
    plain = prepare(Batch(3, [], [ref(i) for i in range(n)], {}), use_std=True, eps=1e-6, filter_zero_spread=False)
    assert all(s.advantage == 0.0 for s in plain.reference)


def test_official_share_from_the_scripts_layout():
    from dph_async.learner.as_run import official_pg_share

    # 8 GPUs: 288 a rank, rank 7 holds 32 rollouts + 256 preserved; its first mini-batch of 128 mixes
    # 32 with 96 of them. 16 GPUs: rank 14 holds 32 + 112, its first mini-batch of 64 mixes 32 + 32.
    assert official_pg_share() == 96 / 256
    assert official_pg_share(ranks=16) == 32 / 256
    # a chunk boundary that falls between mini-batches mixes none
    assert official_pg_share(n_fresh=2016 + 128, n_reference=160) == 0.0
    with pytest.raises(ValueError, match="ranks"):
        official_pg_share(ranks=7)


def test_as_run_presets_use_the_official_share():
    from dph_async.config import load_config
    from dph_async.learner.as_run import official_pg_share

    for preset, objective in (("js_low_var_as_run", "js_low_var"), ("dpef_pg", "dpef_pg")):
        loss = load_config(preset).learner.loss
        assert loss.objective == objective and loss.reference_pg_share == official_pg_share()
