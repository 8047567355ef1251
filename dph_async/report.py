"""The run's report: summary.json, summary.md (the paper-style table), PNG plots, a terminal table."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from rich.table import Table  # noqa: E402

from dph_async.evaluate import SplitResult, load_results  # noqa: E402
from dph_async.paths import RunPaths  # noqa: E402
from dph_async.progress import console  # noqa: E402

TABLE_K = (1, 4, 8, 16)


def _columns(splits: list[str], k_max: int) -> list[tuple[str, str, int | None]]:
    ks = [k for k in TABLE_K if k <= k_max]
    return [col for s in splits for col in [(s, "Greedy", None), *((s, f"P@{k}", k) for k in ks), (s, "Distinct", -1)]]


def _cell(r: SplitResult, k: int | None) -> str:
    if k is None:
        return f"{100 * r.greedy_accuracy:.1f}"
    if k == -1:
        return f"{r.distinct_correct:.2f}"
    return f"{100 * r.pass_at_k[k]:.1f}"


def comparison_rows(evals: dict[str, dict[str, SplitResult]]) -> tuple[list[str], list[list[str]]]:
    splits = sorted({s for res in evals.values() for s in res})
    k_max = min(max(r.pass_at_k) for res in evals.values() for r in res.values())
    cols = _columns(splits, k_max)
    header = ["model", *(f"{s} {name}" for s, name, _ in cols)]
    rows = [[name, *(_cell(res[s], k) if s in res else "-" for s, _, k in cols)] for name, res in evals.items()]
    return header, rows


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def plot_pass_at_k(evals: dict[str, dict[str, SplitResult]], out: Path) -> None:
    splits = sorted({s for res in evals.values() for s in res})
    fig, axes = plt.subplots(1, len(splits), figsize=(5 * len(splits), 4), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        for name, res in evals.items():
            if split in res:
                ks = sorted(res[split].pass_at_k)
                ax.plot(ks, [100 * res[split].pass_at_k[k] for k in ks], marker="o", ms=3, label=name,
                        ls="--" if name == "base" else "-")
        ax.set(xscale="log", xlabel="k", ylabel="Pass@k (%)", title=split)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_training(curves: dict[str, list[dict[str, float]]], out: Path) -> None:
    keys = [("reward/mean", "reward"), ("policy/entropy", "entropy"), ("loss/divergence_ref", "divergence (ref)"),
            ("staleness/mean", "staleness")]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.5 * len(keys), 3.5))
    for ax, (key, title) in zip(axes, keys, strict=True):
        for mode, rows in curves.items():
            pts = [(r["learner/version"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=mode)
        ax.set(xlabel="learner step", title=title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def write_report(paths: RunPaths, summary: dict, eval_files: dict[str, Path]) -> None:
    paths.plots.mkdir(parents=True, exist_ok=True)
    evals = {name: load_results(path) for name, path in eval_files.items()}
    curves = {}
    for mode in summary["modes"]:
        f = paths.rl(mode) / "metrics.jsonl"
        if f.is_file():
            curves[mode] = [json.loads(line) for line in f.read_text().splitlines()]
    if curves:
        plot_training(curves, paths.plots / "training.png")
    md = [f"# dph-async run: {paths.root.name}", ""]
    if evals:
        summary["eval"] = {name: {s: r.__dict__ for s, r in res.items()} for name, res in evals.items()}
        plot_pass_at_k(evals, paths.plots / "pass_at_k.png")
        header, rows = comparison_rows(evals)
        md += ["Greedy accuracy, unbiased Pass@k (%), and distinct correct answers per prompt.", "",
               markdown_table(header, rows), ""]
        table = Table(title="base vs trained (greedy, Pass@k %, distinct correct answers)")
        for h in header:
            table.add_column(h, justify="right" if h != "model" else "left")
        for r in rows:
            table.add_row(*r)
        console.print(table)
    md += ["## Stage wall times (s)", "", markdown_table(["stage", "seconds"], [
        [k, f"{v:.1f}"] for k, v in summary["stage_seconds"].items()]), ""]
    md += ["Plots: `plots/training.png`, `plots/pass_at_k.png`.", ""]
    (paths.root / "summary.md").write_text("\n".join(md))
    (paths.root / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    console.print(f"report: {paths.root / 'summary.md'}")
