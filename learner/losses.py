"""The learner's losses: GRPO advantages, the off-policy PPO loss, the DPH-RL divergences, aggregation.

Small pure functions on torch tensors. Per-token tensors are [B, T], padded, with a mask [B, T]
(bool or 0/1 float; True = a generated token). Log-probs are natural logs at the sampling temperature:
  logp       log pi_theta(y_t)   the learner's, with grad
  logp_mu    log pi_mu(y_t)      behaviour: recorded by the actor that sampled y_t
  logp_prox  log pi_prox(y_t)    proximal: the learner's weights at the start of the batch, no grad
  logp_ref   log pi_0(y_t)       stored with a preserved reference sample, or from a frozen model
Every loss is a quantity to minimise. Inputs in bf16 or fp16 are computed in fp32 (`upcast`).
Which terms a training mode combines, and with what weights, is `learner/objectives.py`;
docs/losses.md has the derivations and the choices.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from dph_async.config.loss import LossConfig

LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp, as the reference implementation's k3
K3_CLAMP = 10.0  # |k3| bound, as the reference implementation's k3


def upcast(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Half-precision inputs in fp32: exp, log and differences of log-probs lose too much in bf16
    (js_low_var by up to 42% relative); fp32 and fp64 stay as they are."""
    return tuple(t.float() if t.is_floating_point() and t.element_size() < 4 else t for t in tensors)


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    return (x * mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """sum(x * mask) / sum(mask); 0 for an empty mask."""
    return masked_sum(x, mask) / mask.sum().clamp(min=1)


# --- GRPO advantages ------------------------------------------------------------------------------


def grpo_advantages(rewards: Tensor, use_std: bool = True, eps: float = 1e-6) -> Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps), or A_i = r_i - mean_g r without the std (Dr. GRPO).

    rewards [G, n]: one row per prompt group. std is the unbiased (n - 1) one, as in the reference
    implementation. A group with zero spread gets A = 0 exactly: it carries no signal.
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not use_std:
        return centred
    std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(centred[:, :1])
    return centred / (std + eps)


def zero_spread_groups(rewards: Tensor, atol: float = 0.0) -> Tensor:
    """[G] bool: groups whose rewards all agree (max - min <= atol). DAPO's dynamic filtering drops them."""
    return (rewards.amax(dim=1) - rewards.amin(dim=1)) <= atol


# --- Policy loss on fresh tokens ------------------------------------------------------------------


class PolicyLoss(NamedTuple):
    loss: Tensor  # [B, T] per-token loss to minimise, 0 outside `mask`
    mask: Tensor  # [B, T] float: the input mask times the `masked` correction's keep mask
    ratio: Tensor  # [B, T] the clipped ratio's argument, pi_theta / pi_mu or pi_theta / pi_prox (detached)
    is_weight: Tensor  # [B, T] pi_prox / pi_mu before truncation (detached), for diagnostics
    clipped: Tensor  # [B, T] bool: the PPO clip is active (no gradient through the ratio)
    dual_clipped: Tensor  # [B, T] bool: the dual clip is active


