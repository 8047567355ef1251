"""Plots of a sweep, every line a group's mean over its seeds.

curves.png      training reward against fresh samples consumed (top) and wall time (bottom)
pass_at_k.png   Pass@1 (dashed) and Pass@k_max (solid) per test split at the evaluated versions
staleness.png   share of consumed groups by staleness
summary.png     final reward, Pass@k_max, ESS and mismatch KL (k3) per group, with standard errors
frontier.png    (frontier sweeps) Pass@k_max against Pass@1 per objective over its coefficient
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from dph_async.pipeline.plot_colours import colour_map
from dph_async.runtime.evaluate import SplitResult
from dph_async.tools.ablate import frontier
from dph_async.tools.ablate.results import Group


def _save(fig: plt.Figure, out: Path, rect: tuple[float, float, float, float] = (0, 0, 1, 1)) -> None:
    fig.tight_layout(rect=rect)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _panels(groups: list[Group], panel: str | None) -> dict[str, list[Group]]:
    out: dict[str, list[Group]] = {}
    for g in groups:
        out.setdefault(str(g.factors[panel]) if panel else "", []).append(g)
    return out


def _label(g: Group, panel: str | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in g.factors.items() if k != panel) if panel else g.name


def _colours(groups: list[Group], panel: str | None) -> dict[str, str]:
    """A line's colour by its label, the same in every panel (a panel may lack some labels)."""
    return colour_map(_label(g, panel) for g in groups)


