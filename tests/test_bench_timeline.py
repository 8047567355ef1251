"""The pipeline benchmark's arithmetic on synthetic timelines: windows, busy shares, phases, the ideal."""

from __future__ import annotations

import json
import random

import pytest

from dph_async.tools.bench.cpu import CpuSample, cpu_between
from dph_async.tools.bench.timeline import (
    OTHER,
    Span,
    Timeline,
    all_waiting,
    busy_seconds,
    fractions,
    ideal_speedup,
    learner_phases,
    marked_between,
    steady_window,
    weight_delays,
)


def sync_learner(steps: int, g: float, t: float, publish: float = 0.0) -> list[Span]:
    """A sync learner: publish, then per step wait g (generation), train t, publish."""
    spans, now = [Span(0.0, publish, "publish")], publish
    for _ in range(steps):
        spans += [Span(now, now + g, "wait"), Span(now + g, now + g + t, "train")]
        now += g + t
        spans.append(Span(now, now + publish, "publish"))
        now += publish
    return spans


def test_ideal_speedup_closed_forms():
    assert ideal_speedup(3.0, 1.0) == pytest.approx(4 / 3)
    assert ideal_speedup(1.0, 1.0) == pytest.approx(2.0)
    assert ideal_speedup(0.0, 2.0) == pytest.approx(1.0)
    # A CPU floor above both phases caps what overlap can give.
    assert ideal_speedup(1.0, 1.0, floor=1.6) == pytest.approx(2 / 1.6)
    assert ideal_speedup(1.0, 1.0, floor=0.5) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="g and t"):
        ideal_speedup(0.0, 0.0)
    with pytest.raises(ValueError, match="g and t"):
        ideal_speedup(-1.0, 1.0)


def test_steady_window_skips_whole_steps():
    spans = sync_learner(10, g=3.0, t=1.0, publish=0.5)
    win = steady_window(spans, skip=2)
    step = 4.5
    assert win.steps == 8
    # From the end of the second training step to the end of the last one.
    assert win.start == pytest.approx(0.5 + 2 * step - 0.5)
    assert win.end == pytest.approx(0.5 + 10 * step - 0.5)
    assert win.seconds / win.steps == pytest.approx(step)
    assert steady_window(spans, skip=0).start == 0.0
    with pytest.raises(ValueError, match="10 training steps"):
        steady_window(spans, skip=10)


def test_sync_phases_recover_g_and_t():
    spans = sync_learner(12, g=2.5, t=0.75, publish=0.25)
    win = steady_window(spans, skip=3)
    phases = learner_phases(spans, win)
    assert phases.generate == pytest.approx(2.5)
    assert phases.train == pytest.approx(1.0)  # training and publishing
    shares = fractions(spans, win)
    assert shares["wait"] == pytest.approx(2.5 / 3.5)
    assert shares["train"] == pytest.approx(0.75 / 3.5)
    assert shares["publish"] == pytest.approx(0.25 / 3.5)
    assert shares[OTHER] == pytest.approx(0.0, abs=1e-12)


def test_busy_shares_resolve_nested_spans_and_gaps():
    # An actor pass: a "wait" span that holds a "weights" load, then generation, a gap, scoring.
    spans = [Span(0, 4, "wait"), Span(1, 2, "weights"), Span(4, 7, "generate"), Span(8, 9, "score"),
             Span(8.5, 9.5, "score")]
    sec = busy_seconds(spans, 0.0, 10.0)
    assert sec == pytest.approx({"wait": 3.0, "weights": 1.0, "generate": 3.0, "score": 1.5, OTHER: 1.5})
    assert sum(sec.values()) == pytest.approx(10.0)
    # Clipping to a window inside the spans.
    assert busy_seconds(spans, 1.5, 5.0) == pytest.approx({"wait": 2.0, "weights": 0.5, "generate": 1.0, OTHER: 0.0})


def test_async_overlap_shows_in_the_phases():
    # Perfect overlap: each step the learner trains 1 s and waits 0.2 s for the next batch.
    spans, now = [], 0.0
    for _ in range(6):
        spans += [Span(now, now + 0.2, "wait"), Span(now + 0.2, now + 1.2, "train")]
        now += 1.2
    win = steady_window(spans, skip=1)
    phases = learner_phases(spans, win)
    assert phases.generate == pytest.approx(0.2) and phases.train == pytest.approx(1.0)
    assert win.seconds / win.steps == pytest.approx(1.2)


def test_timeline_loads_the_runs_file(tmp_path):
    raw = {"learner": [[0.0, 1.0, "wait"], [1.0, 2.0, "train"]], "actors": [[[0.0, 1.0, "generate"]], []]}
    (tmp_path / "timeline.json").write_text(json.dumps(raw))
    tl = Timeline.load(tmp_path / "timeline.json")
    assert tl.learner[1] == Span(1.0, 2.0, "train")
    assert tl.actors == [[Span(0.0, 1.0, "generate")], []]


