"""The samplers paper's tabular bandit: how fast DPO converges under each way of sampling its pairs.

One prompt, K actions with rewards r (seeded N(0, 1)), a tabular policy pi_theta = softmax(theta) and
a reference pi_ref = softmax(theta_0) (uniform by default). Preferences follow Bradley-Terry,
P(a > a') = sigma(r_a - r_a'). With h_a = log pi_theta(a) - log pi_ref(a), DPO on pairs drawn from
a sampler S(a, a') minimises the population loss

    L(theta) = -sum_{a, a'} S(a, a') [sigma(r_a - r_a') log sigma(beta (h_a - h_a'))
                                      + sigma(r_a' - r_a) log sigma(beta (h_a' - h_a))]

(the expectation over the Bernoulli labels, exact; `empirical` draws n pairs and labels instead).
Every sampler with full support has the same minimiser, pi* ∝ pi_ref exp(r / beta), whose
KL-regularised value is V* = beta log sum_a pi_ref(a) exp(r_a / beta); what differs is the speed.

Samplers (pi = pi_theta, detached; rho = pi / pi_ref):
    ref      S = pi_ref x pi_ref                              (vanilla DPO on reference samples)
    online   S = pi x pi                                      (on-policy DPO)
    gshf     S = (pi x pi_ref + pi_ref x pi) / 2              (one response from each)
    mixp     S ∝ pi_ref x pi_ref [2 + (rho_a / rho_a')^beta + (rho_a' / rho_a)^beta]
             (the samplers paper's mixture: half uniform pairs, half pairs from pi_ref rho^beta against
             pi_ref rho^-beta, which it implements with logits mixed between pi_theta and pi_ref)

Tracked per update: V(pi) = sum_a pi(a) (r_a - beta log(pi(a) / pi_ref(a))) and the gap V* - V(pi).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from dph_async.pipeline.plot_colours import pyplot
from dph_async.samplers import SAMPLERS, sampler


@dataclass
class BanditConfig:
    actions: int = 20
    beta: float = 3.0
    lr: float = 10.0  # plain gradient descent on theta, as the samplers paper's exact runs
    updates: int = 100
    seed: int = 1234567
    # 0: exact population gradient; n > 0: n sampled pairs with sampled labels per update.
    empirical_pairs: int = 0
    samplers: tuple[str, ...] = tuple(SAMPLERS)


@dataclass
class BanditResult:
    config: BanditConfig
    rewards: list[float]
    optimal_value: float
    value: dict[str, list[float]] = field(default_factory=dict)
    gap: dict[str, list[float]] = field(default_factory=dict)


def optimal_value(rewards: Tensor, log_ref: Tensor, beta: float) -> Tensor:
    """V* = max_pi sum pi (r - beta log(pi / pi_ref)) = beta log sum pi_ref exp(r / beta)."""
    return beta * torch.logsumexp(log_ref + rewards / beta, dim=-1)


def value(logp: Tensor, log_ref: Tensor, rewards: Tensor, beta: float) -> Tensor:
    """V(pi) = sum_a pi(a) (r_a - beta log(pi(a) / pi_ref(a)))."""
    return (logp.exp() * (rewards - beta * (logp - log_ref))).sum(-1)


def _mixp(logp: Tensor, log_ref: Tensor, beta: float) -> Tensor:
    q = log_ref.exp()
    log_rho = logp - log_ref
    d = beta * (log_rho[:, None] - log_rho[None, :])
    s = q[:, None] * q[None, :] * (2 + d.exp() + (-d).exp())
    return s / s.sum()


# The joint S(a, a') of each sampler of dph_async/samplers.py, in the samplers paper's bandit form (the table above).
PAIRS: dict[str, Callable[[Tensor, Tensor, float], Tensor]] = {
    "ref": lambda logp, log_ref, beta: log_ref.exp()[:, None] * log_ref.exp()[None, :],
    "online": lambda logp, log_ref, beta: logp.exp()[:, None] * logp.exp()[None, :],
    "gshf": lambda logp, log_ref, beta: (logp.exp()[:, None] * log_ref.exp()[None, :]
                                        + log_ref.exp()[:, None] * logp.exp()[None, :]) / 2,
    "mixp": _mixp,
}


def pair_distribution(name: str, logp: Tensor, log_ref: Tensor, beta: float) -> Tensor:
    """The sampler's joint S(a, a') [K, K] (rows: the first response), from detached log-probs."""
    return PAIRS[sampler(name).name](logp.detach(), log_ref, beta)


def population_loss(logp: Tensor, log_ref: Tensor, rewards: Tensor, beta: float, pairs: Tensor) -> Tensor:
    """L(theta) above: the DPO loss averaged over pairs ~ S and Bradley-Terry labels, exactly."""
    h = logp - log_ref
    d = beta * (h[:, None] - h[None, :])
    pref = torch.sigmoid(rewards[:, None] - rewards[None, :])
    return -(pairs * (pref * F.logsigmoid(d) + (1 - pref) * F.logsigmoid(-d))).sum()


def empirical_loss(logp: Tensor, log_ref: Tensor, rewards: Tensor, beta: float, pairs: Tensor, n: int,
                   gen: torch.Generator) -> Tensor:
    """n pairs drawn from S, each labelled by a Bradley-Terry coin; the mean DPO loss on them."""
    k = pairs.shape[0]
    idx = torch.multinomial(pairs.reshape(-1), n, replacement=True, generator=gen)
    a, b = idx // k, idx % k
    first_wins = torch.rand(n, generator=gen, dtype=rewards.dtype) < torch.sigmoid(rewards[a] - rewards[b])
    w, lo = torch.where(first_wins, a, b), torch.where(first_wins, b, a)
    h = logp - log_ref
    return -F.logsigmoid(beta * (h[w] - h[lo])).mean()


def simulate(cfg: BanditConfig, log_ref: Tensor | None = None,
             on_update: Callable[[], None] | None = None) -> BanditResult:
    """Train one tabular policy per sampler from pi_ref, all on the same rewards; float64 throughout."""
    gen = torch.Generator().manual_seed(cfg.seed)
    rewards = torch.randn(cfg.actions, generator=gen, dtype=torch.float64)
    if log_ref is None:
        log_ref = torch.full((cfg.actions,), -math.log(cfg.actions), dtype=torch.float64)
    v_star = float(optimal_value(rewards, log_ref, cfg.beta))
    result = BanditResult(cfg, rewards.tolist(), v_star)
    for name in cfg.samplers:
        theta = log_ref.clone().requires_grad_(True)
        opt = torch.optim.SGD([theta], lr=cfg.lr)
        values = []
        for _ in range(cfg.updates):
            logp = F.log_softmax(theta, -1)
            values.append(float(value(logp.detach(), log_ref, rewards, cfg.beta)))
            pairs = pair_distribution(name, logp, log_ref, cfg.beta)
            if cfg.empirical_pairs:
                loss = empirical_loss(logp, log_ref, rewards, cfg.beta, pairs, cfg.empirical_pairs, gen)
            else:
                loss = population_loss(logp, log_ref, rewards, cfg.beta, pairs)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if on_update:
                on_update()
        result.value[name] = values
        result.gap[name] = [v_star - v for v in values]
    return result


def write(result: BanditResult, out: Path) -> list[Path]:
    """bandit.json (config, rewards, curves) and bandit_gap.png (V* - V per update, log scale)."""
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    data = asdict(result)
    data["config"]["samplers"] = list(result.config.samplers)
    (out / "bandit.json").write_text(json.dumps(data, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, gap in result.gap.items():
        ax.plot(range(1, len(gap) + 1), [max(g, 1e-16) for g in gap], label=name, lw=2)
    c = result.config
    mode = f"{c.empirical_pairs} sampled pairs" if c.empirical_pairs else "exact gradient"
    ax.set(xlabel="updates", ylabel="V* - V(pi)", yscale="log",
           title=f"DPO samplers, tabular bandit (K={c.actions}, beta={c.beta:g}, lr={c.lr:g}, {mode})")
    ax.legend()
    fig.tight_layout()
    png = out / "bandit_gap.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return [out / "bandit.json", png]
