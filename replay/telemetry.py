"""The replay's Prometheus metrics and health, read from `ReplayService.stats()` at each scrape.

Served by a `MetricsEndpoint` (dph_async/metrics_endpoint.py) in the replay's process: the learner's process
when the launcher runs it, or `dph-async serve replay`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from dph_async.replay_stats import ReplayStats

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)


def read_stats(service) -> ReplayStats:
    """The service's stats from another thread: its loop may change a dict while we copy it; retry."""
    for _ in range(5):
        try:
            return service.stats()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return service.stats()


def staleness_buckets(hist: dict[int, int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) buckets from {staleness: served groups}."""
    counts = {int(k): v for k, v in hist.items()}
    buckets = [(str(b), float(sum(n for s, n in counts.items() if s <= b))) for b in STALENESS_BUCKETS]
    return [*buckets, ("+Inf", float(sum(counts.values())))]


def _labelled(name: str, doc: str, label: str, values: dict[str, int | float], cls=CounterMetricFamily) -> Metric:
    family = cls(name, doc, labels=[label])
    for key, n in values.items():
        family.add_metric([str(key)], n)
    return family


class ReplayCollector(Collector):
    def __init__(self, service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = read_stats(self.service)
        yield GaugeMetricFamily("dph_replay_version", "Learner version the replay last served", value=s.version)
        yield GaugeMetricFamily("dph_replay_max_staleness", "The staleness bound eta in force (steered by the "
                                "learner with replay.max_staleness=auto)", value=self.service.core.max_staleness)
        yield _labelled("dph_replay_occupancy", "What the fresh store holds", "what", asdict(s.occupancy),
                        GaugeMetricFamily)
        yield GaugeMetricFamily("dph_replay_ingest_groups_per_second", "Groups accepted per second, last 10 s",
                                value=s.ingest.groups_per_s)
        yield GaugeMetricFamily("dph_replay_ingest_megabytes_per_second", "MB accepted per second, last 10 s",
                                value=s.ingest.mb_per_s)
        yield CounterMetricFamily("dph_replay_accepted_groups", "Groups accepted", value=s.accepted)
        yield CounterMetricFamily("dph_replay_duplicate_groups", "Duplicates answered", value=s.duplicates)
        yield _labelled("dph_replay_drops", "Groups dropped, by reason", "reason", s.drops)
        yield _labelled("dph_replay_rejected", "Messages or groups refused, by kind", "reason", s.refused.by_kind)
        yield _labelled("dph_replay_deferred", "Groups answered retry, by the budget that was full", "budget",
                        s.deferred)
        yield _labelled("dph_replay_refusals_logged", "Refusals logged, and held back by the log's rate limit",
                        "logged", {"yes": s.refused.logged, "no": s.refused.unlogged})
        hist = s.staleness_hist
        total = sum(int(k) * v for k, v in hist.items())
        yield HistogramMetricFamily("dph_replay_served_staleness", "Staleness of served groups (versions)",
                                    buckets=staleness_buckets(hist), sum_value=total)
        yield _labelled("dph_replay_served", "Served to the learner", "what", asdict(s.served))
        t = s.tickets
        yield CounterMetricFamily("dph_replay_tickets_granted", "Admission tickets granted", value=t.granted)
        yield GaugeMetricFamily("dph_replay_tickets_in_flight", "Tickets granted, groups not yet here",
                                value=t.in_flight)
        yield GaugeMetricFamily("dph_replay_tickets_capacity", "Tickets that could be granted now",
                                value=t.capacity)
        yield GaugeMetricFamily("dph_replay_tickets_parked", "Ticket requests waiting for capacity", value=t.parked)
        yield CounterMetricFamily("dph_replay_tickets_overclaimed",
                                  "Ticket requests claiming more tickets than were granted", value=t.overclaimed)
        yield CounterMetricFamily("dph_replay_tickets_expired",
                                  "Tickets dropped unused once their last batch was served", value=t.expired)
        yield CounterMetricFamily("dph_replay_tickets_anonymous",
                                  "Tickets granted to requests without the actor token", value=t.anonymous)
        yield CounterMetricFamily("dph_replay_gate_restarts", "Gate processes started again after one ended",
                                  value=s.gate_restarts)
        yield _labelled("dph_replay_gate_memory_megabytes", "The gate's memory (limit), and what the actors seen "
                        "in the last 10 minutes could make it hold at once (needed)", "what",
                        {"limit": s.gate_memory_mb, "needed": s.gate_memory_needed_mb}, GaugeMetricFamily)
        yield CounterMetricFamily("dph_replay_replies_dropped", "Replies not delivered (the peer gone or not reading)",
                                  value=s.replies_dropped)
        yield GaugeMetricFamily("dph_replay_wal_bytes_since_base", "Write-ahead log bytes since its last base",
                                value=s.wal.bytes_since_base)
        yield CounterMetricFamily("dph_replay_wal_damaged_records",
                                  "Log records found cut short or failing their checksum at recovery",
                                  value=s.wal.damaged_records)


def replay_health(service) -> dict:
    s = read_stats(service)
    return {"version": s.version, "groups": s.occupancy.groups, "accepted": s.accepted,
            "endpoints": {"ingest": s.ingest_endpoint, "batch": s.batch_endpoint}}
