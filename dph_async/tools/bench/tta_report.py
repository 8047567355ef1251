"""The time-to-accuracy report of `dph-async bench tta`: when each run first reached the target,
async's speed-up over each peer with its 95% interval, and the curves as a figure.

Time to target: the first kept version at or above the target, its time interpolated linearly
between it and the point before (the curve between two evaluations is not known; a straight line is
the least committal guess, and the error it can make is at most the gap between the two points,
shown in the table). A run that never reaches the target within its steps is censored: its time is
only known to exceed its last point's. Speed-up over a peer: per seed, t_peer / t_async, the two runs
made side by side in one rotation; the geometric mean over the seeds where both reached the target
with its interval (stats.ratio_interval), and the seeds where only one did counted apart.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from dph_async.pipeline.plot_colours import pyplot
from dph_async.pipeline.report import markdown_table
from dph_async.safe_files import open_output
from dph_async.stats import RatioInterval, ratio_interval
from dph_async.tools.bench.tta_data import Curve, TTABench

BASELINE = "async"
COLOURS = {"async": "C0", "sync": "C1", "trl": "C2"}


@dataclass(frozen=True)
class Reach:
    """When a run reached the target: seconds and steps (interpolated), the gap between the two
    evaluations around the crossing; None for a run that did not (censored at `last_s`)."""

    seconds: float | None
    step: float | None
    gap_s: float
    last_s: float


def time_to_target(c: Curve, target: float) -> Reach:
    for i, p in enumerate(c.pass1):
        if p >= target:
            if i == 0:  # pi_0 already there: no training needed
                return Reach(0.0, 0.0, 0.0, c.wall[-1])
            p0, w0, s0 = c.pass1[i - 1], c.wall[i - 1], c.steps[i - 1]
            f = (target - p0) / (p - p0)
            return Reach(w0 + f * (c.wall[i] - w0), s0 + f * (c.steps[i] - s0), c.wall[i] - w0, c.wall[-1])
    return Reach(None, None, 0.0, c.wall[-1])


@dataclass(frozen=True)
class Comparison:
    peer: str
    interval: RatioInterval | None  # t_peer / t_async over seeds where both reached
    both: int
    only_async: int  # seeds where async reached and the peer did not (the speed-up exceeds peer's last / async's)
    only_peer: int
    neither: int


def compare(curves: list[Curve], target: float, peer: str) -> Comparison:
    reach = {(c.system, c.seed): time_to_target(c, target) for c in curves}
    seeds = sorted({s for (system, s) in reach if system == BASELINE} & {s for (system, s) in reach if system == peer})
    pairs, counts = [], {"only_async": 0, "only_peer": 0, "neither": 0}
    for s in seeds:
        a, b = reach[(BASELINE, s)].seconds, reach[(peer, s)].seconds
        if a is not None and b is not None:
            pairs.append((b, a))  # (t_peer, t_async): the ratio of rates 1/t_async over 1/t_peer
        else:
            counts["only_async" if a is not None else "only_peer" if b is not None else "neither"] += 1
    return Comparison(peer, ratio_interval(pairs), len(pairs), **counts)


def _median(xs: list[float], digits: int = 1) -> str:
    return f"{statistics.median(xs):.{digits}f}" if xs else "-"


def markdown(res: TTABench, target: float, source: str) -> str:
    w, prov = res.workload, res.provenance
    machine = prov.get("machine", {})
    lines = [
        f"# dph-async bench tta ({prov.get('date')}, commit {prov.get('commit')})", "",
        f"Command: `{prov.get('command')}`. Machine: {machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, "
        f"load average {' '.join(f'{x:.2f}' for x in machine.get('load_avg', ())) or '?'} at the end.",
        f"Work: task {w['task']}, {w['prompts_per_step']} prompts x {w['n']} completions a step, at most "
        f"{w['max_tokens']} tokens, lr {w['lr']:g}, temperature {w['temperature']:g}, {w['steps']} steps, "
        f"objective {w['objective']}; dph-async: actors {w['actors']}, eta {w['eta']} (async). Evaluated every "
        f"{res.every} steps on {w['test_prompts']} held-out prompts x {w['k']} samples.",
        f"Target: held-out Pass@1 >= {target:.3f} ({source}); one evaluation's sampling standard error "
        f"on these prompts is about {res.base_se:.3f}"
        + (", so a crossing this close to pi_0 may be noise." if target < res.base_pass1 + 2 * res.base_se else "."),
        "The clock starts at each run's first generation, on one host; dph-async's holds its checkpoint "
        "writing, TRL's has its writing taken out.", "",
    ]
    lines += [tables(res, target), "## Runs", "", markdown_table(
        ["system", "seed", "s to target", "steps to target", "s for all steps", "Pass@1 along the run"],
        [[c.system, str(c.seed), _fmt(time_to_target(c, target)), _fmt_step(time_to_target(c, target)),
          f"{c.run_s:.1f}", " ".join(f"{p:.3f}" for p in c.pass1)] for c in res.curves]), ""]
    if res.notes:
        lines += ["Notes:", "", *(f"- {n}" for n in res.notes), ""]
    return "\n".join(lines)


def tables(res: TTABench, target: float) -> str:
    """Time to target per system and async's speed-up over each peer (what the docs render)."""
    systems = list(dict.fromkeys(c.system for c in res.curves))
    lines = ["## Time to target", ""]
    rows = []
    for system in systems:
        cs = [c for c in res.curves if c.system == system]
        reach = [time_to_target(c, target) for c in cs]
        hit = [r for r in reach if r.seconds is not None]
        rows.append([system, f"{len(hit)} of {len(cs)}", _median([r.seconds for r in hit]),
                     _median([r.step for r in hit]), _median([r.gap_s for r in hit]),
                     _median([c.run_s / c.steps[-1] for c in cs], 2),
                     f"{statistics.fmean(c.pass1[-1] for c in cs):.3f}"])
    lines += [markdown_table(["system", "reached", "median s to target", "median steps to target",
                              "median gap between evaluations, s", "median s/step", "final Pass@1 (mean)"], rows), ""]
    comps = [compare(res.curves, target, p) for p in systems if p != BASELINE]
    if comps:
        lines += ["## async's speed-up to target (per seed: t_peer / t_async)", "",
                  markdown_table(["peer", "geometric mean (95% interval)", "seeds both reached", "only async",
                                  "only the peer", "neither"],
                                 [[c.peer, c.interval.fmt() if c.interval else "-", str(c.both), str(c.only_async),
                                   str(c.only_peer), str(c.neither)] for c in comps]), ""]
    return "\n".join(lines)


