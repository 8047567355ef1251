"""Replay counters and rates: what `Stats` reports.

Counters are cumulative and travel with snapshots (a restored replay keeps counting where its
checkpoint was); rates are measured over the last `window_s` seconds of this process.
"""

from __future__ import annotations

import time
from collections import Counter, deque

from dph_async.replay_stats import IngestRate


class ReplayMetrics:
    def __init__(self, window_s: float = 10.0):
        self.counters: Counter[str] = Counter()
        self.window_s = window_s
        self._arrivals: deque[tuple[float, int, int]] = deque()  # (time, groups, bytes)

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def group(self, prefix: str) -> dict[str, int]:
        """Counters named "<prefix>:<key>" as {key: n}."""
        head = prefix + ":"
        return {k[len(head) :]: v for k, v in sorted(self.counters.items()) if k.startswith(head)}

    def arrived(self, groups: int, nbytes: int) -> None:
        now = time.monotonic()
        self._arrivals.append((now, groups, nbytes))
        while self._arrivals and self._arrivals[0][0] < now - self.window_s:
            self._arrivals.popleft()

    def ingest_rate(self) -> IngestRate:
        now = time.monotonic()
        recent = [(g, b) for t, g, b in self._arrivals if t >= now - self.window_s]
        return IngestRate(
            groups_per_s=sum(g for g, _ in recent) / self.window_s,
            mb_per_s=sum(b for _, b in recent) / self.window_s / 1e6,
        )

    def to_state(self) -> dict[str, int]:
        return dict(self.counters)

    def load_state(self, counters: dict[str, int]) -> None:
        self.counters = Counter(counters)
