"""A sweep's summary: summary.json (every cell and group), summary.md (tables, verdicts), plots/,
seeds.csv (one row per cell: the raw results, `seeds.py`).

Tables give mean ± standard error over seeds. The staleness verdict compares every eta with eta = 0
of the same correction on the final model's test Pass@1 (its mean reward on held-out prompts) and on
the training reward: the difference and its standard error sqrt(se_eta^2 + se_0^2); "reaches eta=0"
when the difference is above minus one standard error, "degrades" when below minus two.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from dph_async.config import load_config
from dph_async.paths import RunPaths
from dph_async.pipeline.report import TABLE_K, markdown_table
from dph_async.runtime.evaluate import DIFFICULTY, SplitResult, difficulty_of, load_results
from dph_async.tools.ablate import frontier, plots
from dph_async.tools.ablate.results import Group, Stat, load_cell, split_metrics, summarize
from dph_async.tools.ablate.seeds import write_seeds


@dataclass(frozen=True)
class Column:
    header: str
    key: str
    scale: float = 1.0
    digits: int = 3


def _split_columns(splits: list[str], ks: list[int]) -> list[Column]:
    return [c for s in splits for c in [Column(f"{s} Greedy", f"{s}/greedy", 100, 1),
                                        *(Column(f"{s} P@{k}", f"{s}/pass@{k}", 100, 1) for k in ks)]]


def staleness_columns(splits: list[str], k_max: int) -> list[Column]:
    return [Column("train reward", "reward"), *_split_columns(splits, [1, k_max]),
            Column("staleness", "staleness", digits=2), Column("eta (auto, mean)", "eta", digits=2),
            Column("ESS", "ess"), Column("data wait", "data_wait"), Column("clip frac", "clip_frac"),
            Column("kept frac", "kept_frac"), Column("mismatch KL k3", "mismatch_kl_k3", digits=4),
            Column("dropped", "dropped", digits=0), Column("wall s", "wall_s", digits=2)]


def divergence_columns(splits: list[str], k_max: int) -> list[Column]:
    ks = [k for k in TABLE_K if k <= k_max]
    return [*_split_columns(splits, ks), *(Column(f"{s} distinct", f"{s}/distinct", digits=2) for s in splits),
            Column("train reward", "reward"), Column("ESS", "ess")]


def difficulty_columns(split: str, kind: str, k_max: int) -> list[Column]:
    """Pass@1, Pass@k_max and distinct correct answers on the split's prompts of one band by what pi_0
    did on each (evaluate.difficulty_of)."""
    return [Column("P@1", f"{split}/{kind}/pass@1", 100, 1),
            Column(f"P@{k_max}", f"{split}/{kind}/pass@{k_max}", 100, 1),
            Column("distinct", f"{split}/{kind}/distinct", digits=2)]


def difficulty_tables(groups: list[Group], split: str, k_max: int, base: dict[str, SplitResult],
                      redraw: dict[str, SplitResult] | None) -> list[str]:
    """Markdown lines: one small table per band of the split's prompts, its prompt count in its title."""
    counts = Counter(difficulty_of(r.correct, base[split].samples) for r in base[split].per_prompt)
    lines: list[str] = []
    for kind, label in DIFFICULTY.items():
        if counts[kind]:
            lines += [f"### {label} ({counts[kind]} prompts)", "",
                      results_table(groups, difficulty_columns(split, kind, k_max), base, redraw), ""]
    return lines


def _base_row(base: dict[str, SplitResult], columns: list[Column], width: int,
              measured: dict[str, SplitResult] | None = None) -> list[str]:
    """pi_0's row: its figures on `measured` (default: `base`), per band as `base` sorts the prompts."""
    values = {}
    for split, r in (measured or base).items():
        values.update(split_metrics(split, r, base[split]))
    cells = [f"{c.scale * values[c.key]:.{c.digits}f}" if c.key in values else "-" for c in columns]
    return ["base (pi_0)" if measured is None else "base (pi_0), new draw", *["-"] * width, *cells]


