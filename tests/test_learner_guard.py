"""The learner's guard (learner/guard.py): what gets past the replay never reaches the weights.

A batch's unusable records are taken out before anything is computed; an update whose loss or
gradient is not finite leaves weights and optimizer state exactly as they were, at every ZeRO stage;
batches that keep doing so stop the run with one error naming their sources; non-finite weights are
never published.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
import torch
from test_learner import V, group, model_dir, trainer  # noqa: F401  (model_dir is a fixture)

from dph_async.config import RunConfig
from dph_async.learner.guard import NonFiniteTraining, StepGuard, check_finite, screen
from dph_async.learner.loop import LearnerLoop
from dph_async.protocol import Batch, ReferenceSample


def _batch(rewards: list[list[float]], seed: int = 0, actor: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    groups = [group(i, r, rng) for i, r in enumerate(rewards)]
    for g in groups:
        g.actor_id = actor
    return Batch(0, groups, [], {})


HEALTHY = [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0]]
# Finite rewards that pass any screen, yet overflow the group's mean and standard deviation: the
# advantages, the loss and the gradient are NaN.
OVERFLOWING = [[1e308, 1e308, -1e308, 0.0], [1.0, 0.0, 1.0, 0.0]]


def test_screen_takes_out_exactly_the_unusable_records():
    batch = _batch(HEALTHY * 3)
    g = batch.groups
    g[1].completions[2].reward = dataclasses.replace(g[1].completions[2].reward, score=float("nan"))
    g[3].completions[0].token_ids = g[3].completions[0].token_ids.copy()
    g[3].completions[0].token_ids[0] = V  # one past the embedding
    g[4].completions[1].logprobs = np.full_like(g[4].completions[1].logprobs, -np.inf)
    ok_ref = ReferenceSample("r0", np.arange(3, 6, dtype=np.int32), np.arange(4, 6, dtype=np.int32),
                             -np.ones(2, np.float32), 1.0, "t")
    bad_ref = ReferenceSample("r1", np.arange(3, 6, dtype=np.int32), np.arange(4, 6, dtype=np.int32),
                              np.array([-1.0, np.nan], np.float32), 1.0, "t")
    batch.reference = [ok_ref, bad_ref]
    batch.request_id, batch.waited_s, batch.cycle_s = 7, 0.25, 1.5
    clean, removed = screen(batch, V)
    assert sorted(removed) == ["0/1", "0/3", "0/4", "r1"]
    assert "reward nan" in removed["0/1"] and "outside the vocabulary" in removed["0/3"]
    assert [x.seq for x in clean.groups] == [0, 2, 5] and [r.sample_id for r in clean.reference] == ["r0"]
    # The rest of the batch as it came: what the learner logs with the step and steers staleness by.
    assert (clean.version, clean.drops, clean.request_id, clean.waited_s, clean.cycle_s) == (0, {}, 7, 0.25, 1.5)
    same, none = screen(_batch(HEALTHY), V)
    assert none == {} and len(same.groups) == 2


def _state(t) -> list[torch.Tensor]:
    """Every parameter and every optimizer-state tensor of the trainer, copied."""
    opt = t.engine.optimizer
    base = getattr(opt, "optimizer", opt)
    tensors = [p.detach().clone() for p in t.module.parameters()]
    for state in base.state.values():
        tensors += [v.detach().clone() for v in state.values() if torch.is_tensor(v)]
    for flat in getattr(opt, "single_partition_of_fp32_groups", []):  # ZeRO-1/2's fp32 master weights
        tensors.append(flat.detach().clone())
    return tensors


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_non_finite_update_leaves_weights_and_optimizer_state_unchanged(model_dir, stage):  # noqa: F811
    t = trainer(model_dir, zero_stage=stage)
    try:
        t.train_step(_batch(HEALTHY, seed=1))  # Adam has state to keep from here on
        before = _state(t)
        m = t.train_step(_batch(OVERFLOWING, seed=2))
        assert m["learner/skipped_updates"] == 1.0 and not np.isfinite(m["loss/total"])
        after = _state(t)
        assert len(after) == len(before) > len(list(t.module.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
        m = t.train_step(_batch(HEALTHY, seed=3))  # and training goes on from where it was
        assert m["learner/skipped_updates"] == 0.0 and t.version == 3
        weights = [p.detach() for p in t.module.parameters()]
        assert all(torch.isfinite(w).all() for w in weights)
        assert any(not torch.equal(w, b) for w, b in zip(weights, before, strict=False))
    finally:
        t.close()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_finite_loss_with_a_non_finite_gradient_is_skipped(model_dir, stage):  # noqa: F811
    """The loss alone does not tell: one gradient entry made infinite by a hook on a parameter, the
    loss finite, and the update must still be skipped."""
    t = trainer(model_dir, zero_stage=stage)
    try:
        t.train_step(_batch(HEALTHY, seed=1))
        before = _state(t)
        param = next(p for p in t.module.parameters() if p.requires_grad)
        hook = param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        m = t.train_step(_batch(HEALTHY, seed=2))
        hook.remove()
        assert np.isfinite(m["loss/total"]) and m["learner/skipped_updates"] == 1.0
        assert all(torch.equal(a, b) for a, b in zip(before, _state(t), strict=True))
    finally:
        t.close()


def test_batches_that_keep_failing_stop_the_run_naming_their_sources(model_dir):  # noqa: F811
    t = trainer(model_dir, zero_stage=0, max_skipped_steps=2)
    try:
        t.train_step(_batch(OVERFLOWING, seed=4, actor=3))
        t.train_step(_batch(HEALTHY, seed=5))  # a healthy batch resets the count
        t.train_step(_batch(OVERFLOWING, seed=6, actor=3))
        with pytest.raises(NonFiniteTraining, match=r"2 batches in a row .* actor 3 \(4 groups\).*groups 3/0, 3/1"):
            t.train_step(_batch(OVERFLOWING, seed=7, actor=3))
    finally:
        t.close()


def test_the_step_guard_counts_and_resets():
    guard = StepGuard(max_skipped=3)
    batch = _batch(HEALTHY, actor=9)
    guard.after_batch(batch, 1, 1)
    guard.after_batch(batch, 2, 2)
    assert guard.in_a_row == 2 and guard.skipped_updates == 3 and guard.sources == {9: 4}
    guard.after_batch(batch, 0, 3)
    assert guard.in_a_row == 0 and not guard.sources and guard.skipped_updates == 3
    never = StepGuard(max_skipped=0)
    for v in range(10):
        never.after_batch(batch, 1, v)  # 0: never stops
    assert never.in_a_row == 10


def test_non_finite_weights_are_never_published():
    state = {"a": torch.ones(3), "ids": torch.tensor([1, 2]), "b": torch.tensor([1.0, float("inf")])}
    with pytest.raises(NonFiniteTraining, match="version 7 hold non-finite values in 1 tensors \\(b\\)"):
        check_finite(state, 7)
    check_finite({"a": torch.ones(3)}, 7)  # finite weights pass


def test_the_loop_publishes_no_non_finite_weights(tmp_path):
    """The learner loop checks every state before the weight server sees it (a stand-in trainer and
    server: only the order matters here)."""
    published = []

    class Server:
        def publish(self, state, version):
            published.append(version)
            return types.SimpleNamespace(nbytes=0)

    weights = {"w": torch.ones(2)}
    trainer = types.SimpleNamespace(version=4, whole_state=lambda: weights)
    loop = LearnerLoop(RunConfig(), trainer, None, Server(), tmp_path)
    loop.publish()
    weights["w"] = torch.tensor([1.0, float("nan")])
    trainer.version = 5
    with pytest.raises(NonFiniteTraining, match="version 5"):
        loop.publish()
    assert published == [4]


def test_the_trainer_screens_its_batch_before_computing_anything(model_dir):  # noqa: F811
    """An id past the embedding would raise IndexError inside the model; a NaN reward would NaN the
    group's advantages: both groups leave the batch, and the rest trains."""
    t = trainer(model_dir, zero_stage=1)
    try:
        batch = _batch(HEALTHY * 2, seed=8)
        batch.groups[0].completions[1].token_ids = np.full_like(batch.groups[0].completions[1].token_ids, 2**31 - 1)
        c = batch.groups[3].completions[0]
        c.reward = dataclasses.replace(c.reward, score=float("nan"))
        m = t.train_step(batch)
        assert m["learner/screened_records"] == 2.0 and m["batch/groups"] == 2.0
        assert m["learner/skipped_updates"] == 0.0 and np.isfinite(m["loss/total"])
        assert all(torch.isfinite(p).all() for p in t.module.parameters())
    finally:
        t.close()
