"""The scaling model's projections against hand-computed values."""

from __future__ import annotations

import pytest

from dph_async import scaling
from dph_async.bench.pipeline import RunFigures, WeightSync

# 128 samples per step; one actor needs 0.01 s per sample (1.28 s per step alone); the learner
# trains 0.5 s and publishes 0.1 s per step; CPU: 0.012 s per sample on actors, 0.7 s per learner step.
COSTS = scaling.Costs(samples_per_step=128, actor_s_per_sample=0.01, train_s=0.5, publish_s=0.1,
                      actor_cpu_s_per_sample=0.012, learner_cpu_s_per_step=0.7, other_cores=0.0,
                      grad_bytes=4_000_000_000)


def test_async_is_the_slowest_of_generation_training_and_cpu():
    assert scaling.step_s(COSTS, "async", actors=1) == pytest.approx(1.28)  # generation-bound
    assert scaling.step_s(COSTS, "async", actors=4) == pytest.approx(0.6)  # learner-bound
    # Two shared cores: (128 x 0.012 + 0.7) / 2 = 1.118 s of CPU work per step.
    assert scaling.step_s(COSTS, "async", actors=4, cores=2) == pytest.approx(1.118)
    assert scaling.samples_per_s(COSTS, "async", actors=4) == pytest.approx(128 / 0.6)


def test_sync_adds_the_phases():
    assert scaling.step_s(COSTS, "sync", actors=1) == pytest.approx(1.28 + 0.6)
    assert scaling.step_s(COSTS, "sync", actors=4) == pytest.approx(0.32 + 0.6)
    # Generation alone on 2 cores: at least 128 x 0.012 / 2 = 0.768 s.
    assert scaling.step_s(COSTS, "sync", actors=4, cores=2) == pytest.approx(0.768 + 0.6)


def test_learner_ranks_split_training_and_pay_the_allreduce():
    # 4 GB of gradients at 8 GB/s: ring all-reduce moves 2 (R-1)/R of them.
    assert scaling.learner_step_s(COSTS, 1, 8.0) == pytest.approx(0.6)
    assert scaling.learner_step_s(COSTS, 2, 8.0) == pytest.approx(0.25 + 0.5 + 0.1)
    assert scaling.learner_step_s(COSTS, 4, 8.0) == pytest.approx(0.125 + 0.75 + 0.1)
    with pytest.raises(ValueError, match="mode"):
        scaling.step_s(COSTS, "fast", actors=1)


def _figures(mode: str, actors: int, step_s: float, cores: dict[str, float] | None) -> RunFigures:
    return RunFigures(
        name=mode, mode=mode, actors=actors, steps=10, window_s=10 * step_s, step_s=step_s,
        samples_per_s=128 / step_s, tokens_per_s=0.0, generate_s=0.64, train_s=0.6,
        learner_busy={"wait": 0.64 / step_s, "train": 0.5 / step_s, "publish": 0.1 / step_s},
        actors_busy=[], actor_tokens_per_s=0.0, learner_tokens_per_s=0.0,
        weights=WeightSync(10, 0.1, 1000, 20, 0.01, 1000, 0.1, 0.02), rollout_mb_per_s=0.0, staleness_hist={},
        reward_last=0.0, cpu_cores=cores, cpu_s_per_step=None)


def test_costs_from_a_sync_run_and_the_check():
    sync = _figures("sync", 2, 1.24, {"actors": 1.2, "learner": 0.5, "ray": 0.1})
    c = scaling.Costs.from_sync(sync)
    assert c.samples_per_step == pytest.approx(128)
    assert c.actor_s_per_sample == pytest.approx(0.64 * 2 / 128)
    assert c.train_s == pytest.approx(0.5) and c.publish_s == pytest.approx(0.1)
    assert c.actor_cpu_s_per_sample == pytest.approx(1.2 * 1.24 / 128)
    assert c.learner_cpu_s_per_step == pytest.approx(0.5 * 1.24)
    assert c.other_cores == pytest.approx(0.1) and c.grad_bytes == 1000
    # The model reproduces the run it was fitted on when the cores do not bind.
    row = scaling.check(c, [sync], cores=64)[0]
    assert row.projected == pytest.approx(row.measured) and row.error == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="no CPU samples"):
        scaling.Costs.from_sync(_figures("sync", 2, 1.24, None))
