"""Arithmetic on an RL run's timeline: who was busy when, per step, and the ideal overlap.

An RL run writes `timeline.json`: for the learner and for each actor, wall-clock spans (start, end,
what). Learner spans are "wait" (for a batch), "train", "padding" (the rest of a step that
learner.min_step_seconds holds: an emulated slower learner), "publish" and "checkpoint"; actor spans are
"submit" (handing a prompt's request to the engine), "generate" (engine steps), "score", "send" (a
group to the replay), "weights" (fetch, verify and load new weights), "query" (asking the weight
server for a newer version), "tickets" (asking for admission while the engine has work) and "wait"
(the engine idle, waiting for admission or weights).
Time inside a process's window that no span covers is "other" (sending, bookkeeping, Python between
spans).

The steady-state window of a run starts at the end of its `skip`-th training step and ends at the
end of its last one, so it holds whole learner cycles (publish, wait, train) and leaves out start-up
(engine warm-up, the first weights, the first batch).
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path

OTHER = "other"
# Learner span kinds that make up the training phase of a step (the rest of a sync step is
# generation: the learner waits while the actors load weights, generate and score).
TRAIN_PHASE = ("train", "padding", "publish", "checkpoint")
# Where spans overlap, the moment counts as the first of these (work before waiting).
PRIORITY = ("train", "padding", "generate", "submit", "score", "send", "weights", "query", "tickets", "publish",
            "checkpoint", "wait")


@dataclass(frozen=True)
class Span:
    start: float
    end: float
    what: str


@dataclass
class Timeline:
    learner: list[Span]
    actors: list[list[Span]]

    @classmethod
    def load(cls, path: Path) -> Timeline:
        raw = json.loads(path.read_text())
        return cls([Span(*s) for s in raw["learner"]], [[Span(*s) for s in a] for a in raw["actors"]])


@dataclass(frozen=True)
class Window:
    """[start, end] wall clock, holding `steps` whole learner steps."""

    start: float
    end: float
    steps: int

    @property
    def seconds(self) -> float:
        return self.end - self.start


def steady_window(learner: list[Span], skip: int) -> Window:
    """From the end of training step `skip` to the end of the last one (skip=0: from the first span)."""
    ends = [s.end for s in learner if s.what == "train"]
    if len(ends) <= skip:
        raise ValueError(f"the run has {len(ends)} training steps; at least {skip + 1} are needed to skip {skip}")
    start = ends[skip - 1] if skip > 0 else learner[0].start
    return Window(start, ends[-1], len(ends) - skip)


def marked_between(marks: list[tuple[float, ...]], start: float, end: float) -> list[float]:
    """The growth over [start, end] of the cumulative counts marked as (time, count, count, ...),
    linear between marks and flat outside them."""
    if not marks:
        return []
    times = [m[0] for m in marks]

    def at(t: float) -> list[float]:
        i = bisect.bisect_left(times, t)
        if i == 0 or i == len(marks):
            return list(marks[min(i, len(marks) - 1)][1:])
        a, b = marks[i - 1], marks[i]
        f = (t - a[0]) / (b[0] - a[0]) if b[0] > a[0] else 1.0
        return [va + f * (vb - va) for va, vb in zip(a[1:], b[1:], strict=True)]

    return [hi - lo for lo, hi in zip(at(start), at(end), strict=True)]


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _minus(intervals: list[tuple[float, float]], taken: list[tuple[float, float]]) -> float:
    """Length of the (disjoint, sorted) intervals outside the (disjoint, sorted) taken ones."""
    total, j = 0.0, 0
    for a, b in intervals:
        total += b - a
        while j < len(taken) and taken[j][1] <= a:
            j += 1
        k = j
        while k < len(taken) and taken[k][0] < b:
            total -= min(b, taken[k][1]) - max(a, taken[k][0])
            k += 1
    return total


def busy_seconds(spans: list[Span], start: float, end: float) -> dict[str, float]:
    """Seconds of [start, end] spent in each kind of span; what no span covers is OTHER. Spans may
    nest (an actor's "wait" pass can hold a "weights" load): each moment goes to the first kind in
    PRIORITY that covers it, so the shares add up to the window."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for s in spans:
        a, b = max(s.start, start), min(s.end, end)
        if b > a:
            kinds.setdefault(s.what, []).append((a, b))
    order = sorted(kinds, key=lambda k: PRIORITY.index(k) if k in PRIORITY else PRIORITY.index("wait") - 0.5)
    out: dict[str, float] = {}
    taken: list[tuple[float, float]] = []
    for k in order:
        mine = _union(kinds[k])
        out[k] = _minus(mine, taken)
        taken = _union(taken + mine)
    out[OTHER] = max(0.0, (end - start) - sum(out.values()))
    return out


def fractions(spans: list[Span], window: Window) -> dict[str, float]:
    """Shares of the window spent in each kind of span (they sum to 1)."""
    return {k: v / window.seconds for k, v in busy_seconds(spans, window.start, window.end).items()}


@dataclass(frozen=True)
class Phases:
    """Mean seconds per learner step: g waiting for a batch, t training (train + publish + checkpoint)."""

    generate: float
    train: float


def learner_phases(learner: list[Span], window: Window) -> Phases:
    """In sync mode the learner's wait is the generation phase (the actors load weights, generate and
    score while it waits), so g and t of the ideal come from the learner's own spans."""
    seconds = busy_seconds(learner, window.start, window.end)
    train = sum(seconds.get(k, 0.0) for k in TRAIN_PHASE)
    return Phases(generate=(window.seconds - train) / window.steps, train=train / window.steps)


def ideal_speedup(g: float, t: float, floor: float = 0.0) -> float:
    """Async over sync when generation (g) and training (t) of consecutive steps overlap perfectly:
    a sync step takes g + t, an async one max(g, t). `floor` is a lower bound on the async step time
    from elsewhere (e.g. the CPU work of a step over the cores it shares)."""
    if g < 0 or t < 0 or g + t == 0:
        raise ValueError(f"g and t must be >= 0 and not both 0 (got g={g}, t={t})")
    return (g + t) / max(g, t, floor)


def weight_delays(learner: list[Span], actors: list[list[Span]], window: Window) -> list[float]:
    """Seconds from the end of each publish in the window to the end of each actor's next weight
    load: how long new weights take to reach generation (in sync mode, part of every step)."""
    delays = []
    for p in (s for s in learner if s.what == "publish" and window.start <= s.end <= window.end):
        for spans in actors:
            load = next((s for s in spans if s.what == "weights" and s.end >= p.end), None)
            if load is not None:
                delays.append(load.end - p.end)
    return delays


def _intersect(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two disjoint, sorted interval lists."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _complement(intervals: list[tuple[float, float]], window: Window) -> list[tuple[float, float]]:
    """The window minus the (disjoint, sorted) intervals."""
    out, now = [], window.start
    for a, b in intervals:
        if a > now:
            out.append((now, a))
        now = max(now, b)
    if now < window.end:
        out.append((now, window.end))
    return out


def _idle(spans: list[Span], window: Window) -> list[tuple[float, float]]:
    """Where a process only waits: its "wait" spans minus every other span, inside the window."""
    inside = [(max(s.start, window.start), min(s.end, window.end), s.what) for s in spans
              if s.end > window.start and s.start < window.end]
    busy = _union([(a, b) for a, b, what in inside if what != "wait"])
    return _intersect(_union([(a, b) for a, b, what in inside if what == "wait"]), _complement(busy, window))


def all_waiting(learner: list[Span], actors: list[list[Span]], window: Window) -> float:
    """Share of the window in which the learner and every actor were all waiting: the pipeline's
    bubbles, time no process spent on RL work (e.g. new weights on their way, tickets not yet granted)."""
    idle = _idle(learner, window)
    for spans in actors:
        idle = _intersect(idle, _idle(spans, window))
    return sum(b - a for a, b in idle) / window.seconds
