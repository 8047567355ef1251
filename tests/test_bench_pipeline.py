"""The pipeline benchmark's plan of runs and its summary over repeats (no processes started)."""

from __future__ import annotations

import pytest

from dph_async.config import load_config
from dph_async.tools.bench.pipeline import Comparison, median_comparison, pair_names, plan


def test_plan_alternates_pairs_and_splits_the_sync_batch():
    cfg = load_config("default", ["actors.num_actors=3", "learner.groups_per_step=16", "replay.max_staleness=2"])
    runs = plan(cfg, actor_counts=[1, 3], repeats=3)
    assert list(runs) == ["sync", "async", "async-2", "sync-2", "sync-3", "async-3", "async-1actors"]
    assert pair_names(3) == [("sync", "async"), ("sync-2", "async-2"), ("sync-3", "async-3")]
    for name, c in runs.items():
        assert c.mode == name.split("-")[0]
        assert c.actors.num_actors == (1 if name == "async-1actors" else 3)
        # A third of the batch per actor (rounded up), a whole one for a single actor.
        assert c.actors.max_inflight_prompts == (16 if name == "async-1actors" else 6)
        if c.mode == "sync":  # eta 0 and weights every step
            assert (c.replay.max_staleness, c.learner.sync_every) == (0, 1)
        else:
            assert c.replay.max_staleness == 2


def test_median_over_repeats_takes_each_figure_on_its_own():
    pairs = [Comparison(0.3, 0.1, 1.2, 1.33, 0.9, 2, 0.2, 1.33, 0.9),
             Comparison(0.2, 0.2, 1.5, 2.0, 0.75, 2, 0.25, 1.6, 0.94),
             Comparison(0.4, 0.1, 1.1, 1.25, 0.88, 2, None, None, None)]
    m = median_comparison(pairs)
    assert (m.generate_s, m.train_s, m.speedup, m.ideal, m.of_ideal, m.cores) == pytest.approx(
        (0.3, 0.1, 1.2, 1.33, 0.88, 2))
    assert m.cpu_floor_s is None and m.ideal_cpu_bound is None  # not every repeat had CPU samples
    assert median_comparison(pairs[:2]).cpu_floor_s == pytest.approx(0.225)