def test_cpu_between_interpolates_and_finds_outside_load():
    samples = [CpuSample(0.0, {"learner": 0.0, "actors": 0.0}, 0.0),
               CpuSample(2.0, {"learner": 2.0, "actors": 1.0}, 4.0),
               CpuSample(4.0, {"learner": 2.0, "actors": 3.0, "ray": 1.0}, 8.0)]
    used = cpu_between(samples, 1.0, 3.0)
    assert used["learner"] == pytest.approx(1.0)
    assert used["actors"] == pytest.approx(1.5)
    assert used["ray"] == pytest.approx(0.5)
    assert used["machine"] == pytest.approx(4.0)
    assert used["outside"] == pytest.approx(1.0)
    # Outside the sampled range the ends are held.
    assert cpu_between(samples, -5.0, 10.0)["learner"] == pytest.approx(2.0)


def test_marked_between_interpolates_a_cumulative_count():
    rng = random.Random()
    times = sorted(rng.uniform(0, 10) for _ in range(20))
    rates = [rng.uniform(0, 1) for _ in times]  # the count's rate from each mark to the next
    marks, count = [], 0.0
    for i, t in enumerate(times):
        count += rates[i - 1] * (t - times[i - 1]) if i else 0.0
        marks.append((t, count, 2 * count))  # a second count alongside, twice the first
    lo, hi = sorted(rng.uniform(times[0], times[-1]) for _ in range(2))
    # Piecewise linear: the integral of the rate over [lo, hi], summed interval by interval.
    expected = sum(r * max(0.0, min(hi, b) - max(lo, a)) for a, b, r in zip(times, times[1:], rates, strict=False))
    assert marked_between(marks, lo, hi) == pytest.approx([expected, 2 * expected], rel=1e-9, abs=1e-12)
    # Flat outside the marks; nothing marked, nothing counted.
    assert marked_between(marks, -5.0, 20.0) == pytest.approx([count, 2 * count])
    assert marked_between([], 0.0, 1.0) == []


BURN = "import time\nwhile time.process_time() < {s}: pass\n"


def test_process_tree_cpu_files_processes_under_their_ray_actor():
    import subprocess
    import sys

    from dph_async.tools.bench.cpu import ProcessTreeCPU

    # A process titled like a Ray learner worker, which burns CPU itself and through a child; and
    # an untitled one, filed under "ray". CPU time, not wall time, decides when they stop.
    child = f"import subprocess\nsubprocess.run([{sys.executable!r}, '-c', {BURN.format(s=0.4)!r}])\n"
    learner_code = BURN.format(s=0.3) + child
    with ProcessTreeCPU(interval=0.05) as sampler:
        procs = [subprocess.Popen(["ray::LearnerProcess", "-c", learner_code], executable=sys.executable),
                 subprocess.Popen([sys.executable, "-c", BURN.format(s=0.3)])]
        for p in procs:
            assert p.wait(timeout=120) == 0
    last = sampler.samples[-1].by_component
    # Each burner stops at its CPU target; a sampling interval may miss the tail of a short-lived one.
    assert 0.5 <= last["learner"] <= 1.2
    assert 0.15 <= last["ray"] <= 1.0
    # Nothing filed under the actors: an idle actor process another test's Ray cluster keeps under
    # this process may be seen, at no CPU.
    assert last.get("actors", 0.0) < 0.05


def test_weight_delays_run_from_publish_to_each_actors_next_load():
    learner = [Span(0, 1, "train"), Span(1, 1.1, "publish"), Span(1.1, 2, "wait"), Span(2, 3, "train"),
               Span(3, 3.1, "publish")]
    actors = [[Span(1.2, 1.3, "weights"), Span(3.3, 3.4, "weights")],
              [Span(0.5, 0.6, "weights"), Span(1.5, 1.6, "weights")]]
    win = steady_window(learner, skip=1)  # from t=1 (end of step 1) to t=3
    # The publish ending at 1.1 reaches actor 0 at 1.3 and actor 1 at 1.6; the one ending at 3.1 lies outside.
    assert weight_delays(learner, actors, win) == pytest.approx([0.2, 0.5])


def test_all_waiting_is_when_no_process_works():
    # Learner: waits 0-2, trains 2-3, waits 3-4 (window 0-4 after one skipped step ending at 0).
    learner = [Span(-1, 0, "train"), Span(0, 2, "wait"), Span(2, 3, "train"), Span(3, 4, "wait"),
               Span(4, 4.5, "train")]
    win = steady_window(learner, skip=1)
    assert (win.start, win.end) == (0, 4.5)
    # Actor 0 generates 0.5-1.5 inside a long wait span (nested: busy wins); actor 1 waits throughout but
    # loads weights at 3.5-3.6.
    actors = [[Span(0, 4.5, "wait"), Span(0.5, 1.5, "generate")],
              [Span(0, 4.5, "wait"), Span(3.5, 3.6, "weights")]]
    # All idle: 0-0.5, 1.5-2, 3-3.5, 3.6-4 -> 1.9 s of 4.5.
    assert all_waiting(learner, actors, win) == pytest.approx(1.9 / 4.5)
    assert all_waiting(learner, [], win) == pytest.approx(3 / 4.5)
