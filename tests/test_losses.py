"""Losses against closed forms, in float64, on fresh random inputs.

Divergence estimators: on a random categorical pi_0 / pi_theta over K outcomes, the estimator's exact
expectation (sum over outcomes, weighted by the sampling policy) must equal the closed-form divergence
to 1e-10, and its Monte Carlo mean over 200,000 draws must lie within 5 standard errors of it.
"""

from __future__ import annotations

import math

import pytest
import torch

from dph_async.config.loss import LossConfig
from dph_async.learner import losses as L

F64 = torch.float64
K = 7


def categorical_pair(seed: int, spread: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random distributions over K outcomes, log-probs in float64; ratios stay inside k3's clamps."""
    g = torch.Generator().manual_seed(seed)
    return (
        torch.log_softmax(torch.randn(K, generator=g, dtype=F64) * spread, 0),
        torch.log_softmax(torch.randn(K, generator=g, dtype=F64) * spread, 0),
    )


def kl(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    return (logp.exp() * (logp - logq)).sum()


def js(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    logm = torch.logaddexp(logp, logq) - math.log(2.0)
    return 0.5 * (kl(logp, logm) + kl(logq, logm))


ALPHA = 0.35


# (estimator per outcome y, sampling policy: "ref" = pi_0 or "theta", closed form)
ESTIMATORS = {
    "forward": (lambda lt, l0: L.forward_kl(lt, l0), "ref", lambda lt, l0: kl(l0, lt)),
    "js_low_var": (lambda lt, l0: L.js_low_var(lt, l0), "ref", lambda lt, l0: 2 * js(lt, l0)),
    "js_reference_half": (
        lambda lt, l0: L.js_reference_half(lt, l0),
        "ref",
        lambda lt, l0: kl(l0, torch.logaddexp(lt, l0) - math.log(2.0)),
    ),
    "js_online_half": (
        lambda lt, l0: L.js_online_half(lt, l0),
        "theta",
        lambda lt, l0: kl(lt, torch.logaddexp(lt, l0) - math.log(2.0)),
    ),
    "alpha": (
        lambda lt, l0: L.alpha_divergence(lt, l0, ALPHA),
        "ref",
        lambda lt, l0: (1 - (ALPHA * l0 + (1 - ALPHA) * lt).exp().sum()) / (ALPHA * (1 - ALPHA)),
    ),
    "reverse_kl": (lambda lt, l0: L.reverse_kl(lt, l0), "theta", lambda lt, l0: kl(lt, l0)),
}


@pytest.mark.parametrize("name", ESTIMATORS)
def test_divergence_estimators_are_unbiased(name):
    estimator, sampler, exact = ESTIMATORS[name]
    log_theta, log_ref = categorical_pair(seed=len(name))
    values = estimator(log_theta, log_ref)  # the estimator at each of the K outcomes
    log_sampler = log_ref if sampler == "ref" else log_theta
    target = exact(log_theta, log_ref)
    assert target > 1e-3  # a non-trivial pair
    torch.testing.assert_close((log_sampler.exp() * values).sum(), target, atol=1e-10, rtol=0)
    draws = torch.multinomial(
        log_sampler.exp(), 200_000, replacement=True, generator=torch.Generator().manual_seed(7)
    )
    sample = values[draws]
    std_err = sample.std() / math.sqrt(len(sample))
    assert abs(sample.mean() - target) < 5 * std_err


def test_js_halves_add_up_to_twice_js():
    """The `js` definition's two halves, each on its own samples, estimate KL(pi_0||M) + KL(pi_theta||M)."""
    log_theta, log_ref = categorical_pair(seed=11)
    ref_half = (log_ref.exp() * L.js_reference_half(log_theta, log_ref)).sum()
    online_half = (log_theta.exp() * L.js_online_half(log_theta, log_ref)).sum()
    torch.testing.assert_close(ref_half + online_half, 2 * js(log_theta, log_ref), atol=1e-10, rtol=0)


@pytest.mark.parametrize(("alpha", "limit"), [(1 - 1e-5, "forward"), (1e-5, "reverse")])
def test_alpha_limits(alpha, limit):
    """alpha -> 1: per token u - log u - 1 (forward KL's k3); alpha -> 0: u log u - u + 1, whose
    expectation under pi_0 is KL(pi_theta || pi_0)."""
    log_theta, log_ref = categorical_pair(seed=12)
    values = L.alpha_divergence(log_theta, log_ref, alpha)
    u = (log_theta - log_ref).exp()
    if limit == "forward":
        per_token, exact = u - u.log() - 1, kl(log_ref, log_theta)
    else:
        per_token, exact = u * u.log() - u + 1, kl(log_theta, log_ref)
    torch.testing.assert_close(values, per_token, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close((log_ref.exp() * values).sum(), exact, atol=1e-4, rtol=1e-4)


DIVERGENCES = {
    "forward": lambda lt, l0: L.forward_kl(lt, l0),
    "js_low_var": lambda lt, l0: L.js_low_var(lt, l0),
    "js_reference_half": lambda lt, l0: L.js_reference_half(lt, l0),
    "js_online_half": lambda lt, l0: L.js_online_half(lt, l0),
    "alpha": lambda lt, l0: L.alpha_divergence(lt, l0, ALPHA),
    "reverse_kl": lambda lt, l0: L.reverse_kl(lt, l0),
}


def grad_wrt_logp(fn, logp: torch.Tensor, logp_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logp = logp.clone().requires_grad_()
    value = fn(logp, logp_ref)
    (grad,) = torch.autograd.grad(value.sum(), logp)
    return value.detach(), grad


@pytest.mark.parametrize("name", DIVERGENCES)
def test_u_equal_one_gives_zero_loss_and_gradient(name):
    logp = -torch.rand(50, dtype=F64) * 8  # any log-probs, with pi_theta = pi_ref
    value, grad = grad_wrt_logp(DIVERGENCES[name], logp, logp.clone())
    assert value.abs().max() < 1e-12 and grad.abs().max() < 1e-12


@pytest.mark.parametrize("name", DIVERGENCES)
def test_divergences_are_nonnegative(name):
    g = torch.Generator().manual_seed(13)
    logp, logp_ref = (
        -torch.rand(500, generator=g, dtype=F64) * 12,
        -torch.rand(500, generator=g, dtype=F64) * 12,
    )
    assert (DIVERGENCES[name](logp, logp_ref) >= -1e-12).all()


def test_gradients_match_closed_forms():
    """d loss / d logp at random u against the formulas in the docstrings (and the research table)."""
    g = torch.Generator().manual_seed(14)
    logp_ref = -torch.rand(200, generator=g, dtype=F64) * 5
    logp = logp_ref + torch.randn(200, generator=g, dtype=F64).clamp(-2.5, 2.5)  # inside k3 clamps (u < 13.6)
    u = (logp - logp_ref).exp()
    expected = {
        "forward": u - 1,
        "js_low_var": u * torch.log(2 * u / (1 + u)),
        "js_reference_half": u * (u - 1) / (2 * (1 + u)),
        "alpha": (u - u ** (1 - ALPHA)) / ALPHA,
        # reverse KL: k3(1/u) = 1/u + log u - 1, d/d logp = 1 - 1/u
        "reverse_kl": 1 - 1 / u,
        # online half: s = (1/u + 1)/2, d/d logp [s - log s - 1] = (1 - 1/s) ds/dlogp, ds/dlogp = -1/(2u)
        "js_online_half": -(1 - 2 / (1 / u + 1)) / (2 * u),
    }
    for name, want in expected.items():
        _, grad = grad_wrt_logp(DIVERGENCES[name], logp, logp_ref)
        torch.testing.assert_close(grad, want, atol=1e-12, rtol=1e-10, msg=name)


def test_k3_clamps_switch_off_forgotten_tokens():
    """Forward KL: |log u| > ~11.0 puts k3 past its value clamp of 10: no gradient (reference behaviour)."""
    logp_ref = torch.zeros(4, dtype=F64)
    logp = torch.tensor([-12.0, -30.0, -10.0, 2.0], dtype=F64)
    value, grad = grad_wrt_logp(L.forward_kl, logp, logp_ref)
    torch.testing.assert_close(value[:2], torch.full((2,), 10.0, dtype=F64))
    assert (grad[:2] == 0).all()
    torch.testing.assert_close(grad[2:], logp[2:].exp() - 1)
    with pytest.raises(ValueError, match="alpha"):
        L.alpha_divergence(logp, logp_ref, 1.0)


# --- GRPO -----------------------------------------------------------------------------------------


def test_grpo_advantages():
    g = torch.Generator().manual_seed(16)
    rewards = torch.randint(0, 2, (12, 8), generator=g).to(F64)
    rewards[0] = 1.0  # zero spread
    rewards[1] = torch.rand(8, generator=g, dtype=F64)
    spread = ~L.zero_spread_groups(rewards)
    assert not spread[0] and spread[1]
    adv = L.grpo_advantages(rewards, use_std=True, eps=1e-12)
    torch.testing.assert_close(adv.mean(1), torch.zeros(12, dtype=F64), atol=1e-12, rtol=0)
    torch.testing.assert_close(adv[spread].std(1), torch.ones(int(spread.sum()), dtype=F64))
    assert (adv[~spread] == 0).all()
    plain = L.grpo_advantages(rewards, use_std=False)
    torch.testing.assert_close(plain, rewards - rewards.mean(1, keepdim=True))
    assert (L.grpo_advantages(rewards[:, :1]) == 0).all()  # groups of one: no signal, no NaN


def test_zero_spread_tolerance():
    rewards = torch.tensor([[0.5, 0.5 + 1e-9], [0.0, 1.0]], dtype=F64)
    assert L.zero_spread_groups(rewards).tolist() == [False, False]
    assert L.zero_spread_groups(rewards, atol=1e-6).tolist() == [True, False]


# --- PPO and the off-policy corrections -----------------------------------------------------------


def cfg(**kw) -> LossConfig:
    return LossConfig(**{"clip_low": 0.2, "clip_high": 0.28, "dual_clip": 3.0, **kw})


@pytest.mark.parametrize(
    ("adv", "ratio", "grad", "clipped", "dual"),
    [
        (1.0, 1.1, -1.1, False, False),  # inside the clip range: d(-A r)/dlogp = -A r
        (1.0, 1.5, 0.0, True, False),  # above 1 + eps_high with A > 0: clipped
        (1.0, 0.5, -0.5, False, False),  # below 1 - eps_low with A > 0: pessimistic min keeps r
        (-1.0, 0.5, 0.0, True, False),  # below 1 - eps_low with A < 0: clipped
        (-1.0, 1.1, 1.1, False, False),
        (-1.0, 2.0, 2.0, False, False),  # above 1 + eps_high with A < 0: unclipped, up to c
        (-1.0, 4.0, 0.0, False, True),  # beyond c = 3: dual clip, loss -A c
        (2.0, 1.25, -2.5, False, False),  # clip-higher: 1.25 < 1 + 0.28 is inside
    ],
)
def test_ppo_clip_regions(adv, ratio, grad, clipped, dual):
    logp_mu = torch.tensor([[-1.3]], dtype=F64)
    logp = (logp_mu + math.log(ratio)).requires_grad_()
    out = L.policy_loss(
        logp, logp_mu, torch.tensor([adv], dtype=F64), torch.ones(1, 1), cfg(correction="behavior")
    )
    (g,) = torch.autograd.grad(out.loss.sum(), logp)
    torch.testing.assert_close(g.item(), grad, atol=1e-12, rtol=1e-12)
    assert out.clipped.item() == clipped and out.dual_clipped.item() == dual
    if dual:
        torch.testing.assert_close(out.loss.item(), -adv * 3.0)


def random_batch(seed: int, b: int = 6, t: int = 9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(b, t, generator=g, dtype=F64) * 3
    logp_mu = logp + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    logp_prox = logp + 0.3 * torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.rand(b, t, generator=g) < 0.8
    adv = torch.randn(b, generator=g, dtype=F64)
    return logp, logp_mu, logp_prox, mask, adv


def loss_and_grad(logp, logp_mu, adv, mask, config, logp_prox=None):
    logp = logp.clone().requires_grad_()
    out = L.policy_loss(logp, logp_mu, adv, mask, config, logp_prox)
    (g,) = torch.autograd.grad(out.loss.sum(), logp)
    return out, g


@pytest.mark.parametrize(
    ("correction", "level"), [("decoupled", "token"), ("masked", "token"), ("masked", "sequence")]
)
def test_corrections_reduce_to_behavior_when_policies_coincide(correction, level):
    logp, logp_mu, _, mask, adv = random_batch(seed=17)
    base, g_base = loss_and_grad(logp, logp_mu, adv, mask, cfg(correction="behavior"))
    # pi_prox = pi_mu, any pi_theta: w = 1, ratio against pi_prox is the ratio against pi_mu.
    out, g = loss_and_grad(logp, logp_mu, adv, mask, cfg(correction=correction, mask_level=level), logp_mu)
    torch.testing.assert_close(out.loss, base.loss, atol=0, rtol=0)
    torch.testing.assert_close(g, g_base, atol=0, rtol=0)
    # all three equal (the first step on fresh on-policy data): r = 1, loss = -A on every token.
    out, g = loss_and_grad(logp, logp, adv, mask, cfg(correction=correction, mask_level=level), logp)
    torch.testing.assert_close(out.loss, -adv[:, None].expand_as(logp) * mask, atol=1e-12, rtol=0)
    torch.testing.assert_close(g, -adv[:, None].expand_as(logp) * mask, atol=1e-12, rtol=0)


def test_decoupled_weights_the_gradient_by_the_truncated_is_weight():
    logp, logp_mu, logp_prox, mask, adv = random_batch(seed=18)
    logp_prox = logp.clone()  # r = 1 everywhere: the gradient is -A w
    out, g = loss_and_grad(logp, logp_mu, adv, mask, cfg(correction="decoupled", is_cap=1.2), logp_prox)
    w = (logp_prox - logp_mu).exp()
    torch.testing.assert_close(g, -adv[:, None] * w.clamp(max=1.2) * mask, atol=1e-12, rtol=0)
    torch.testing.assert_close(out.is_weight, w)
    assert (w > 1.2).any()  # the truncation was exercised


def test_masked_correction_drops_tokens_and_sequences():
    logp, logp_mu, logp_prox, mask, adv = random_batch(seed=19)
    cap = 1.25
    log_w = logp_prox - logp_mu
    out, _ = loss_and_grad(logp, logp_mu, adv, mask, cfg(correction="masked", is_cap=cap), logp_prox)
    keep = log_w.abs() <= math.log(cap)
    assert (~keep & mask).any() and (keep & mask).any()
    torch.testing.assert_close(out.mask, (mask & keep).to(F64))
    assert (out.loss[~keep] == 0).all()
    out, _ = loss_and_grad(
        logp, logp_mu, adv, mask, cfg(correction="masked", is_cap=cap, mask_level="sequence"), logp_prox
    )
    geo = (log_w * mask).sum(1) / mask.sum(1)
    keep_seq = geo.abs() <= math.log(cap)
    torch.testing.assert_close(out.mask, (mask & keep_seq[:, None]).to(F64))


def test_advantages_per_token():
    logp, logp_mu, _, mask, adv = random_batch(seed=20)
    a = L.policy_loss(logp, logp_mu, adv, mask, cfg(correction="behavior")).loss
    b = L.policy_loss(logp, logp_mu, adv[:, None].expand_as(logp), mask, cfg(correction="behavior")).loss
    torch.testing.assert_close(a, b, atol=0, rtol=0)


# --- Aggregation and the DPH weighting ------------------------------------------------------------


def test_aggregation_modes_and_micro_batches():
    g = torch.Generator().manual_seed(21)
    loss = torch.randn(8, 10, generator=g, dtype=F64)
    mask = torch.rand(8, 10, generator=g) < 0.7
    mask[3] = False  # an empty sequence
    m = mask.to(F64)
    expected = {
        "token-mean": (loss * m).sum() / m.sum(),
        "seq-mean-token-mean": torch.stack(
            [(loss[i] * m[i]).sum() / m[i].sum() for i in range(8) if i != 3]
        ).mean(),
        "seq-sum-norm": (loss * m).sum() / (8 * 16.0),
    }
    counts = {"token-mean": m.sum(), "seq-mean-token-mean": 7, "seq-sum-norm": 8}
    for mode, want in expected.items():
        torch.testing.assert_close(L.aggregate(loss, mask, mode, norm=16.0), want)
        halves = sum(
            L.aggregate(loss[s], mask[s], mode, norm=16.0, count=counts[mode])
            for s in (slice(0, 5), slice(5, 8))
        )
        torch.testing.assert_close(halves, want)
    assert L.aggregate(loss, torch.zeros_like(mask), "token-mean") == 0
    with pytest.raises(ValueError, match="norm"):
        L.aggregate(loss, mask, "seq-sum-norm")


# --- Off-policy corrections against scalar closed forms ---------------------------------------------


def scalar_ppo(r: float, a: float, lo: float = 0.2, hi: float = 0.28, c: float = 3.0) -> tuple[float, float]:
    """(loss, d loss / d log r) of the clipped, dual-clipped PPO loss for one token, case by case."""
    unclipped, clipped = -a * r, -a * min(max(r, 1 - lo), 1 + hi)
    loss, grad = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
    if a < 0 and loss > -a * c:
        loss, grad = -a * c, 0.0
    return loss, grad


def expected_correction(correction: str, level: str, logp, logp_mu, logp_prox, mask, adv, cap):
    """Per-token loss and gradient, token by token in Python floats, from the rules' definitions."""
    b, t = logp.shape
    loss, grad = torch.zeros(b, t, dtype=F64), torch.zeros(b, t, dtype=F64)
    for i in range(b):
        toks = [j for j in range(t) if mask[i, j]]
        g = math.exp(sum(logp_prox[i, j].item() - logp_mu[i, j].item() for j in toks) / max(len(toks), 1))
        for j in toks:
            w = math.exp(logp_prox[i, j].item() - logp_mu[i, j].item())
            base = logp_mu if correction == "behavior" else logp_prox
            r = math.exp(logp[i, j].item() - base[i, j].item())
            weight = {
                "behavior": 1.0,
                "decoupled": min(w, cap),
                "masked": (w if 1 / cap <= w <= cap else 0.0) if level == "token"
                else (min(w, cap) if 1 / cap <= g <= cap else 0.0),
                "areal": w if w <= cap else 0.0,
                "areal_sequence": g if g <= cap else 0.0,
            }[correction]
            l, d = scalar_ppo(r, adv[i].item())
            loss[i, j], grad[i, j] = weight * l, weight * d
    return loss, grad


@pytest.mark.parametrize(("correction", "level"), [
    ("behavior", "token"), ("decoupled", "token"), ("masked", "token"), ("masked", "sequence"),
    ("areal", "token"), ("areal_sequence", "token"),
])
def test_correction_rules_match_their_definitions(correction, level):
    cap = 1.3
    logp, logp_mu, logp_prox, mask, adv = random_batch(seed=23, b=8, t=7)
    out, g = loss_and_grad(logp, logp_mu, adv, mask, cfg(correction=correction, mask_level=level, is_cap=cap),
                           logp_prox)
    want_loss, want_grad = expected_correction(correction, level, logp, logp_mu, logp_prox, mask, adv, cap)
    torch.testing.assert_close(out.loss, want_loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(g, want_grad, atol=1e-12, rtol=1e-12)


def test_areal_rule_zeroes_tokens_above_the_cap_and_keeps_them_in_the_denominator():
    """AReaL's decoupled loss: w > C gives weight 0 (not C), and the token-mean still divides by every
    token; the truncated rule keeps those tokens at weight C. Both sides of the cap occur here."""
    cap = 1.2
    logp, logp_mu, logp_prox, mask, adv = random_batch(seed=24, b=10, t=9)
    w = (logp_prox - logp_mu).exp()
    above = (w > cap) & mask
    assert above.any() and (~above & mask).any()
    areal = L.policy_loss(logp, logp_mu, adv, mask, cfg(correction="areal", is_cap=cap), logp_prox)
    trunc = L.policy_loss(logp, logp_mu, adv, mask, cfg(correction="decoupled", is_cap=cap), logp_prox)
    assert (areal.loss[above] == 0).all() and (trunc.loss[above] != 0).all()
    torch.testing.assert_close(areal.loss[~above], trunc.loss[~above] * w[~above] / w[~above].clamp(max=cap))
    agg = L.aggregate(areal.loss, mask, "token-mean")
    torch.testing.assert_close(agg, areal.loss.sum() / mask.sum())


@pytest.mark.parametrize(("correction", "level"), [
    ("areal", "token"), ("areal_sequence", "token"), ("masked", "token"), ("masked", "sequence"),
])
def test_cap_keeps_a_weight_exactly_equal_to_it(correction, level):
    """AReaL keeps a token when exp(log w) <= C. The log-weight one ulp above log 2 rounds to w = 2.0
    exactly under exp, so it is kept at C = 2 (a comparison of log w with log C drops it); the next
    weight that exp rounds above C is dropped. One token per row, so the sequence rules see the same w."""
    cap = 2.0
    at = torch.nextafter(torch.tensor(math.log(cap), dtype=F64), torch.tensor(1.0, dtype=F64))
    assert at.exp().item() == cap and at.item() > math.log(cap)
    above = at
    while above.exp().item() <= cap:
        above = torch.nextafter(above, torch.tensor(1.0, dtype=F64))
    log_w = torch.stack([at, above]).unsqueeze(1)
    weight, keep = L.correction_weights(log_w, torch.ones_like(log_w, dtype=torch.bool),
                                        cfg(correction=correction, mask_level=level, is_cap=cap))
    assert keep.flatten().tolist() == [1.0, 0.0]
    assert weight[0, 0].item() == cap


@pytest.mark.parametrize("name", ["forward", "js_low_var", "js_reference_half", "js_online_half", "reverse_kl"])
def test_half_precision_inputs_are_computed_in_fp32(name):
    """bf16 log-probs: the divergence of the rounded inputs, computed in fp32, not in bf16."""
    g = torch.Generator().manual_seed(25)
    logp = (-torch.rand(400, generator=g) * 6).bfloat16()
    logp_ref = (logp.float() + 0.05 * torch.randn(400, generator=g)).bfloat16()
    got = DIVERGENCES[name](logp, logp_ref)
    want = DIVERGENCES[name](logp.double(), logp_ref.double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-4)
