"""The run's report: summary.json, summary.md (the paper-style table), PNG plots, a terminal table."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from rich.table import Table

from dph_async.paths import RunPaths
from dph_async.pipeline.plot_colours import colour_map, pyplot
from dph_async.progress import console
from dph_async.run_stats import RLResult
from dph_async.runtime.evaluate import DIFFICULTY, SplitResult, by_base_difficulty, load_results

if TYPE_CHECKING:
    from matplotlib.figure import Figure

TABLE_K = (1, 4, 8, 16)


def _metrics(k_max: int) -> list[tuple[str, int | None]]:
    """(column name, k): k None is greedy accuracy, -1 distinct correct answers, else Pass@k."""
    return [("Greedy", None), *((f"P@{k}", k) for k in TABLE_K if k <= k_max), ("Distinct", -1)]


def _cell(r: SplitResult, k: int | None) -> str:
    if k is None:
        return f"{100 * r.greedy_accuracy:.1f}"
    if k == -1:
        return f"{r.distinct_correct:.2f}"
    return f"{100 * r.pass_at_k[k]:.1f}"


def _splits_and_metrics(evals: dict[str, dict[str, SplitResult]]) -> tuple[list[str], list[tuple[str, int | None]]]:
    splits = sorted({s for res in evals.values() for s in res})
    return splits, _metrics(min(max(r.pass_at_k) for res in evals.values() for r in res.values()))


def comparison_rows(evals: dict[str, dict[str, SplitResult]]) -> tuple[list[str], list[list[str]]]:
    """The paper-style table: one row per model, a column group per test set."""
    splits, metrics = _splits_and_metrics(evals)
    header = ["model", *(f"{s} {name}" for s in splits for name, _ in metrics)]
    rows = [[name, *(_cell(res[s], k) if s in res else "-" for s in splits for _, k in metrics)]
            for name, res in evals.items()]
    return header, rows


def difficulty_rows(evals: dict[str, dict[str, SplitResult]]) -> tuple[list[str], list[list[str]]]:
    """Per test set, part of its prompts by what pi_0 did on them (always, sometimes, never right) and
    model: Pass@1, Pass@k_max and distinct correct answers on that part (where the diversity is kept
    or lost). One row each, the models of a part together."""
    base = {split: b for split, b in sorted(evals.get("base", {}).items()) if b.per_prompt}
    k_max = max((b.samples for b in base.values()), default=0)
    header = ["test set", "pi_0 on these prompts", "prompts", "model", "P@1", f"P@{k_max}", "distinct"]
    rows = []
    for split, b in base.items():
        parts = {name: by_base_difficulty(b, res[split]) for name, res in evals.items()
                 if split in res and res[split].per_prompt}
        for d, label in DIFFICULTY.items():
            for name, subsets in parts.items():
                if (sub := subsets.get(d)) is not None:
                    rows.append([split, label, str(sub.prompts), name, f"{100 * sub.pass_at_k[1]:.1f}",
                                 f"{100 * sub.pass_at_k[max(sub.pass_at_k)]:.1f}", f"{sub.distinct_correct:.2f}"])
    return header, rows


def tables_by_test_set(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown lines: one small table per test set (rows whose first cell names it), under its name."""
    lines: list[str] = []
    for split in dict.fromkeys(r[0] for r in rows):
        lines += [f"### {split}", "", markdown_table(header[1:], [r[1:] for r in rows if r[0] == split]), ""]
    return lines


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def rate(per_s: float) -> str:
    """A rate to three figures below 100 (a large model's completions/s), whole numbers above."""
    return f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.3g}"


def print_tables(evals: dict[str, dict[str, SplitResult]]) -> None:
    """The comparison on the terminal, one narrow table per test set (models as rows)."""
    splits, metrics = _splits_and_metrics(evals)
    for split in splits:
        table = Table(title=f"{split}: greedy and Pass@k (%), distinct correct answers per prompt")
        table.add_column("model")
        for name, _ in metrics:
            table.add_column(name, justify="right")
        for name, res in evals.items():
            if split in res:
                table.add_row(name, *(_cell(res[split], k) for _, k in metrics))
        console.print(table)