def results_table(groups: list[Group], columns: list[Column], base: dict[str, SplitResult] | None,
                  redraw: dict[str, SplitResult] | None = None) -> str:
    """One row per group, after pi_0's row (on `redraw`, another draw of its samples, when given)."""
    factors = list(groups[0].factors)
    header = [*factors, "seeds", *(c.header for c in columns)]
    rows = [_base_row(base, columns, len(factors), redraw)] if base else []
    rows += [[*(str(g.factors[f]) for f in factors), str(len(g.cells)),
              *(g.metrics[c.key].fmt(c.scale, c.digits) if c.key in g.metrics else "-" for c in columns)]
             for g in groups]
    return markdown_table(header, rows)


@dataclass
class Verdict:
    correction: str
    eta: int | str  # an int, or "auto"
    metric: str
    delta: float  # mean at eta minus mean at eta = 0
    se: float | None
    verdict: str


def _verdict(delta: float, se: float | None) -> str:
    if se is None:
        return "one seed: no standard error"
    if delta >= -se:
        return "reaches eta=0"
    return "degrades" if delta < -2 * se else "below eta=0, within 2 s.e."


def staleness_verdicts(groups: list[Group], metrics: list[str]) -> list[Verdict]:
    """Every eta against eta = 0 of the same correction."""
    out = []
    ref = {g.factors["correction"]: g for g in groups if g.factors["eta"] == 0}
    for g in groups:
        r = ref.get(g.factors["correction"])
        if r is None or g is r:
            continue
        for m in metrics:
            a, b = g.metrics.get(m), r.metrics.get(m)
            if a is None or b is None:
                continue
            se = math.sqrt(a.se**2 + b.se**2) if a.se is not None and b.se is not None else None
            delta = a.mean - b.mean
            out.append(Verdict(str(g.factors["correction"]), g.factors["eta"], m, delta, se, _verdict(delta, se)))
    return out


def frontier_section(groups: list[Group], comparisons: list[frontier.Comparison], splits: list[str]) -> list[str]:
    """The frontier's tables, one per test split (frontier.py has the comparisons' definitions)."""
    k = comparisons[0].k
    md = [f"## Frontier: Pass@{k} against Pass@1", "",
          f"Final models, % (distinct: correct answers per prompt), mean ± standard error over seeds; share: "
          f"the reference samples' share of a batch. Differences to the control paired by seed where the "
          f"seeds match, else Welch. `{frontier.RIVAL} P@{k} at this P@1`: the {frontier.RIVAL} frontier "
          f"interpolated linearly at the row's Pass@1 (- outside its range), every Pass@1's error carried "
          f"into the difference; above / below: p < 0.05 by Student's t at the difference's df, and again "
          f"after Holm's adjustment over the table (dph_async/tools/ablate/frontier.py).", ""]
    for split in splits:
        md += [f"### {split}", "", frontier.table(groups, [c for c in comparisons if c.split == split]), ""]
    return md


