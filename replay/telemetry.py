"""The replay's Prometheus metrics and health, read from `ReplayService.stats()` at each scrape.

Served by a `MetricsEndpoint` (dph_async/telemetry.py) in the replay's process: the learner's process
when the launcher runs it, or `dph-async serve replay`.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16, 32)


def read_stats(service) -> dict:
    """The service's stats from another thread: its loop may change a dict while we copy it; retry."""
    for _ in range(5):
        try:
            return service.stats()
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return service.stats()


def staleness_buckets(hist: dict[str, int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) buckets from {staleness: served groups}."""
    counts = {int(k): v for k, v in hist.items()}
    buckets = [(str(b), float(sum(n for s, n in counts.items() if s <= b))) for b in STALENESS_BUCKETS]
    return [*buckets, ("+Inf", float(sum(counts.values())))]


class ReplayCollector(Collector):
    def __init__(self, service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        s = read_stats(self.service)
        yield GaugeMetricFamily("dph_replay_version", "Learner version the replay last served", value=s["version"])
        occupancy = GaugeMetricFamily("dph_replay_occupancy", "What the fresh store holds", labels=["what"])
        for what, n in s["occupancy"].items():
            occupancy.add_metric([what], n)
        yield occupancy
        yield GaugeMetricFamily("dph_replay_ingest_groups_per_second", "Groups accepted per second, last 10 s",
                                value=s["ingest"]["groups_per_s"])
        yield GaugeMetricFamily("dph_replay_ingest_megabytes_per_second", "MB accepted per second, last 10 s",
                                value=s["ingest"]["mb_per_s"])
        yield CounterMetricFamily("dph_replay_accepted_groups", "Groups accepted", value=s["accepted"])
        yield CounterMetricFamily("dph_replay_duplicate_groups", "Duplicates answered", value=s["duplicates"])
        for name, doc, key in (("dph_replay_drops", "Groups dropped, by reason", "drops"),
                               ("dph_replay_rejected", "Messages or groups refused, by kind", "rejected")):
            family = CounterMetricFamily(name, doc, labels=["reason"])
            for reason, n in s[key].items():
                family.add_metric([reason], n)
            yield family
        hist = s["staleness_hist"]
        total = sum(int(k) * v for k, v in hist.items())
        yield HistogramMetricFamily("dph_replay_served_staleness", "Staleness of served groups (versions)",
                                    buckets=staleness_buckets(hist), sum_value=total)
        served = CounterMetricFamily("dph_replay_served", "Served to the learner", labels=["what"])
        for what in ("batches", "batches_resent", "groups", "samples", "reference", "used_up"):
            served.add_metric([what], s["served"][what])
        yield served
        t = s["tickets"]
        yield CounterMetricFamily("dph_replay_tickets_granted", "Admission tickets granted", value=t["granted"])
        yield GaugeMetricFamily("dph_replay_tickets_in_flight", "Tickets granted, groups not yet here",
                                value=t["in_flight"])
        yield GaugeMetricFamily("dph_replay_tickets_capacity", "Tickets that could be granted now",
                                value=t["capacity"])
        yield GaugeMetricFamily("dph_replay_tickets_parked", "Ticket requests waiting for capacity",
                                value=s["parked"]["tickets"])
        yield GaugeMetricFamily("dph_replay_wal_bytes_since_base", "Write-ahead log bytes since its last base",
                                value=s["wal"]["bytes_since_base"])


def replay_health(service) -> dict:
    s = read_stats(service)
    return {"version": s["version"], "groups": s["occupancy"]["groups"], "accepted": s["accepted"],
            "endpoints": s["endpoints"]}