def _fmt(r: Reach) -> str:
    return f"{r.seconds:.1f}" if r.seconds is not None else f"> {r.last_s:.1f}"


def _fmt_step(r: Reach) -> str:
    return f"{r.step:.1f}" if r.step is not None else "-"


def figure(res: TTABench, target: float):
    """Held-out Pass@1 against the run's clock: one colour per system, one line per seed, the target
    dashed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seen = set()
    for c in res.curves:
        ax.plot(c.wall, c.pass1, color=COLOURS[c.system], marker=".", label=None if c.system in seen else c.system)
        seen.add(c.system)
    ax.axhline(target, color="grey", linestyle="--", label=f"target {target:.3f}")
    ax.set(xlabel="seconds since the run's first generation", ylabel="held-out Pass@1",
           title=f"time to accuracy: {res.workload['task']}, {len({c.seed for c in res.curves})} seeds")
    ax.legend()
    fig.tight_layout()
    return fig


def plot(res: TTABench, target: float, path: Path) -> None:
    """`figure` saved to `path` (its directory made; the file not written through a link)."""
    fig = figure(res, target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_output(path, "wb") as f:
            fig.savefig(f, format="png")
    finally:
        pyplot().close(fig)


def default_target(res: TTABench, gain: float) -> float:
    """pi_0's held-out Pass@1 plus `gain`."""
    return res.base_pass1 + gain
