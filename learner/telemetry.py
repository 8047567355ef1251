"""The learner's Prometheus metrics and health: steps as its `LearnerLoop` logs them, stats at each scrape."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Per-step metrics summed into counters: (metrics key, Prometheus name, help).
TOTALS = (
    ("batch/fresh_tokens", "dph_learner_fresh_tokens", "Fresh response tokens in the batches trained on"),
    ("batch/fresh_samples", "dph_learner_fresh_samples", "Fresh completions trained on"),
    ("batch/scorer_failed", "dph_learner_scorer_failed", "Completions left out: the scorer failed on them"),
    ("batch/filtered_groups", "dph_learner_filtered_groups", "Zero-spread groups dropped by dynamic filtering"),
)


def checkpoint_usage(directory: Path) -> tuple[int, int]:
    """(checkpoints, bytes) under a learner's checkpoint directory."""
    dirs = [d for d in directory.glob("v*") if d.is_dir()] if directory.is_dir() else []
    size = sum(f.stat().st_size for d in dirs for f in d.rglob("*") if f.is_file())
    return len(dirs), size


class LearnerCollector(Collector):
    """Counters summed from each step's metrics as the loop logs it; gauges from the last step."""

    def __init__(self, loop) -> None:
        self.loop = loop
        self._totals = {key: 0.0 for key, _, _ in TOTALS}
        self._last: dict[str, float] = {}
        # replay.max_staleness=auto: the last window's mean ESS and mean data wait
        self._signal: float | None = None
        self._wait: float | None = None
        self._lock = threading.Lock()
        loop.listeners.append(self._observe)

    def _observe(self, m: dict[str, float]) -> None:
        with self._lock:
            for key in self._totals:
                self._totals[key] += m.get(key, 0.0)
            self._last = m
            self._signal = m.get("staleness/signal", self._signal)
            self._wait = m.get("staleness/wait", self._wait)

    def _snapshot(self) -> tuple[dict[str, float], dict[str, float], float | None, float | None]:
        with self._lock:
            return dict(self._totals), self._last, self._signal, self._wait

    def collect(self) -> Iterator[Metric]:
        totals, last, signal, wait = self._snapshot()
        stats = self.loop.stats
        yield GaugeMetricFamily("dph_learner_version", "Optimizer steps applied", value=self.loop.trainer.version)
        yield CounterMetricFamily("dph_learner_steps", "Steps taken by this process", value=stats.steps)
        for key, name, doc in TOTALS:
            yield CounterMetricFamily(name, doc, value=totals[key])
        yield GaugeMetricFamily("dph_learner_tokens_per_second", "Tokens per second of the last step",
                                value=last.get("learner/tokens_per_s", 0.0))
        yield GaugeMetricFamily("dph_learner_reward_mean", "Mean reward of the last batch",
                                value=last.get("reward/mean", 0.0))
        yield GaugeMetricFamily("dph_learner_staleness_max", "Largest staleness in the last batch",
                                value=last.get("staleness/max", 0.0))
        if "staleness/eta" in last:  # replay.max_staleness=auto (learner/staleness_control.py)
            yield GaugeMetricFamily("dph_learner_staleness_bound", "The staleness bound eta the learner set",
                                    value=last["staleness/eta"])
        if signal is not None:
            yield GaugeMetricFamily("dph_learner_staleness_signal", "Mean ESS of the last window of the "
                                    "staleness controller", value=signal)
        if wait is not None:
            yield GaugeMetricFamily("dph_learner_staleness_wait", "Mean fraction of the learner's time spent "
                                    "waiting for data over the last window of the staleness controller", value=wait)
        seconds = CounterMetricFamily("dph_learner_seconds", "Time spent, by activity", labels=["what"])
        for what in ("train", "wait", "publish", "checkpoint"):
            seconds.add_metric([what], getattr(stats, f"{what}_seconds"))
        yield seconds
        drops = CounterMetricFamily("dph_learner_drops", "Groups the replay dropped, by reason", labels=["reason"])
        for reason, n in stats.drops.items():
            drops.add_metric([reason], n)
        yield drops
        refused = CounterMetricFamily("dph_weights_refused", "Requests the weight server refused, by kind",
                                      labels=["kind"])
        for kind, n in dict(self.loop.server.refused).items():
            refused.add_metric([kind], n)
        yield refused
        yield CounterMetricFamily("dph_weights_gate_restarts", "Weight-server gate processes started again after "
                                  "one ended", value=self.loop.server.gate_restarts)
        load = self.loop.server.gate_load
        gate_memory = GaugeMetricFamily("dph_weights_gate_memory_megabytes", "The gate's memory (limit), and what "
                                        "the actors that fetched buckets in the last 10 minutes could make it hold at "
                                        "once (needed)", labels=["what"])  # fmt: skip
        gate_memory.add_metric(["limit"], load.limit_mb if self.loop.server.gated else 0.0)
        gate_memory.add_metric(["needed"], load.needed_bytes / 2**20)
        yield gate_memory
        yield CounterMetricFamily("dph_weights_replies_dropped", "Weight-server replies and pushes not delivered "
                                  "(the peer gone or not reading)", value=self.loop.server.replies_dropped)
        count, size = checkpoint_usage(self.loop.checkpoint_dir)
        yield GaugeMetricFamily("dph_learner_checkpoints", "Checkpoints on disk", value=count)
        yield GaugeMetricFamily("dph_learner_checkpoint_bytes", "Bytes of checkpoints on disk", value=size)


def learner_health(loop) -> dict:
    return {"version": loop.trainer.version, "steps": loop.stats.steps}
