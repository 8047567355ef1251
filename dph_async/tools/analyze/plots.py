"""Figures of a weight analysis, drawn from what analysis.json and spectra.npz hold.

    spectra.png         per type: singular values of base (dashed) and last checkpoint (solid), per layer
    delta_spectra.png   per type: singular values of the update trained - base, per layer
    angles.png          layer x type heat maps of the mean top-k principal angle, left and right
    angle_profiles.png  per type: the k principal angles (left), ascending, per layer
    trajectory.png      (several checkpoints) per type: mean top-k angle and relative change along the run
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from dph_async.tools.analyze.checkpoints import type_rank
from dph_async.tools.analyze.drift import Analysis, MatrixResult


def _types(matrices: list[MatrixResult]) -> list[str]:
    return sorted({m.info.type for m in matrices}, key=type_rank)


def _grid(n: int, title: str) -> tuple[plt.Figure, list[plt.Axes]]:
    cols = min(4, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, list(axes.flat[:n])


def _colour(m: MatrixResult, layers: int):
    """One colour per layer (viridis, first to last); black for matrices outside the blocks."""
    return "black" if m.info.layer is None else plt.cm.viridis(m.info.layer / max(layers - 1, 1))


def _save(fig: plt.Figure, out: Path) -> None:
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _per_type_lines(a: Analysis, out: Path, title: str, ylabel: str, series, log: bool = False) -> None:
    """A panel per type; in each, one line per matrix of the last checkpoint: series(matrix) -> [(y, style)]."""
    last = a.last()
    layers = 1 + max((m.info.layer for m in last if m.info.layer is not None), default=0)
    types = _types(last)
    fig, axes = _grid(len(types), title)
    for ax, type_ in zip(axes, types, strict=True):
        for m in (m for m in last if m.info.type == type_):
            for y, style in series(m):
                ax.plot(np.arange(1, len(y) + 1), y, style, color=_colour(m, layers), lw=1, alpha=0.8)
        ax.set(title=type_, xlabel="index", ylabel=ylabel, yscale="log" if log else "linear")
        ax.grid(alpha=0.3)
    _save(fig, out)


def plot_spectra(a: Analysis, out: Path) -> None:
    label = a.checkpoints[-1].label
    _per_type_lines(a, out, f"singular values: base (dashed) and {label} (solid); colour = layer", "singular value",
                    lambda m: [(a.spectra[f"base::{m.info.name}"], "--"),
                               (a.spectra[f"{label}::{m.info.name}::trained"], "-")], log=True)


def plot_delta_spectra(a: Analysis, out: Path) -> None:
    label = a.checkpoints[-1].label
    def positive(d: np.ndarray) -> np.ndarray:  # descending: the zeros of an unchanged matrix drop off the end
        return d[d > 0]

    _per_type_lines(a, out, f"singular values of the update {label} - base; colour = layer", "singular value",
                    lambda m: [(positive(a.spectra[f"{label}::{m.info.name}::delta"]), "-")], log=True)


def plot_angle_profiles(a: Analysis, out: Path) -> None:
    _per_type_lines(a, out, f"top-{a.top_k} principal angles, left singular subspaces (ascending); colour = layer",
                    "angle (degrees)", lambda m: [(m.stats.angles_left, "-")])


def angle_grid(matrices: list[MatrixResult], side: str) -> tuple[list[str], list[str], np.ndarray]:
    """Rows (layers, then "-" for matrices outside the blocks), columns (types), mean angle per cell
    (NaN where a layer has no matrix of that type)."""
    types = _types(matrices)
    layers = sorted({m.info.layer for m in matrices if m.info.layer is not None})
    rows = [str(x) for x in layers] + (["-"] if any(m.info.layer is None for m in matrices) else [])
    grid = np.full((len(rows), len(types)), np.nan)
    for m in matrices:
        r = rows.index("-" if m.info.layer is None else str(m.info.layer))
        grid[r, types.index(m.info.type)] = np.mean(m.stats.angles_left if side == "left" else m.stats.angles_right)
    return rows, types, grid


def plot_angles(a: Analysis, out: Path) -> None:
    last = a.last()
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.35 * len(angle_grid(last, "left")[0])), squeeze=False)
    vmax = max(1e-9, *(np.nanmax(angle_grid(last, s)[2]) for s in ("left", "right")))
    for ax, side in zip(axes[0], ("left", "right"), strict=True):
        rows, types, grid = angle_grid(last, side)
        im = ax.imshow(grid, aspect="auto", cmap="magma", vmin=0, vmax=vmax)
        ax.set(xticks=range(len(types)), xticklabels=types, yticks=range(len(rows)), yticklabels=rows,
               xlabel="type", ylabel="layer", title=f"mean top-{a.top_k} principal angle, {side} (degrees)")
        for (r, c), v in np.ndenumerate(grid):
            if np.isfinite(v):
                ax.text(c, r, f"{v:.1f}", ha="center", va="center", fontsize=7,
                        color="white" if v < 0.6 * vmax else "black")
        fig.colorbar(im, ax=ax)
    _save(fig, out)


def plot_trajectory(a: Analysis, out: Path) -> None:
    summaries = a.by_type()
    labels = [c.label for c in a.checkpoints]
    types = sorted({s.type for s in summaries}, key=type_rank)
    keys = [("angle_left", "mean top-k angle, left (deg)"), ("angle_right", "mean top-k angle, right (deg)"),
            ("rel_change", "||W - W_base|| / ||W_base||")]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.8), squeeze=False)
    for ax, (key, title) in zip(axes[0], keys, strict=True):
        for type_ in types:
            pts = {s.checkpoint: getattr(s, key) for s in summaries if s.type == type_}
            ax.plot(range(len(labels)), [pts.get(x, np.nan) for x in labels], marker="o", ms=3, label=type_)
        ax.set(title=title, xticks=range(len(labels)))
        ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    _save(fig, out)


def plots_for(a: Analysis) -> dict[str, Callable[[Analysis, Path], None]]:
    """File name -> drawing function of the plots this analysis gets (a trajectory needs two checkpoints)."""
    plots = {"spectra.png": plot_spectra, "delta_spectra.png": plot_delta_spectra, "angles.png": plot_angles,
             "angle_profiles.png": plot_angle_profiles}
    return {**plots, "trajectory.png": plot_trajectory} if len(a.checkpoints) > 1 else plots


def write_plots(a: Analysis, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, draw in plots_for(a).items():
        draw(a, out_dir / name)
