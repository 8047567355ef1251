"""Counters of the scorer service, rendered in the Prometheus text format for GET /metrics."""

from __future__ import annotations

import bisect
import threading
from collections import Counter

from dph_async.rewards.result import RewardResult

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)


class ServiceMetrics:
    """Thread-safe counters: scored items by data_source and status, their latency, HTTP outcomes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.items: Counter[tuple[str, str]] = Counter()
        self.batches: Counter[int] = Counter()
        self.latency_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum = 0.0

    def record_batch(self, code: int, sources: list[str] | None = None,
                     results: list[RewardResult] | None = None) -> None:
        with self._lock:
            self.batches[code] += 1
            for source, result in zip(sources or [], results or [], strict=True):
                self.items[(source, result.status)] += 1
                self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_S, result.latency_s)] += 1
                self.latency_sum += result.latency_s

    def render(self, gauges: dict[str, float]) -> str:
        """The exposition text; `gauges` adds current values (in-flight items, worker restarts...)."""
        lines = ["# TYPE dph_scorer_items_total counter"]
        with self._lock:
            for (source, status), n in sorted(self.items.items()):
                labels = f'data_source="{_escape(source)}",status="{status}"'
                lines.append(f"dph_scorer_items_total{{{labels}}} {n}")
            lines.append("# TYPE dph_scorer_batches_total counter")
            for code, n in sorted(self.batches.items()):
                lines.append(f'dph_scorer_batches_total{{code="{code}"}} {n}')
            lines.append("# TYPE dph_scorer_item_latency_seconds histogram")
            cumulative = 0
            for bound, n in zip((*LATENCY_BUCKETS_S, float("inf")), self.latency_counts, strict=True):
                cumulative += n
                le = "+Inf" if bound == float("inf") else f"{bound:g}"
                lines.append(f'dph_scorer_item_latency_seconds_bucket{{le="{le}"}} {cumulative}')
            lines.append(f"dph_scorer_item_latency_seconds_sum {self.latency_sum:.6f}")
            lines.append(f"dph_scorer_item_latency_seconds_count {cumulative}")
        for name, value in gauges.items():
            lines += [f"# TYPE dph_scorer_{name} gauge", f"dph_scorer_{name} {value:g}"]
        return "\n".join(lines) + "\n"


def _escape(label: str) -> str:
    return label.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
