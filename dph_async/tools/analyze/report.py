"""A weight analysis on disk: analysis.json (every matrix, and the means per type), spectra.npz (all
singular values), analysis.md (the tables) and plots/ (plots.py)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np

from dph_async.pipeline.report import markdown_table
from dph_async.tools.analyze.drift import Analysis, TypeSummary
from dph_async.tools.analyze.plots import angle_grid, plots_for, write_plots

SUMMARY_HEADER = ["type", "matrices", "‖ΔW‖/‖W‖", "θ left (°)", "θ right (°)", "θ max (°)", "Δσ/σ top-k",
                  "ΔW in base top-k", "of it diagonal", "ΔW stable rank", "ΔW in own top-k"]


def summary_row(s: TypeSummary) -> list[str]:
    return [s.type, str(s.matrices), f"{s.rel_change:.4f}", f"{s.angle_left:.2f}", f"{s.angle_right:.2f}",
            f"{s.angle_max:.2f}", f"{s.sv_rel_change:+.4f}", f"{s.delta_in_base_topk:.3f}",
            f"{s.delta_diag_base_topk:.3f}", f"{s.delta_stable_rank:.2f}", f"{s.delta_topk_share:.3f}"]


def markdown(a: Analysis) -> str:
    last = a.checkpoints[-1].label
    summaries = a.by_type()
    md = [f"# Weight analysis: `{a.base.path}` against {', '.join(f'`{c.label}`' for c in a.checkpoints)}", "",
          f"Top-k subspaces with k = min({a.top_k}, rows, columns) per matrix; SVDs in float64. θ: principal "
          "angles between the base's and the trained matrix's top-k singular subspaces (left: column space, "
          "right: row space), mean over the k angles and the layers. Δσ/σ: mean relative change of the top-k "
          "singular values. \"ΔW in base top-k\": share of ‖ΔW‖² inside the base's top-k left and right "
          "subspaces; \"of it diagonal\": the share that only rescales the base's top-k directions. Stable "
          "rank: ‖ΔW‖²_F / σ₁(ΔW)².", "",
          f"## Per type, {last}", "",
          markdown_table(SUMMARY_HEADER, [summary_row(s) for s in summaries if s.checkpoint == last]), ""]
    rows, types, left = angle_grid(a.last(), "left")
    right = angle_grid(a.last(), "right")[2]
    cells = [[r, *(f"{lv:.1f} / {rv:.1f}" if np.isfinite(lv) else "-" for lv, rv in zip(lrow, rrow, strict=True))]
             for r, lrow, rrow in zip(rows, left, right, strict=True)]
    md += [f"## Mean top-k principal angle per layer and type, left / right (°), {last}", "",
           markdown_table(["layer", *types], cells), ""]
    if len(a.checkpoints) > 1:
        labels = [c.label for c in a.checkpoints]
        by = {(s.checkpoint, s.type): s for s in summaries}
        all_types = list(dict.fromkeys(s.type for s in summaries))
        md += ["## Trajectory: mean top-k angle, left (°) and ‖ΔW‖/‖W‖ per type", "",
               markdown_table(["checkpoint", *all_types], [
                   [x, *(f"{by[x, t].angle_left:.2f} / {by[x, t].rel_change:.4f}" if (x, t) in by else "-"
                         for t in all_types)] for x in labels]), ""]
    md += ["Plots: " + ", ".join(f"`plots/{p}`" for p in plots_for(a)) + "; their data: `analysis.json` "
           "(statistics per matrix) and `spectra.npz` (singular values).", ""]
    return "\n".join(md)


def to_json(a: Analysis) -> dict:
    return {
        "base": asdict(a.base) | {"path": str(a.base.path)},
        "checkpoints": [asdict(c) | {"path": str(c.path)} for c in a.checkpoints],
        "top_k": a.top_k,
        "matrices": [m.row() for m in a.matrices],
        "by_type": [asdict(s) for s in a.by_type()],
        "spectra": "spectra.npz",
        "plots": [f"plots/{p}" for p in plots_for(a)],
    }


def write_analysis(a: Analysis, out: Path) -> Path:
    """Write everything under `out`; return the markdown file."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "analysis.json").write_text(json.dumps(to_json(a), indent=1))
    np.savez_compressed(out / "spectra.npz", **a.spectra)
    write_plots(a, out / "plots")
    (out / "analysis.md").write_text(markdown(a))
    return out / "analysis.md"
