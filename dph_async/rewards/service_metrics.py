"""The scorer service's Prometheus metrics (GET /metrics), in a registry of its own per app."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from dph_async.rewards.result import RewardResult

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)


class ServiceMetrics:
    """Scored items by data_source and status, their latency, HTTP outcomes, and live gauges."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> None:
        """`gauges`: name -> (help, function read at every scrape), e.g. requests in flight."""
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes, process_open_fds, ...
        self.items = Counter("dph_scorer_items", "Scored requests by data_source and status",
                             ["data_source", "status"], registry=self.registry)
        self.batches = Counter("dph_scorer_batches", "Batches answered, by HTTP status code", ["code"],
                               registry=self.registry)
        self.latency = Histogram("dph_scorer_item_latency_seconds", "Scoring time of one request",
                                 buckets=LATENCY_BUCKETS_S, registry=self.registry)
        for name, (doc, read) in gauges.items():
            Gauge(f"dph_scorer_{name}", doc, registry=self.registry).set_function(read)

    def record_batch(self, code: int, sources: list[str] | None = None,
                     results: list[RewardResult] | None = None) -> None:
        self.batches.labels(code=str(code)).inc()
        for source, result in zip(sources or [], results or [], strict=True):
            self.items.labels(data_source=source, status=result.status).inc()
            self.latency.observe(result.latency_s)
