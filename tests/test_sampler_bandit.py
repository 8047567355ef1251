"""The samplers bandit: its population loss and pair distributions against brute-force sums, its
optimal value against the closed form, and convergence of every sampler to it on a tiny setting."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from dph_async.cli.main import main as cli
from dph_async.samplers import SAMPLERS
from dph_async.tools import sampler_bandit as B

F64 = torch.float64


def _setting(k: int = 4, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(k, generator=g, dtype=F64)
    log_ref = F.log_softmax(torch.randn(k, generator=g, dtype=F64), -1)
    logp = F.log_softmax(torch.randn(k, generator=g, dtype=F64) * 2, -1)
    return rewards, log_ref, logp


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def _brute_pairs(name: str, p: list[float], q: list[float], beta: float) -> list[list[float]]:
    k = len(p)
    if name == "ref":
        return [[q[a] * q[b] for b in range(k)] for a in range(k)]
    if name == "online":
        return [[p[a] * p[b] for b in range(k)] for a in range(k)]
    if name == "gshf":
        return [[(p[a] * q[b] + q[a] * p[b]) / 2 for b in range(k)] for a in range(k)]
    raw = [[q[a] * q[b] * (2 + ((p[a] / q[a]) / (p[b] / q[b])) ** beta + ((p[b] / q[b]) / (p[a] / q[a])) ** beta)
            for b in range(k)] for a in range(k)]
    z = sum(map(sum, raw))
    return [[x / z for x in row] for row in raw]


@pytest.mark.parametrize("name", SAMPLERS)
def test_pair_distributions_and_population_loss_match_brute_force(name):
    rewards, log_ref, logp = _setting()
    beta = 1.7
    p, q, r = logp.exp().tolist(), log_ref.exp().tolist(), rewards.tolist()
    pairs = B.pair_distribution(name, logp, log_ref, beta)
    want = _brute_pairs(name, p, q, beta)
    torch.testing.assert_close(pairs, torch.tensor(want, dtype=F64), rtol=1e-12, atol=1e-14)
    assert float(pairs.sum()) == pytest.approx(1.0, abs=1e-12)
    h = [math.log(p[a] / q[a]) for a in range(4)]
    brute = 0.0
    for a, b in itertools.product(range(4), repeat=2):
        # label a > b with probability sigma(r_a - r_b): the DPO loss of whichever won
        win_a = _sig(r[a] - r[b])
        brute += want[a][b] * (win_a * -math.log(_sig(beta * (h[a] - h[b])))
                               + (1 - win_a) * -math.log(_sig(beta * (h[b] - h[a]))))
    assert float(B.population_loss(logp, log_ref, rewards, beta, pairs)) == pytest.approx(brute, rel=1e-12)


def test_optimal_value_is_the_closed_form_and_is_the_maximum():
    rewards, log_ref, _ = _setting(k=5, seed=9)
    beta = 0.8
    v_star = float(B.optimal_value(rewards, log_ref, beta))
    log_opt = F.log_softmax(log_ref + rewards / beta, -1)
    assert float(B.value(log_opt, log_ref, rewards, beta)) == pytest.approx(v_star, rel=1e-12)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        other = F.log_softmax(torch.randn(5, generator=g, dtype=F64) * 3, -1)
        assert float(B.value(other, log_ref, rewards, beta)) < v_star


@pytest.mark.parametrize("name", SAMPLERS)
def test_the_optimal_policy_is_a_stationary_point_for_every_sampler(name):
    rewards, log_ref, logp = _setting(k=6, seed=5)
    beta = 2.0
    for theta0, stationary in ((log_ref + rewards / beta, True), (logp, False)):
        theta = theta0.clone().requires_grad_(True)
        lp = F.log_softmax(theta, -1)
        loss = B.population_loss(lp, log_ref, rewards, beta, B.pair_distribution(name, lp, log_ref, beta))
        (grad,) = torch.autograd.grad(loss, theta)
        assert (float(grad.abs().max()) < 1e-12) == stationary


def test_every_sampler_converges_to_the_optimal_value_on_a_tiny_bandit():
    cfg = B.BanditConfig(actions=4, beta=1.0, lr=5.0, updates=300, seed=2)
    res = B.simulate(cfg)
    assert set(res.gap) == set(SAMPLERS)
    for name, gap in res.gap.items():
        assert gap[0] > 1e-2, name
        assert -1e-12 < gap[-1] < 1e-8, (name, gap[-1])  # V* - V >= 0 up to rounding


def test_empirical_loss_is_unbiased_for_the_population_loss():
    rewards, log_ref, logp = _setting()
    beta = 1.3
    pairs = B.pair_distribution("gshf", logp, log_ref, beta)
    g = torch.Generator().manual_seed(4)
    draws = torch.stack([B.empirical_loss(logp, log_ref, rewards, beta, pairs, 500, g) for _ in range(200)])
    want = float(B.population_loss(logp, log_ref, rewards, beta, pairs))
    se = float(draws.std() / math.sqrt(len(draws)))
    assert abs(float(draws.mean()) - want) < 4 * se


def test_command_writes_the_curves_and_the_plot(tmp_path, capsys):
    rc = cli(["simulate", "samplers", "--actions", "5", "--updates", "20", "--samplers", "online", "mixp",
              "-o", str(tmp_path)])
    assert rc == 0
    assert (tmp_path / "bandit_gap.png").stat().st_size > 1000
    import json

    data = json.loads((tmp_path / "bandit.json").read_text())
    assert set(data["gap"]) == {"online", "mixp"} and len(data["gap"]["mixp"]) == 20
    assert "V* =" in capsys.readouterr().out
    assert cli(["simulate", "samplers", "--beta", "0", "--out", str(tmp_path)]) == 2


def test_every_registered_sampler_has_its_pair_distribution():
    """A sampler added to dph_async/samplers.py without its bandit form fails here, not mid-simulation."""
    assert B.PAIRS.keys() == SAMPLERS.keys()