def write_summary(out: Path) -> list[Group]:
    """Summarise the finished cells of the sweep described by out/sweep.json; write the report."""
    meta = json.loads((out / "sweep.json").read_text())
    base = load_results(out / "eval" / "base.json")
    cells = [load_cell(out / "rl" / c["key"], base) for c in meta["cells"]
             if (out / "rl" / c["key"] / "cell.json").is_file()]
    if not cells:
        raise FileNotFoundError(f"no finished cell in {out / 'rl'}")
    groups = summarize(cells)
    splits = sorted(base)
    k_max = max(next(iter(base.values())).pass_at_k)
    kind, x, panel = meta["kind"], meta["x"], meta["panel"]
    plots_dir = out / "plots"
    plots_dir.mkdir(parents=True, exist_ok=True)
    plots.plot_curves(groups, panel, plots_dir / "curves.png")
    plots.plot_pass_at_k(groups, panel, plots_dir / "pass_at_k.png")
    plots.plot_staleness(groups, panel, plots_dir / "staleness.png")
    plots.plot_summary(groups, x, panel, k_max, splits[0], plots_dir / "summary.png")
    comparisons = []
    if kind == "frontier":
        plots.plot_frontier(groups, splits, k_max, base, plots_dir / "frontier.png")
        comparisons = [c for split in splits for c in frontier.compare(groups, split, k_max)]

    md = [f"# {kind} sweep: {out.name}", "",
          f"{len(cells)} of {len(meta['cells'])} cells finished, in {len(groups)} groups; mean ± standard error "
          f"over seeds. Greedy and Pass@k (%) of each cell's final model on the test splits; train reward: "
          f"mean over the last fifth of the steps; staleness, ESS, clip and kept fractions, mismatch KL: "
          f"means over the steps; dropped: groups dropped as too stale.", ""]
    if kind == "staleness":
        md += [results_table(groups, staleness_columns(splits, k_max), None), ""]
        verdicts = staleness_verdicts(groups, [f"{splits[0]}/pass@1", "reward"])
        if verdicts:
            md += ["## Against eta = 0 (same correction)", "",
                   markdown_table(["correction", "eta", "metric", "difference", "verdict"], [
                       [v.correction, str(v.eta), v.metric, Stat(v.delta, v.se, 0).fmt(digits=3), v.verdict]
                       for v in verdicts]), ""]
    else:
        verdicts = []
        md += [results_table(groups, divergence_columns(splits, k_max), base), ""]
        split = splits[0]
        redraw_file = out / "eval" / "base_redraw.json"
        redraw = load_results(redraw_file) if redraw_file.is_file() else None
        if base[split].per_prompt:
            md += [f"## {split}: by what pi_0 did on each test prompt", "",
                   f"The {split} test prompts grouped by how many of pi_0's {base[split].samples} samples were "
                   "right (always: all, the D_pef rule; mostly: at least half; rarely: under half; never); "
                   "Pass@k (%) and distinct correct answers of the final models on each group. "
                   + ("pi_0's row is a second draw of its samples: on the draw that sorted the prompts it "
                      "scores 100 on 'rarely' and 0 on 'never' by construction." if redraw else
                      "pi_0's row is the draw that sorted the prompts, so its 'rarely' and 'never' figures "
                      "hold by construction (100 and 0 at Pass@16): compare the runs with each other."), "",
                   *difficulty_tables(groups, split, k_max, base, redraw)]
    if comparisons:
        md += frontier_section(groups, comparisons, splits)
    if any(c.resumed for c in cells):
        md += ["Resumed after an interruption (their wall-clock curves hold the pause): "
               + ", ".join(c.cell.key for c in cells if c.resumed), ""]
    md += ["Plots: `plots/curves.png`, `plots/pass_at_k.png`, `plots/staleness.png`, `plots/summary.png`"
           + (", `plots/frontier.png`." if comparisons else "."), ""]
    (out / "summary.md").write_text("\n".join(md))
    cfg = load_config(str(out / "config.yaml"))
    base_model = Path(cfg.model.path) if cfg.model.path is not None else RunPaths(out).base_model
    write_seeds(out / "seeds.csv", cells, splits, k_max, cfg, base_model)
    summary = {
        "kind": kind,
        "groups": [{"name": g.name, "factors": g.factors, "cells": [c.cell.key for c in g.cells],
                    "metrics": {k: asdict(v) for k, v in g.metrics.items()}} for g in groups],
        "cells": [{"key": c.cell.key, "group": c.cell.group, "seed": c.cell.seed, "resumed": c.resumed,
                   "final_reward": c.final_reward, "staleness_hist": c.staleness_hist, "drops": c.drops,
                   "diagnostics": c.diagnostics,
                   "evals": [{"version": e.version, "samples": e.samples, "wall": e.wall,
                              "splits": {s: asdict(r) for s, r in e.splits.items()}} for e in c.evals]}
                  for c in cells],
        "verdicts": [asdict(v) for v in verdicts],
        "frontier": [asdict(c) for c in comparisons],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return groups
