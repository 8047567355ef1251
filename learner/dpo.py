"""Online DPO: preference pairs from rollout groups, and the pair losses.

A pair is one prompt's highest-reward response y_w against its lowest-reward one y_l; a group
whose rewards all agree gives no pair (a tie: skipped and counted). With sequence log-probs
(sums over tokens, at the sampling temperature) of pi_theta and of the frozen reference pi_ref,

    h = [log pi_theta(y_w) - log pi_ref(y_w)] - [log pi_theta(y_l) - log pi_ref(y_l)]

and each loss is a function of h (beta > 0):

    sigmoid   -log sigma(beta h)                                       (DPO)
    ipo       (h - 1 / (2 beta))^2                                     (IPO)
    rev_kl    -p log sigma(beta h) - (1 - p) log sigma(-beta h),  p = sigma(r_w - r_l)

rev_kl is the samplers paper's variant (its `loss_type=rev_kl`): the cross-entropy between the
Bradley-Terry preference of the two rewards and the model's implicit one, so a pair with a small
reward margin pulls less than a clear one; its minimum over h is at beta h = r_w - r_l.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from dph_async.learner.batching import Unit


def pair_log_ratio(logp_w: Tensor, ref_w: Tensor, logp_l: Tensor, ref_l: Tensor) -> Tensor:
    """h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)), on sequence log-probs [P]."""
    return (logp_w - ref_w) - (logp_l - ref_l)


def sigmoid_loss(h: Tensor, beta: float) -> Tensor:
    """-log sigma(beta h) = softplus(-beta h); d/dh = -beta sigma(-beta h)."""
    return F.softplus(-beta * h)


def ipo_loss(h: Tensor, beta: float) -> Tensor:
    """(h - 1 / (2 beta))^2; d/dh = 2 (h - 1 / (2 beta)). Its minimum is at h = 1 / (2 beta)."""
    return (h - 1.0 / (2.0 * beta)) ** 2


def rev_kl_loss(h: Tensor, beta: float, reward_margin: Tensor) -> Tensor:
    """-p log sigma(beta h) - (1 - p) log sigma(-beta h), p = sigma(r_w - r_l);
    d/dh = beta (sigma(beta h) - p)."""
    p = torch.sigmoid(reward_margin.to(h.dtype))
    return p * F.softplus(-beta * h) + (1.0 - p) * F.softplus(beta * h)


def _extremes(g: Unit) -> tuple[Unit, float]:
    """The group's first highest-reward sequence against its first lowest-reward one, and the margin;
    when the group comes from exactly two sampling distributions (gshf, mixp), one from each: the
    better of (best of one, worst of the other) and the reverse."""
    sides = sorted({s.policy_weight for s in g})
    if len(sides) != 2:
        best, worst = max(g, key=lambda s: s.reward), min(g, key=lambda s: s.reward)
        return [best, worst], best.reward - worst.reward
    options = []
    for a, b in (sides, sides[::-1]):
        best = max((s for s in g if s.policy_weight == a), key=lambda s: s.reward)
        worst = min((s for s in g if s.policy_weight == b), key=lambda s: s.reward)
        options.append(([best, worst], best.reward - worst.reward))
    return max(options, key=lambda o: o[1])


def form_pairs(groups: list[Unit]) -> tuple[list[Unit], int]:
    """One pair [y_w, y_l] per group: its first highest-reward sequence against its first
    lowest-reward one, one from each distribution when the group was sampled from two (`_extremes`).
    A pair's sequences carry the reward margin as their advantage, +m on y_w and -m on y_l
    (m = r_w - r_l > 0): the sign says which is chosen, m is what rev_kl uses. Returns the pairs and
    the number of groups skipped as ties (no pair with a positive margin)."""
    pairs: list[Unit] = []
    ties = 0
    for g in groups:
        (best, worst), margin = _extremes(g)
        if margin <= 0:
            ties += 1
            continue
        pairs.append([replace(best, advantage=margin), replace(worst, advantage=-margin)])
    return pairs, ties


def split_pairs(seq_values: Tensor, advantages: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Sequences laid out as pairs (y_w, y_l, y_w, y_l, ...) -> (values of y_w [P], of y_l [P], margins [P]).
    Refuses a layout whose advantages are not (+m, -m) pairs: a split pair would train on nonsense."""
    if seq_values.shape[0] % 2:
        raise ValueError(f"DPO micro-batch holds {seq_values.shape[0]} sequences: pairs were split")
    adv = advantages.reshape(-1, 2)
    if not (bool((adv[:, 0] > 0).all()) and torch.equal(adv[:, 1], -adv[:, 0])):
        raise ValueError("DPO micro-batch sequences are not (chosen, rejected) pairs: pairs were split")
    v = seq_values.reshape(-1, 2)
    return v[:, 0], v[:, 1], adv[:, 0]
