"""The pipeline benchmark's report: bench.md (markdown tables) and PNG plots.

plots/timeline.png   who was busy when: learner and actors, sync above async, a few steady steps
plots/busy.png       busy/wait shares of every process, per run
plots/scaling.png    measured samples/s against the scaling model, by number of actors
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from dph_async.pipeline.report import markdown_table
from dph_async.tools.bench.figures import RunFigures
from dph_async.tools.bench.pipeline import BenchResult, pair_names
from dph_async.tools.bench.timeline import OTHER, Timeline, steady_window

COLORS = {"train": "#1f77b4", "publish": "#9467bd", "checkpoint": "#7f7f7f", "generate": "#2ca02c",
          "submit": "#bcbd22", "score": "#ff7f0e", "weights": "#d62728", "send": "#17becf", "query": "#8c564b",
          "tickets": "#e377c2", "wait": "#e5e5e5", OTHER: "#f7e8c6"}



def _save(fig: plt.Figure, out: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    fig.tight_layout(rect=rect)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _busy_cell(shares: dict[str, float]) -> str:
    return ", ".join(f"{k} {_pct(v)}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.005)


def _seconds_cell(seconds: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]) if v >= 5e-4)


def _pairs_table(res: BenchResult) -> list[str]:
    """Each repeat's figures, with the cores others' jobs took during its two runs."""
    if len(res.pairs) < 2:
        return []
    rows = []
    for (sync, async_), c in zip(pair_names(len(res.pairs)), res.pairs, strict=True):
        outside = [res.runs[n].cpu_cores.get("outside", 0.0) if res.runs[n].cpu_cores else float("nan")
                   for n in (sync, async_)]
        rows.append([f"{sync} / {async_}", f"{c.generate_s:.3f}", f"{c.train_s:.3f}", f"{c.speedup:.2f}x",
                     f"{c.ideal:.2f}x", _pct(c.of_ideal), f"{outside[0]:.2f} / {outside[1]:.2f}"])
    return ["Each repeat:", "", markdown_table(["runs", "g", "t", "speedup", "ideal", "of ideal",
                                                "cores used by others (sync / async)"], rows), ""]


def markdown(res: BenchResult) -> str:
    c = res.comparison
    runs = list(res.runs.values())
    lines = [
        f"# dph-async bench: sync vs async ({res.date})", "",
        f"Machine: {res.machine.get('cpu', '?')}, {c.cores} cores; load average at start "
        f"{res.machine.get('load_avg')}, at end {res.machine.get('load_avg_end')}.",
        f"Steady-state window: learner steps {res.skip + 1}..end of each run.", "",
        "## Async against sync" + (f" (medians over {len(res.pairs)} repeats)" if len(res.pairs) > 1 else ""), "",
        markdown_table(["g (s/step)", "t (s/step)", "speedup", "ideal (g+t)/max(g,t)", "of ideal",
                        "CPU floor (s/step)", "ideal, CPU-bound", "of CPU-bound ideal"], [[
            f"{c.generate_s:.3f}", f"{c.train_s:.3f}", f"{c.speedup:.2f}x", f"{c.ideal:.2f}x", _pct(c.of_ideal),
            f"{c.cpu_floor_s:.3f}" if c.cpu_floor_s is not None else "-",
            f"{c.ideal_cpu_bound:.2f}x" if c.ideal_cpu_bound else "-",
            _pct(c.of_ideal_cpu_bound) if c.of_ideal_cpu_bound else "-"]]), "",
        *_pairs_table(res),
        "## Runs", "",
        markdown_table(["run", "actors", "steps", "s/step", "samples/s", "tokens/s", "g s/step", "t s/step",
                        "actor gen tok/s", "learner tok/s", "all waiting", "cores used (learner/actors/ray/outside)",
                        "reward (last 20%)"], [[
            r.name, str(r.actors), str(r.steps), f"{r.step_s:.3f}", f"{r.samples_per_s:.1f}",
            f"{r.tokens_per_s:.0f}", f"{r.generate_s:.3f}", f"{r.train_s:.3f}", f"{r.actor_tokens_per_s:.0f}",
            f"{r.learner_tokens_per_s:.0f}", _pct(r.all_waiting),
            "/".join(f"{r.cpu_cores.get(k, 0):.2f}" for k in ("learner", "actors", "ray", "outside"))
            if r.cpu_cores else "-", f"{r.reward_last:.3f}"] for r in runs]), "",
        "## Busy and waiting (share of the window)", "",
        markdown_table(["run", "process", "shares"], [
            [r.name, proc, _busy_cell(shares)]
            for r in runs for proc, shares in [("learner", r.learner_busy),
                                               *((f"actor {i}", a) for i, a in enumerate(r.actors_busy))]]), "",
        "## Where a step's time goes (seconds per learner step)", "",
        "The learner's phases (its `time/*` metrics) and the actors' spans summed over the actors; "
        "CPU-seconds per step of each component are its cores used times the step time.", "",
        markdown_table(["run", "learner phases", "actor spans", "CPU-s/step (learner/actors/ray)"], [
            [r.name, _seconds_cell(r.learner_phase_s), _seconds_cell(r.actor_span_s),
             "/".join(f"{r.cpu_cores.get(k, 0) * r.step_s:.3f}" for k in ("learner", "actors", "ray"))
             if r.cpu_cores else "-"] for r in runs]), "",
        "## Weight sync and transport", "",
        markdown_table(["run", "publishes", "publish ms", "MB/publish", "loads", "load ms", "MB/load",
                        "load GB/s", "publish->loaded ms", "rollouts MB/s"], [[
            r.name, str(r.weights.publishes), f"{1e3 * r.weights.publish_s:.1f}",
            f"{r.weights.publish_bytes / 1e6:.2f}", str(r.weights.loads), f"{1e3 * r.weights.load_s:.1f}",
            f"{r.weights.load_bytes / 1e6:.2f}", f"{r.weights.load_gb_per_s:.2f}", f"{1e3 * r.weights.delay_s:.0f}",
            f"{r.rollout_mb_per_s:.3f}"]
            for r in runs]), "",
    ]
    if res.scaling:
        s, k = res.scaling, res.scaling["costs"]
        waiting = {r.name: r.all_waiting for r in runs}
        lines += ["## Scaling model against measured runs", "",
                  f"Costs from run {s['calibration']}: B = {k['samples_per_step']:.0f} samples/step, actor "
                  f"{1e3 * k['actor_cpu_s_per_sample']:.2f} CPU-ms/sample, learner "
                  f"{k['learner_cpu_s_per_step']:.3f} CPU-s/step, sync latency {k['sync_latency_s']:.3f} s/step, "
                  f"other {k['other_cores']:.2f} cores (docs/scaling.md).", "",
                  markdown_table(["run", "mode", "actors", "cores left", "measured samples/s",
                                  "projected (cores left)", "error", "projected (idle machine)", "all waiting"], [
                      [r["run"], r["mode"], str(r["actors"]), f"{r['cores']:.2f}", f"{r['measured']:.1f}",
                       f"{r['projected']:.1f}", f"{100 * r['error']:+.0f}%", f"{r['projected_idle']:.1f}",
                       _pct(waiting[r["run"]])] for r in s["check"]]), ""]
    lines += ["Plots: `plots/timeline.png`, `plots/busy.png`" + (", `plots/scaling.png`." if res.scaling else "."), ""]
    return "\n".join(lines)


def plot_timeline(runs: dict[str, Path], skip: int, out: Path, steps: int = 6) -> None:
    """Gantt chart of `steps` learner steps after the window start, one panel per run."""
    timelines = {name: Timeline.load(rl_dir / "timeline.json") for name, rl_dir in runs.items()}
    height = 1.0 + sum(0.9 + 0.4 * (1 + len(tl.actors)) for tl in timelines.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, height), squeeze=False)
    for ax, (name, tl) in zip(axes[:, 0], timelines.items(), strict=True):
        win = steady_window(tl.learner, skip)
        ends = [s.end for s in tl.learner if s.what == "train"]
        t0 = win.start
        t1 = ends[min(len(ends) - 1, skip + steps - 1)]
        rows = [("learner", tl.learner), *((f"actor {i}", a) for i, a in enumerate(tl.actors))]
        for y, (_, spans) in enumerate(rows):
            for s in spans:
                if s.end > t0 and s.start < t1:
                    a, b = max(s.start, t0) - t0, min(s.end, t1) - t0
                    ax.broken_barh([(a, b - a)], (y - 0.4, 0.8), color=COLORS.get(s.what, "#000000"))
        ax.set_yticks(range(len(rows)), [r[0] for r in rows])
        ax.invert_yaxis()
        ax.set_xlim(0, t1 - t0)
        ax.set_title(f"{name}: {min(steps, len(ends) - skip)} steady learner steps", fontsize=10)
        ax.set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, list(COLORS), loc="upper center", ncol=len(COLORS), fontsize=8, frameon=False)
    _save(fig, out, rect=(0, 0, 1, 0.95))


def plot_busy(runs: list[RunFigures], out: Path) -> None:
    """Stacked shares of the window per process, grouped by run."""
    labels, shares = [], []
    for r in runs:
        for proc, s in [("learner", r.learner_busy), *((f"actor {i}", a) for i, a in enumerate(r.actors_busy))]:
            labels.append(f"{r.name}\n{proc}")
            shares.append(s)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels)), 4))
    bottom = [0.0] * len(labels)
    for kind, color in COLORS.items():
        vals = [s.get(kind, 0.0) for s in shares]
        if any(vals):
            ax.bar(range(len(labels)), vals, bottom=bottom, color=color, label=kind, edgecolor="white", lw=0.5)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("share of the steady-state window")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, 1.15), frameon=False)
    _save(fig, out)


def plot_scaling(scaling: dict, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, color in (("async", "C0"), ("sync", "C1")):
        proj = [p for p in scaling["projection_here"] if p["ranks"] == 1]
        ax.plot([p["actors"] for p in proj], [p[mode] for p in proj], ls="--", color=color,
                label=f"{mode}, model (idle machine)")
        meas = [r for r in scaling["check"] if r["mode"] == mode]
        ax.plot([r["actors"] for r in meas], [r["measured"] for r in meas], "o", ms=8, color=color,
                label=f"{mode}, measured")
        ax.plot([r["actors"] for r in meas], [r["projected"] for r in meas], "x", ms=8, color=color,
                label=f"{mode}, model (cores left to the run)")
    ax.set(xlabel="actors", ylabel="samples/s", title="throughput against actors (1 learner rank, this machine)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, out)


def write_report(res: BenchResult, out: Path) -> None:
    plots = out / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    plot_timeline({n: out / "rl" / n for n in ("sync", "async")}, res.skip, plots / "timeline.png")
    plot_busy(list(res.runs.values()), plots / "busy.png")
    if res.scaling:
        plot_scaling(res.scaling, plots / "scaling.png")
    (out / "bench.md").write_text(markdown(res))