BASE_COLOUR = "black"  # pi_0 (dashed) in every figure of a report


def run_colours(names: Iterable[str]) -> dict[str, str]:
    """The colour of each run (and of pi_0, "base") in every panel of a run's figures."""
    return colour_map(["base", *names], fixed={"base": BASE_COLOUR})


def _save(fig: Figure, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    pyplot().close(fig)


def pass_at_k_figure(evals: dict[str, dict[str, SplitResult]], colours: dict[str, str] | None = None) -> Figure:
    """Pass@k against k, a panel per test set, a line per model."""
    colours = colours or run_colours(evals)
    splits = sorted({s for res in evals.values() for s in res})
    fig, axes = pyplot().subplots(1, len(splits), figsize=(5 * len(splits), 4), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        for name, res in evals.items():
            if split in res:
                ks = sorted(res[split].pass_at_k)
                ax.plot(ks, [100 * res[split].pass_at_k[k] for k in ks], marker="o", ms=3, label=name,
                        color=colours[name], ls="--" if name == "base" else "-")
        ax.set(xscale="log", xlabel="k", ylabel="Pass@k (%)", title=split)
        ax.grid(alpha=0.3)
        ax.legend()
    return fig


def plot_pass_at_k(evals: dict[str, dict[str, SplitResult]], out: Path, colours: dict[str, str] | None = None) -> None:
    _save(pass_at_k_figure(evals, colours), out)


def training_figure(curves: dict[str, list[dict[str, float]]], colours: dict[str, str]) -> Figure:
    """Reward, entropy, divergence and staleness against the learner step, a line per RL run."""
    keys = [("reward/mean", "reward"), ("policy/entropy", "entropy"), ("loss/divergence_ref", "divergence (ref)"),
            ("staleness/mean", "staleness")]
    fig, axes = pyplot().subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for mode, rows in curves.items():
            pts = [(r["learner/version"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=mode, color=colours[mode])
        ax.set(xlabel="learner step", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    return fig


def plot_training(curves: dict[str, list[dict[str, float]]], out: Path, colours: dict[str, str]) -> None:
    _save(training_figure(curves, colours), out)


def _jsonable(value: object) -> object:
    """What json cannot write itself: the typed results as their fields, anything else (paths) as text."""
    return msgspec.to_builtins(value) if is_dataclass(value) else str(value)


def throughput_rows(rl: dict[str, RLResult], curves: dict[str, list[dict[str, float]]]) -> list[list[str]]:
    """Per RL run: start-up (to the first step's metrics) and shutdown (after the last step) seconds,
    each actor's generation tokens/s, the learner's training tokens/s, drops, restarts."""
    rows = []
    for mode, r in rl.items():
        actors = " / ".join(f"{a.tokens_generated / max(a.generate_seconds, 1e-9):,.0f}" for a in r.actors)
        tokens = sum(m["batch/fresh_tokens"] for m in curves.get(mode, []))
        ph = r.phases
        startup = f"{ph['first_step']:.1f}" if "first_step" in ph else "-"
        shutdown = f"{ph['end'] - ph['last_step']:.1f}" if "last_step" in ph else "-"
        rows.append([mode, f"{r.wall_seconds:.0f}", startup, shutdown, str(r.learner.steps), actors,
                     f"{tokens / max(r.learner.train_seconds, 1e-9):,.0f}",
                     f"{r.learner.wait_seconds / max(r.wall_seconds, 1e-9):.0%}",
                     str(sum(r.replay.drops.values())), str(r.actor_restarts)])
    return rows


def kl_rows(curves: dict[str, list[dict[str, float]]]) -> list[list[str]]:
    """Per RL run with a KL monitor (learner.kl_every): its last KL(pi_theta || pi_0) estimates, k1 and
    k3 +- their standard errors, at the sampling temperature."""
    rows = []
    for mode, ms in curves.items():
        last = [m for m in ms if "kl/k1" in m]
        if last:
            m = last[-1]
            rows.append([mode, f"{m['learner/version']:.0f}", f"{m['kl/k1']:.4g} ± {m['kl/k1_se']:.2g}",
                         f"{m['kl/k3']:.4g} ± {m['kl/k3_se']:.2g}", f"{m['kl/sequences']:.0f}"])
    return rows


THROUGHPUT_HEADER = ["mode", "wall s", "start-up s", "shutdown s", "steps", "actor gen tok/s", "learner fresh tok/s",
                     "learner waiting", "groups dropped", "actor restarts"]


def write_report(paths: RunPaths, summary: dict, eval_files: dict[str, Path]) -> None:
    paths.plots.mkdir(parents=True, exist_ok=True)
    evals = {name: load_results(path) for name, path in eval_files.items()}
    curves = {}
    for mode in summary["modes"]:
        f = paths.rl(summary["runs"][mode]["dir"]) / "metrics.jsonl"
        if f.is_file():
            curves[mode] = [json.loads(line) for line in f.read_text().splitlines()]
    colours = run_colours(summary["modes"])
    if curves:
        plot_training(curves, paths.plots / "training.png", colours)
    md = [f"# dph-async run: {paths.root.name}", ""]
    if evals:
        summary["eval"] = {name: {s: asdict(r) for s, r in res.items()} for name, res in evals.items()}
        plot_pass_at_k(evals, paths.plots / "pass_at_k.png", colours)
        header, rows = comparison_rows(evals)
        md += ["Greedy accuracy, unbiased Pass@k (%), and distinct correct answers per prompt.", "",
               markdown_table(header, rows), ""]
        header, rows = difficulty_rows(evals)
        if rows:
            md += ["## By what pi_0 did on each test prompt", "",
                   "The test prompts split by pi_0's own samples: always right (like D_pef, where the DPH "
                   "divergence trains), sometimes right (like D_exp), never right. Pass@k (%) and distinct "
                   "correct answers per prompt on each part. pi_0's own rows are the draw that sorted the "
                   "prompts, so its P@max is 100 where it is right under half the time and 0 where never, by "
                   "construction: compare the trained models with each other here (an ablation of the "
                   "divergences evaluates pi_0 again for an unbiased row).", "", *tables_by_test_set(header, rows)]
        print_tables(evals)
    if rows := kl_rows(curves):
        md += ["## KL(pi_theta || pi_0) at the sampling temperature", "",
               markdown_table(["run", "version", "k1", "k3", "sequences"], rows), "",
               "On fresh samples of the trained weights (learner/kl_monitor.py), ± one standard error.", ""]
    md += ["## Runs", "", markdown_table(["run", "objective", "coefficient", "trained on"], [
        [name, r["objective"], f"{r['coeff']:g}", "D_exp" if r["prompts"] == "d_exp" else "all training prompts"]
        for name, r in summary["runs"].items()]), ""]
    md += ["## Throughput", "", markdown_table(THROUGHPUT_HEADER, throughput_rows(summary["rl"], curves)), "",
           "Generation tokens/s is per actor, over its time inside engine steps; the learner's is the fresh "
           "tokens it trained on over its time in optimizer steps.", ""]
    md += ["## Stage wall times (s)", "", markdown_table(["stage", "seconds"], [
        [k, f"{v:.1f}"] for k, v in summary["stage_seconds"].items()]), ""]
    md += ["Plots: `plots/training.png`, `plots/pass_at_k.png`.", ""]
    (paths.root / "summary.md").write_text("\n".join(md))
    (paths.root / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable))
    stages = ", ".join(f"{k} {v:.0f}s" for k, v in summary["stage_seconds"].items())
    console.print(f"stages: {stages}; total {summary['wall_seconds']:.0f}s")
    console.print(f"report: {paths.root / 'summary.md'} (plots in {paths.plots}, logs in {paths.root / 'rl'}/*/logs)")