def log_ratio(logp: Tensor, logp_old: Tensor) -> Tensor:
    """log(pi / pi_old), clamped to +-20 before anyone exponentiates it."""
    return (logp - logp_old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ppo_clip(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float, dual_clip: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clip with clip-higher and dual clip, per token:

        l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        l = min(l, -A c)  where A < 0   (dual clip, c > 1: bounds the loss of a very large ratio)

    Returns (loss, clipped, dual_clipped); the loss has no gradient through r where either is set.
    """
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return loss, clipped & ~dual, dual


def _within_cap(w: Tensor, cap: float) -> Tensor:
    """1 where 1/cap <= w <= cap, else 0 (in w's dtype)."""
    return ((w >= 1.0 / cap) & (w <= cap)).to(w.dtype)


def correction_weights(log_w: Tensor, mask: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """The off-policy correction's per-token weight and keep mask, from log w = log(pi_prox / pi_mu)
    (C = cfg.is_cap; g = exp(mean_t log w), a sequence's geometric-mean weight):

        behavior        1                         keep all
        decoupled       min(w, C)                 keep all           (truncated IS)
        masked, token   w                         keep 1/C <= w <= C
        masked, seq.    min(w, C)                 keep sequences with 1/C <= g <= C
        areal           w                         keep w <= C        (AReaL's decoupled PPO with a cap)
        areal_sequence  g on every token          keep g <= C        (AReaL's sequence-level rule)

    Dropped tokens get weight 0 and stay in the caller's denominator (AReaL divides by every token).
    The caps compare the weights themselves, w <= C, as AReaL does: log w <= log C differs by one ulp
    where exp rounds a log-weight just above log C to exactly C.
    Returns (weight, keep), both [B, T] and detached; keep is float 0/1 and already includes `mask`.
    """
    mask = mask.to(log_w.dtype)
    c = cfg.is_cap
    w = log_w.exp()
    g = ((log_w * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).exp()
    ones = torch.ones_like(log_w)
    if cfg.correction == "behavior":
        weight, keep = ones, ones
    elif cfg.correction == "decoupled":
        weight, keep = w.clamp(max=c), ones
    elif cfg.correction == "masked" and cfg.mask_level == "token":
        weight, keep = w, _within_cap(w, c)
    elif cfg.correction == "masked":
        weight, keep = w.clamp(max=c), _within_cap(g, c).expand_as(log_w)
    elif cfg.correction == "areal":
        weight, keep = w, (w <= c).to(log_w.dtype)
    elif cfg.correction == "areal_sequence":
        weight, keep = g.expand_as(log_w), (g <= c).to(log_w.dtype).expand_as(log_w)
    else:
        raise ValueError(f"unknown correction {cfg.correction!r}")
    return weight.detach(), (keep * mask).detach()


def policy_loss(
    logp: Tensor,
    logp_mu: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    logp_prox: Tensor | None = None,
) -> PolicyLoss:
    """Per-token PPO loss on fresh tokens with off-policy correction `cfg.correction`:

        behavior:   l = ppo_clip(pi_theta / pi_mu, A)
        otherwise:  l = weight(w) * keep(w) * ppo_clip(pi_theta / pi_prox, A),   w = pi_prox / pi_mu

    with weight and keep from `correction_weights` (truncated, masked, or AReaL's rules); w is a
    constant (no gradient). advantages: [B] (one per sequence) or [B, T]. logp_prox is the policy at
    the start of the batch, recorded before its first update; it defaults to logp.detach() (one
    update per batch: the proximal policy is the current weights). When pi_mu = pi_prox every
    correction equals behavior exactly.
    """
    logp, logp_mu, advantages = upcast(logp, logp_mu, advantages)
    mask = mask.to(logp.dtype)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    prox = (logp if logp_prox is None else upcast(logp_prox)[0]).detach()
    log_w = log_ratio(prox, logp_mu.detach())
    log_r = log_ratio(logp, logp_mu.detach() if cfg.correction == "behavior" else prox)
    weight, keep = correction_weights(log_w, mask, cfg)
    ratio = log_r.exp()
    loss, clipped, dual = ppo_clip(ratio, adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)
    return PolicyLoss(weight * keep * loss, keep, ratio.detach(), log_w.exp(), clipped, dual)


# --- PPO with a learned critic ----------------------------------------------------------------


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over right-padded responses, per token t < T_i:

        delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   V(s_{T_i}) = 0 (the episode ends)
        A_t     = sum_k (gamma lam)^k delta_{t+k}
        G_t     = A_t + V(s_t)                        (the critic's regression target)

    rewards, values, mask [B, T]; padding after a response's last token is ignored. With the
    verifier's reward on the last token and gamma = lam = 1: A_t = R - V(s_t), G_t = R.
    Returns (advantages, returns), 0 outside `mask`, without gradient.
    """
    rewards, values = upcast(rewards.detach(), values.detach())
    mask = mask.to(values.dtype)
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m
        advantages[:, t] = running
        next_value = values[:, t] * m
    return advantages, (advantages + values) * mask


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries (population std), 0 outside `mask`."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    std = masked_mean((x - mean) ** 2, mask).sqrt()
    return (x - mean) / (std + eps) * mask


def value_loss(values: Tensor, values_old: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """Per-token clipped value loss, PPO's:

        l = 1/2 max((V - G)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - G)^2)

    V_old: the critic's values when the batch's advantages were computed; clip None gives
    l = 1/2 (V - G)^2. Minimised by V = G; the clip stops one update moving V far from V_old.
    """
    values, values_old, returns = upcast(values, values_old, returns)
    loss = (values - returns) ** 2
    if clip is not None:
        clipped = values_old + (values - values_old).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns) ** 2)
    return 0.5 * loss


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var(G - V) / Var(G) over the masked tokens: 1 for a perfect critic, 0 for a constant one at
    the mean return, negative for one worse than that (0 where the returns do not vary)."""
    values, returns = upcast(values.detach(), returns.detach())
    mask = mask.to(values.dtype)

    def var(x: Tensor) -> Tensor:
        return masked_mean((x - masked_mean(x, mask)) ** 2, mask)

    total = var(returns)
    return torch.where(total > 0, 1.0 - var(returns - values) / total.clamp(min=1e-30), torch.zeros_like(total))


# --- DPH divergences ------------------------------------------------------------------------------


def k3(log_r: Tensor) -> Tensor:
    """k3(r) = r - log r - 1 >= 0, with log r clamped to +-20 and the value to [-10, 10] (the reference
    implementation's `low_var_kl`). E_p[k3(q/p)] = KL(p || q) for samples from p. Past the value clamp,
    |log r| > ~11, the gradient is zero."""
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (log_r.exp() - log_r - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


def forward_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """DPH-F, on reference tokens y ~ pi_0: k3(u) = u - log u - 1 with u = pi_theta / pi_0 (clamped as k3).
    E_{pi_0}[.] = KL(pi_0 || pi_theta). d/d logp = u - 1 inside the clamps."""
    logp, logp_ref = upcast(logp, logp_ref)
    return k3(logp - logp_ref)


def js_low_var(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """DPH-JS, the "JS generator", on reference tokens: f(u) = u log u - (u + 1) log((u + 1) / 2).
    E_{pi_0}[f(u)] = KL(pi_theta || M) + KL(pi_0 || M) = 2 JS(pi_theta, pi_0), M = (pi_theta + pi_0) / 2.
    f >= 0, f(1) = f'(1) = 0; d/d logp = u log(2u / (1 + u)). No clamps (none in the reference)."""
    logp, logp_ref = upcast(logp, logp_ref)
    d = logp - logp_ref
    u = d.exp()
    # log((u + 1) / 2) = softplus(d) - log 2: finite where u overflows nothing and 1 + u rounds to 1.
    return u * d - (u + 1.0) * (torch.nn.functional.softplus(d) - math.log(2.0))


def js_reference_half(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """`js` ("JS definition") on reference tokens y ~ pi_0: k3 of M / pi_0 = (1 + u) / 2, with
    M = (pi_0 + pi_theta) / 2. E_{pi_0}[.] = KL(pi_0 || M).
    d/d logp = u (u - 1) / (2 (1 + u)) inside the clamps."""
    logp, logp_ref = upcast(logp, logp_ref)
    return k3(torch.logaddexp(logp, logp_ref) - math.log(2.0) - logp_ref)


def js_online_half(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """`js` on fresh tokens y ~ pi_theta with a frozen reference model: k3 of M' / pi_theta,
    M' = (pi_ref + pi_theta) / 2. E_{pi_theta}[.] = KL(pi_theta || M'). The gradient flows through
    pi_theta in both M' and the denominator."""
    logp, logp_ref = upcast(logp, logp_ref)
    return k3(torch.logaddexp(logp, logp_ref) - math.log(2.0) - logp)


def alpha_divergence(logp: Tensor, logp_ref: Tensor, alpha: float) -> Tensor:
    """On reference tokens: f(u) = (u^(1-a) - (1-a) u - a) / (a (a - 1)), 0 < a < 1, u = pi_theta / pi_0.
    E_{pi_0}[f(u)] = (1 - sum pi_0^a pi_theta^(1-a)) / (a (1 - a)); a -> 1 gives KL(pi_0 || pi_theta),
    a -> 0 gives KL(pi_theta || pi_0). d/d logp = (u - u^(1-a)) / a. No clamps (none in the reference)."""
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    logp, logp_ref = upcast(logp, logp_ref)
    d = logp - logp_ref
    return (torch.exp((1.0 - alpha) * d) - (1.0 - alpha) * d.exp() - alpha) / (alpha * (alpha - 1.0))


def reverse_kl(logp: Tensor, logp_ref: Tensor) -> Tensor:
    """On fresh tokens y ~ pi_theta with a frozen reference model: k3(pi_ref / pi_theta).
    E_{pi_theta}[.] = KL(pi_theta || pi_ref) (verl's `low_var_kl` KL loss)."""
    logp, logp_ref = upcast(logp, logp_ref)
    return k3(logp_ref - logp)


def reference_pg(logp: Tensor, logp_ref: Tensor, clip_low: float, clip_high: float) -> Tensor:
    """The official DPH-RL script's accident, on reference tokens it trains as policy gradient: a
    preserved sample is a group of one, so its GRPO advantage is its reward, +1, and its PPO ratio is
    taken against its stored pi_0 log-probs. Per token, u = pi_theta / pi_0:

        l = -min(u, clip(u, 1 - eps_low, 1 + eps_high)) = -min(u, 1 + eps_high)

    (PPO's clip at A = +1; the dual clip acts only on A < 0). d/d logp = -u below 1 + eps_high, 0
    above: supervised learning of pi_0's sample until pi_theta exceeds pi_0 by the clip."""
    logp, logp_ref = upcast(logp, logp_ref)
    ones = torch.ones_like(logp)
    return ppo_clip(log_ratio(logp, logp_ref).exp(), ones, clip_low, clip_high, None)[0]


# --- Aggregation ------------------------------------------------------------


def aggregate(
    per_token: Tensor, mask: Tensor, mode: str, norm: float | None = None, count: float | None = None
) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar:

        token-mean:          sum_bt l m / sum_bt m
        seq-mean-token-mean: mean over sequences with a token of (sum_t l m / sum_t m)
        seq-sum-norm:        sum_bt l m / (B norm)   (Dr. GRPO; norm a constant such as the max length)

    count: the whole batch's denominator (tokens for token-mean, sequences otherwise) when this
    [B, T] is one micro-batch of it, so that the micro-batches' losses add up to the batch's.
    """
    (per_token,) = upcast(per_token)
    mask = mask.to(per_token.dtype)
    if mode == "token-mean":
        total, denom = masked_sum(per_token, mask), mask.sum() if count is None else count
    elif mode == "seq-mean-token-mean":
        tokens = mask.sum(1)
        total = ((per_token * mask).sum(1) / tokens.clamp(min=1)).sum()
        denom = (tokens > 0).sum() if count is None else count
    elif mode == "seq-sum-norm":
        if norm is None:
            raise ValueError("seq-sum-norm needs `norm` (a constant, e.g. the maximum response length)")
        total, denom = masked_sum(per_token, mask) / norm, per_token.shape[0] if count is None else count
    else:
        raise ValueError(f"unknown aggregation {mode!r}")
    # An empty batch gives 0, not NaN; a tensor denominator stays on its device (no host sync).
    return total / torch.as_tensor(denom, dtype=total.dtype, device=total.device).clamp(min=1)
