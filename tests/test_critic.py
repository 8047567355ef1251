"""PPO with a learned critic: GAE, the clipped value loss, whitening and explained variance against
float64 closed forms; the critic's targets recomputed by the learner; its loss and update the same
whatever the micro-batch packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_learner import batch, model_dir, trainer  # noqa: F401  (model_dir: the fixture)

from dph_async.config import ConfigError, load_config
from dph_async.learner import losses as L
from dph_async.learner.batching import prepare
from dph_async.learner.trainer import StepRecord
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import validate


def gae_reference(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list, list]:
    """GAE by its definition, A_t = sum_k (gamma lam)^k delta_{t+k}, in float64 Python."""
    n = len(rewards)
    nxt = [*values[1:], 0.0]
    delta = [rewards[t] + gamma * nxt[t] - values[t] for t in range(n)]
    adv = [sum((gamma * lam) ** k * delta[t + k] for k in range(n - t)) for t in range(n)]
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
def test_gae_matches_its_definition_on_ragged_responses(gamma, lam):
    rng = np.random.default_rng(0)
    lengths = [5, 1, 3, 7]
    t = max(lengths)
    rewards, values = torch.zeros(4, t, dtype=torch.float64), torch.zeros(4, t, dtype=torch.float64)
    mask = torch.zeros(4, t, dtype=torch.bool)
    for i, n in enumerate(lengths):
        rewards[i, :n] = torch.from_numpy(rng.normal(size=n))
        values[i, :n] = torch.from_numpy(rng.normal(size=n))
        mask[i, :n] = True
    # Padding must not leak in: garbage there changes nothing.
    rewards[~mask], values[~mask] = 7.0, -3.0
    adv, ret = L.gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths):
        a, g = gae_reference(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        np.testing.assert_allclose(adv[i, :n].numpy(), a, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(ret[i, :n].numpy(), g, rtol=1e-12, atol=1e-12)
        assert not adv[i, n:].any() and not ret[i, n:].any()


def test_gae_with_a_terminal_reward_and_gamma_lam_one_is_return_minus_value():
    values = torch.tensor([[0.2, 0.5, 0.9]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    adv, ret = L.gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), 1.0, 1.0)
    torch.testing.assert_close(adv, 1.0 - values)
    torch.testing.assert_close(ret, torch.ones(1, 3, dtype=torch.float64))


def test_clipped_value_loss_closed_form_and_gradient():
    v = torch.tensor([0.0, 0.5, 1.0, -0.3, 2.0], dtype=torch.float64, requires_grad=True)
    v_old = torch.tensor([0.1, 0.1, 0.9, 0.0, 0.0], dtype=torch.float64)
    g = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    eps = 0.2
    loss = L.value_loss(v, v_old, g, eps)
    expect, grad = [], []
    for vi, oi, gi in zip(v.tolist(), v_old.tolist(), g.tolist(), strict=True):
        vc = oi + min(max(vi - oi, -eps), eps)
        a, b = (vi - gi) ** 2, (vc - gi) ** 2
        expect.append(0.5 * max(a, b))
        # The clipped branch has no gradient where the clip is active (its argument is constant there).
        grad.append(vi - gi if a >= b else (vc - gi if abs(vi - oi) < eps else 0.0))
    np.testing.assert_allclose(loss.detach().numpy(), expect, rtol=1e-12)
    loss.sum().backward()
    np.testing.assert_allclose(v.grad.numpy(), grad, rtol=1e-12)
    np.testing.assert_allclose(L.value_loss(v, v_old, g, None).detach().numpy(),
                               0.5 * (v.detach().numpy() - g.numpy()) ** 2, rtol=1e-12)


def test_whiten_and_explained_variance_closed_forms():
    x = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    vals = np.array([1.0, 2.0, 4.0])
    w = L.whiten(x, mask)
    np.testing.assert_allclose(w[mask].numpy(), (vals - vals.mean()) / vals.std(), rtol=1e-7)
    assert not w[~mask].any()
    g = torch.tensor([[1.0, 0.0, 5.0], [1.0, 3.0, 3.0]], dtype=torch.float64)
    gv = np.array([1.0, 0.0, 1.0])
    ev = 1 - np.var(gv - vals) / np.var(gv)
    assert float(L.explained_variance(x, g, mask)) == pytest.approx(ev, rel=1e-12)
    assert float(L.explained_variance(g, g, mask)) == 1.0
    assert float(L.explained_variance(torch.full_like(g, 2 / 3), g, mask)) == pytest.approx(0.0, abs=1e-12)


def test_critic_targets_come_from_the_learner_and_advantages_are_whitened(model_dir):  # noqa: F811
    t = trainer(model_dir, lr=1e-3, critic={"enabled": True})
    m = t.train_step(batch(5))
    assert {"critic/explained_variance", "critic/value_loss", "critic/value_mean"} <= set(m)
    # A learned critic gives per-token advantages to every sequence: none is skipped.
    assert m["batch/trained_fresh_tokens"] == m["batch/fresh_tokens"]
    groups = prepare(batch(5), use_std=True, eps=1e-6, filter_zero_spread=False).groups
    t._critic_update(groups, StepRecord())
    seqs = [s for g in groups for s in g]
    adv = torch.cat([s.token_advantages for s in seqs]).double()
    assert abs(float(adv.mean())) < 1e-5 and float(adv.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


def test_the_critic_learns_a_fixed_batch(model_dir):  # noqa: F811
    t = trainer(model_dir, lr=1e-6, critic={"enabled": True, "lr": 1e-2})
    metrics = [t.train_step(batch(5)) for _ in range(20)]
    losses = [m["critic/value_loss"] for m in metrics]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert metrics[-1]["critic/explained_variance"] > 0.5, metrics[-1]


def test_the_critic_update_is_the_same_whatever_the_packing(model_dir):  # noqa: F811
    def critic_after(budget: int) -> list[torch.Tensor]:
        t = trainer(model_dir, micro_token_budget=budget, critic={"enabled": True})
        t.train_step(batch(5))
        return [p.detach().clone() for p in t.critic.model.parameters()]

    for a, b in zip(critic_after(24), critic_after(4096), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_what_a_critic_cannot_serve_is_refused_before_the_run_starts():
    with pytest.raises(ConfigError, match=r"learner\.critic: .*learner\.ranks=1"):
        load_config("default", ["learner.critic.enabled=true", "learner.ranks=2"])
    with pytest.raises(ConfigError, match=r"learner\.critic\.enabled: objective 'dpo'"):
        validate(load_config("default", ["learner.critic.enabled=true"]), [RunSpec.parse("dpo")])


def test_the_critic_is_saved_and_restored_with_the_learner(model_dir, tmp_path):  # noqa: F811
    """Restored into a trainer that has trained on other data (as a kept learner process's would have):
    the critic's weights and every value of its optimizer's state (Adam's moments and step count)
    are those saved, not merely the same keys."""
    a = trainer(model_dir, critic={"enabled": True})
    a.train_step(batch(5))
    a.save(tmp_path, {})
    b = trainer(model_dir, critic={"enabled": True})
    b.train_step(batch(6))
    b.load(tmp_path, "v1")
    for x, y in zip(a.critic.model.parameters(), b.critic.model.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    saved, restored = a.critic.optimizer.state_dict(), b.critic.optimizer.state_dict()
    assert restored["state"].keys() == saved["state"].keys() and saved["state"]
    for key, state in saved["state"].items():
        assert state.keys() == restored["state"][key].keys()
        for name, value in state.items():
            assert torch.equal(restored["state"][key][name], value), f"optimizer state {key}/{name} differs"
    assert restored["param_groups"] == saved["param_groups"]


def test_the_critic_serves_every_mini_batch_and_epoch(model_dir):  # noqa: F811
    t = trainer(model_dir, mini_batches=2, epochs=2, critic={"enabled": True}, loss={"correction": "decoupled"})
    m = t.train_step(batch(6))
    assert m["learner/optimizer_steps"] == 4 and m["policy/ratio_dev"] > 1e-4
