"""A process's busy/wait timeline: wall-clock spans (start, end, what), bounded in memory.

Benchmarks read it (timeline.json) to see who was busy when. A long-running process records only
the first `MAX_SPANS` spans, so a run that goes on for days keeps a few MB, not a span per step;
the totals kept in a process's stats go on counting.
"""

from __future__ import annotations

Span = tuple[float, float, str]

# A few spans per step per process: thousands of steps, far more than a benchmark's runs need.
MAX_SPANS = 50_000


def add_span(line: list[Span], start: float, end: float, what: str) -> None:
    """Append (start, end, what), merged into the previous span when it is of the same kind and
    ends within 10 ms of `start`; past MAX_SPANS spans, record nothing."""
    if line and line[-1][2] == what and start - line[-1][1] < 0.01:
        line[-1] = (line[-1][0], end, what)
    elif len(line) < MAX_SPANS:
        line.append((start, end, what))
