"""An actor's Prometheus metrics and health, read from its `RolloutWorker` at each scrape."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class ActorCollector(Collector):
    def __init__(self, worker) -> None:
        self.worker = worker
        self._last = (time.monotonic(), 0)  # (when, tokens) at the previous scrape
        self._rate = 0.0
        self._lock = threading.Lock()

    def _tokens_per_s(self, tokens: int) -> float:
        """Generated tokens per second since the previous scrape (at least a second ago)."""
        with self._lock:
            now = time.monotonic()
            when, before = self._last
            if now - when >= 1.0:
                self._rate = (tokens - before) / (now - when)
                self._last = (now, tokens)
            return self._rate

    def collect(self) -> Iterator[Metric]:
        s = self.worker.stats
        labels = ["actor"]
        actor = [str(s.actor_id)]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(actor, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(actor, value)
            return family

        yield gauge("dph_actor_weights_version", "Policy version of the weights in the engine", s.version)
        yield gauge("dph_actor_tokens_per_second", "Tokens generated per second since the previous scrape",
                    self._tokens_per_s(s.tokens_generated))
        yield counter("dph_actor_tokens_generated", "Tokens generated", s.tokens_generated)
        yield counter("dph_actor_groups_sent", "Rollout groups sent to the replay", s.groups_sent)
        yield counter("dph_actor_weight_loads", "New weights loaded into the engine", s.weight_loads)
        yield counter("dph_actor_forward_cpu_seconds", "CPU-seconds of engine steps in the model's forward "
                      "(the rest of dph_actor_seconds{what=\"generate\"} is the engine's bookkeeping)",
                      s.forward_cpu_seconds)
        seconds = CounterMetricFamily("dph_actor_seconds", "Time spent, by activity", labels=["actor", "what"])
        for what in ("generate", "wait", "score", "ticket", "send", "weight_load"):
            seconds.add_metric([*actor, what], getattr(s, f"{what}_seconds"))
        yield seconds


def actor_health(worker) -> dict:
    s = worker.stats
    return {"actor": s.actor_id, "weights_version": s.version, "groups_sent": s.groups_sent}