def _smooth(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _mean_curve(g: Group, attr: str) -> list[float]:
    n = min(len(getattr(c, attr)) for c in g.cells)
    return [sum(getattr(c, attr)[i] for c in g.cells) / len(g.cells) for i in range(n)]


def plot_curves(groups: list[Group], panel: str | None, out: Path) -> None:
    panels, colours = _panels(groups, panel), _colours(groups, panel)
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False)
    for j, (name, members) in enumerate(panels.items()):
        for g in members:
            reward = _mean_curve(g, "reward")
            smooth = _smooth(reward, max(1, len(reward) // 15))
            label = _label(g, panel)
            for i, attr in enumerate(("samples", "wall")):
                axes[i, j].plot(_mean_curve(g, attr)[: len(smooth)], smooth, label=label, color=colours[label])
        axes[0, j].set(title=f"{panel}={name}" if panel else "training reward", xlabel="fresh samples consumed",
                       ylabel="training reward (moving mean)")
        axes[1, j].set(xlabel="wall seconds since the first step", ylabel="training reward (moving mean)")
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
        axes[0, j].legend(fontsize=7)
    _save(fig, out)


def plot_pass_at_k(groups: list[Group], panel: str | None, out: Path) -> None:
    panels, colours = _panels(groups, panel), _colours(groups, panel)
    splits = sorted(groups[0].cells[0].evals[-1].splits)
    k_max = max(groups[0].cells[0].evals[-1].splits[splits[0]].pass_at_k)
    fig, axes = plt.subplots(len(splits), len(panels), figsize=(5 * len(panels), 3.5 * len(splits)), squeeze=False)
    for j, (name, members) in enumerate(panels.items()):
        for g in members:
            color = colours[_label(g, panel)]
            points = min(len(c.evals) for c in g.cells)
            xs = [sum(c.evals[p].samples for c in g.cells) / len(g.cells) for p in range(points)]
            for i, split in enumerate(splits):
                for k, ls in ((k_max, "-"), (1, "--")):
                    ys = [100 * sum(c.evals[p].splits[split].pass_at_k[k] for c in g.cells) / len(g.cells)
                          for p in range(points)]
                    axes[i, j].plot(xs, ys, ls=ls, marker="o", ms=3, color=color,
                                    label=_label(g, panel) if k == k_max else None)
        for i, split in enumerate(splits):
            axes[i, j].set(title=f"{split}" + (f", {panel}={name}" if panel else ""),
                           xlabel="fresh samples consumed", ylabel=f"Pass@{k_max} (solid), Pass@1 (dashed), %")
            axes[i, j].grid(alpha=0.3)
        axes[0, j].legend(fontsize=7)
    _save(fig, out)


def plot_staleness(groups: list[Group], panel: str | None, out: Path) -> None:
    panels, colours = _panels(groups, panel), _colours(groups, panel)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (name, members) in zip(axes[0], panels.items(), strict=True):
        width = 0.8 / len(members)
        for gi, g in enumerate(members):
            hist: dict[int, int] = {}
            for c in g.cells:
                for s, n in c.staleness_hist.items():
                    hist[s] = hist.get(s, 0) + n
            total = sum(hist.values()) or 1
            xs = sorted(hist)
            ax.bar([x + (gi - (len(members) - 1) / 2) * width for x in xs], [hist[x] / total for x in xs],
                   width=width, label=_label(g, panel), color=colours[_label(g, panel)])
        ax.set(title=f"{panel}={name}" if panel else "staleness", xlabel="staleness (learner versions)",
               ylabel="share of consumed groups")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=7)
    _save(fig, out)


def plot_summary(groups: list[Group], x: str, panel: str | None, k_max: int, split: str, out: Path) -> None:
    """Per metric: lines over the numeric factor x, one per panel value; else bars per group."""
    metrics = [("reward", "final training reward"), (f"{split}/pass@{k_max}", f"{split} Pass@{k_max}"),
               ("ess", "ESS (mean over steps)"), ("mismatch_kl_k3", "mismatch KL k3 (mean)")]
    numeric = panel is not None and all(isinstance(g.factors[x], int | float) for g in groups)
    colours = colour_map(f"{panel}={name}" for name in _panels(groups, panel))  # a metric may lack a panel value
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        have = [g for g in groups if key in g.metrics]
        if numeric:
            for name, members in _panels(have, panel).items():
                ax.errorbar([g.factors[x] for g in members], [g.metrics[key].mean for g in members],
                            yerr=[g.metrics[key].se or 0.0 for g in members], marker="o", capsize=3,
                            label=f"{panel}={name}", color=colours[f"{panel}={name}"])
            ax.set(xlabel=x)
            ax.legend(fontsize=7)
        else:
            ax.bar(range(len(have)), [g.metrics[key].mean for g in have],
                   yerr=[g.metrics[key].se or 0.0 for g in have], capsize=3, color="C0")
            ax.set_xticks(range(len(have)), [g.name for g in have], rotation=45, ha="right", fontsize=7)
        ax.set(title=title)
        ax.grid(alpha=0.3)
    _save(fig, out)


def plot_frontier(groups: list[Group], splits: list[str], k: int, base: dict[str, SplitResult], out: Path) -> None:
    """Pass@k against Pass@1 of the final models, one panel per test split: one line per objective
    through its coefficient ladder (each point labelled with its coefficient), the other shares of
    the batch as open squares in the objective's colour (labelled with the share), pi_0 as a star;
    error bars are standard errors over seeds on both axes."""
    modes = frontier.lines(groups)
    colour = colour_map(modes)
    fig, axes = plt.subplots(1, len(splits), figsize=(6.5 * len(splits), 5), squeeze=False)
    for ax, split in zip(axes[0], splits, strict=True):
        p1, pk = f"{split}/pass@1", f"{split}/pass@{k}"
        for mode, members in modes.items():
            have = [g for g in members if p1 in g.metrics and pk in g.metrics]
            _errorbar(ax, have, p1, pk, colour[mode], mode, fmt="-o")
            for g in have:
                ax.annotate(f"{g.factors['coeff']:g}", (100 * g.metrics[p1].mean, 100 * g.metrics[pk].mean),
                            textcoords="offset points", xytext=(4, 4), fontsize=7, color=colour[mode])
        for g in (g for g in groups if not frontier.is_ladder(g) and p1 in g.metrics and pk in g.metrics):
            _errorbar(ax, [g], p1, pk, colour.get(str(g.factors["mode"]), "k"), None, fmt="s", mfc="none")
            ax.annotate(f"{g.factors['coeff']:g}, {100 * float(g.factors['share']):.0f}%",
                        (100 * g.metrics[p1].mean, 100 * g.metrics[pk].mean), textcoords="offset points",
                        xytext=(4, -10), fontsize=7)
        if split in base:
            ax.plot(100 * base[split].pass_at_k[1], 100 * base[split].pass_at_k[k], "k*", ms=12, label="π₀")
        ax.set(title=f"{split}: Pass@{k} against Pass@1 (final models)", xlabel="Pass@1 (%)",
               ylabel=f"Pass@{k} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, out)


def _errorbar(ax: plt.Axes, groups: list[Group], x: str, y: str, colour: str, label: str | None, **kw) -> None:
    ax.errorbar([100 * g.metrics[x].mean for g in groups], [100 * g.metrics[y].mean for g in groups],
                xerr=[100 * (g.metrics[x].se or 0.0) for g in groups],
                yerr=[100 * (g.metrics[y].se or 0.0) for g in groups],
                color=colour, label=label, capsize=2, ms=4, **kw)
