"""The scaling model's projections against hand-computed values."""

from __future__ import annotations

import pytest

from dph_async.tools import scaling
from dph_async.tools.bench.figures import RunFigures, WeightSync

# 128 samples (16 groups) per step; actors need 0.01 CPU-s per sample (1.28 s per step for one actor
# alone); the learner 0.6 CPU-s per step; new weights reach the actors 0.05 s after a publish; a sync
# step loses 0.1 s to weights and tickets on their way; 4 GB of gradients.
COSTS = scaling.Costs(samples_per_step=128, actor_cpu_s_per_sample=0.01, learner_cpu_s_per_step=0.6,
                      weight_latency_s=0.05, sync_latency_s=0.1, other_cores=0.0, grad_bytes=4_000_000_000)


def lay(actors: int, **kw) -> scaling.Layout:
    return scaling.Layout(actors, **kw)


def test_async_is_the_slowest_of_generation_training_the_weight_chain_and_cpu():
    # Even split, eta 1: one actor is generation-bound; the chain (0.05 + 1.28 + 0.6) / 2 = 0.965 is below.
    assert scaling.step_s(COSTS, "async", lay(1)) == pytest.approx(1.28)
    # Two actors: generation 0.64 and training 0.6 are below the chain (0.05 + 0.64 + 0.6) / 2.
    assert scaling.step_s(COSTS, "async", lay(2)) == pytest.approx(0.645)
    assert scaling.step_s(COSTS, "async", lay(4)) == pytest.approx(0.6)  # learner-bound
    # Two shared cores: (1.28 + 0.6) / 2 = 0.94 s of CPU work per step.
    assert scaling.step_s(COSTS, "async", lay(4, eta=4, cores=2)) == pytest.approx(0.94)
    assert scaling.samples_per_s(COSTS, "async", lay(4, eta=4)) == pytest.approx(128 / 0.6)
    # Cores taken by Ray's services are not the pipeline's.
    busy = scaling.Costs(128, 0.01, 0.6, 0.05, 0.1, other_cores=0.5, grad_bytes=0)
    assert scaling.step_s(busy, "async", lay(4, eta=4, cores=2)) == pytest.approx(1.88 / 1.5)


def test_async_admission_limits_the_actors_that_work():
    # 16 tickets go to the first actor asking when each may hold 16: one actor per batch, and with
    # eta 1 one batch at a time, however many actors there are.
    whole = dict(groups_per_step=16, inflight_prompts=16)
    assert scaling.step_s(COSTS, "async", lay(4, **whole)) == pytest.approx(1.28)
    # eta 2: two batches at once, each on one actor (0.64 s per step), but the chain binds.
    assert scaling.step_s(COSTS, "async", lay(4, eta=2, **whole)) == pytest.approx((0.05 + 1.28 + 0.6) / 3)
    assert scaling.step_s(COSTS, "async", lay(4, eta=4, **whole)) == pytest.approx(0.6)
    # At most 8 per actor: a batch is split over two actors.
    assert scaling.step_s(COSTS, "async", lay(4, groups_per_step=16, inflight_prompts=8)) == pytest.approx(
        (0.05 + 0.64 + 0.6) / 2)


def test_sync_adds_the_phases_and_its_latency():
    assert scaling.step_s(COSTS, "sync", lay(1)) == pytest.approx(0.1 + 1.28 + 0.6)
    assert scaling.step_s(COSTS, "sync", lay(4)) == pytest.approx(0.1 + 0.32 + 0.6)
    # Generation alone on 2 cores: at least 1.28 / 2 = 0.64 s.
    assert scaling.step_s(COSTS, "sync", lay(4, cores=2)) == pytest.approx(0.1 + 0.64 + 0.6)


def test_learner_ranks_split_training_and_pay_the_allreduce():
    # 4 GB of gradients at 8 GB/s: a ring all-reduce moves 2 (R-1)/R of them.
    assert scaling.learner_step_s(COSTS, lay(1, allreduce_gb_s=8.0)) == pytest.approx(0.6)
    assert scaling.learner_step_s(COSTS, lay(1, ranks=2, allreduce_gb_s=8.0)) == pytest.approx(0.3 + 0.5)
    assert scaling.learner_step_s(COSTS, lay(1, ranks=4, allreduce_gb_s=8.0)) == pytest.approx(0.15 + 0.75)
    # On two shared cores, four ranks split the work two ways only (and still pay the all-reduce).
    assert scaling.learner_step_s(COSTS, lay(1, ranks=4, cores=2, allreduce_gb_s=8.0)) == pytest.approx(0.3 + 0.75)
    with pytest.raises(ValueError, match="mode"):
        scaling.step_s(COSTS, "fast", lay(1))


def _figures(mode: str, actors: int, step_s: float, cores: dict[str, float] | None) -> RunFigures:
    return RunFigures(
        name=mode, mode=mode, actors=actors, eta=0, inflight_prompts=8, groups_per_step=16, steps=10,
        window_s=10 * step_s, step_s=step_s,
        samples_per_s=128 / step_s, tokens_per_s=0.0, generate_s=0.64, train_s=0.6,
        learner_busy={"wait": 0.64 / step_s, "train": 0.5 / step_s, "publish": 0.1 / step_s},
        actors_busy=[], all_waiting=0.0, actor_tokens_per_s=0.0, learner_tokens_per_s=0.0,
        weights=WeightSync(10, 0.1, 1000, 20, 0.01, 1000, 0.1, 0.02), rollout_mb_per_s=0.0, staleness_hist={},
        reward_last=0.0, cpu_cores=cores, cpu_s_per_step=None, learner_phase_s={}, actor_span_s={})


def test_costs_from_a_sync_run_and_the_check():
    # 2 actors used 1.2 cores and the learner 0.5 over 1.24 s steps; g = 0.64 s of which the actors'
    # work is 1.2 x 1.24 / 2 = 0.744 s: more than g, so no sync latency is left over.
    sync = _figures("sync", 2, 1.24, {"actors": 1.2, "learner": 0.5, "ray": 0.1, "outside": 0.4})
    c = scaling.Costs.from_sync(sync)
    assert c.samples_per_step == pytest.approx(128)
    assert c.actor_cpu_s_per_sample == pytest.approx(1.2 * 1.24 / 128)
    assert c.learner_cpu_s_per_step == pytest.approx(0.5 * 1.24)
    assert c.sync_latency_s == 0.0 and c.weight_latency_s == pytest.approx(0.02)
    assert c.other_cores == pytest.approx(0.1) and c.grad_bytes == 1000
    slow = _figures("sync", 2, 1.24, {"actors": 0.4, "learner": 0.5, "ray": 0.1})
    assert scaling.Costs.from_sync(slow).sync_latency_s == pytest.approx(0.64 - 0.4 * 1.24 / 2)
    # The check projects each run on the cores others left it, and on the whole machine.
    row = scaling.check(c, [sync], cores=2)[0]
    assert row.cores == pytest.approx(1.6)
    assert row.projected == pytest.approx(scaling.samples_per_s(c, "sync", lay(2, cores=1.6)))
    assert row.projected_idle == pytest.approx(scaling.samples_per_s(c, "sync", lay(2, cores=2)))
    assert row.error == pytest.approx(row.projected / sync.samples_per_s - 1)
    with pytest.raises(ValueError, match="no CPU samples"):
        scaling.Costs.from_sync(_figures("sync", 2, 1.24, None))
