"""learner.min_step_seconds: an emulated slower learner pads each step before it publishes (a stand-in
trainer, replay and weight server: only the loop's timing and order are under test)."""

from __future__ import annotations

import threading
import time
import types

import numpy as np
import torch
from test_learner import group

from dph_async.config import RunConfig
from dph_async.learner.loop import LearnerLoop


class Replay:
    def get_batch(self, version, n, wait_s):
        rng = np.random.default_rng(version)
        return types.SimpleNamespace(groups=[group(i, [1.0, 0.0], rng) for i in range(n)], reference=[],
                                     waited_s=0.0, cycle_s=0.0, drops={})


def _loop(tmp_path, min_step_seconds: float, steps: int = 3):
    published: list[tuple[int, float]] = []
    trained: list[float] = []

    class Server:
        latest = 0

        def publish(self, state, version):
            published.append((version, time.monotonic()))
            return types.SimpleNamespace(nbytes=0)

    def train_step(batch):
        trained.append(time.monotonic())
        trainer.version += 1
        return {"loss/total": 0.0}

    trainer = types.SimpleNamespace(version=0, whole_state=lambda: {"w": torch.ones(1)}, train_step=train_step)
    cfg = RunConfig()
    cfg.learner.steps, cfg.learner.groups_per_step, cfg.learner.record_batches = steps, 2, False
    cfg.learner.min_step_seconds, cfg.learner.checkpoint_every = min_step_seconds, 0
    return LearnerLoop(cfg, trainer, Replay(), Server(), tmp_path), published, trained


def test_each_step_lasts_at_least_min_step_seconds_before_its_weights_are_published(tmp_path):
    loop, published, trained = _loop(tmp_path, 0.3)
    loop.run(threading.Event())
    rows = loop.metrics_since(0)
    assert len(rows) == 3 and all(0.25 <= r["time/padding"] <= 0.6 for r in rows)
    # versions 1-3 published, each at least the padding after its training began
    assert [v for v, _ in published] == [1, 2, 3]
    for (_, at), began in zip(published, trained, strict=True):
        assert at - began >= 0.29


def test_without_pacing_nothing_waits(tmp_path):
    loop, published, _ = _loop(tmp_path, 0.0)
    loop.run(threading.Event())
    assert all(r["time/padding"] == 0.0 for r in loop.metrics_since(0)) and len(published) == 3


def test_a_stop_ends_the_padding_at_once(tmp_path):
    loop, _, _ = _loop(tmp_path, 30.0, steps=1)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    start = time.monotonic()
    loop.run(stop)
    assert time.monotonic() - start < 5.0
