"""Design 1's figure (docs/preregistration.md): per task, in-domain Pass@16 against Pass@1 of the final
models, mean ± s.e. over the pre-registered seeds on both axes; the reverse-KL frontier as a line
through its three coefficients, the arms as points, pi_0 as a star. The verdicts are confirm.py's."""

from __future__ import annotations

from pathlib import Path

from dph_async.pipeline.plot_colours import colour_map, pyplot
from dph_async.tools.ablate.confirm import ARMS, RIVAL, SECONDARY, K, Sweeps, pass_key, point
from dph_async.tools.ablate.results import Stat
from dph_async.tools.ablate.seeds import BASE

ARM_LABELS = {"A": "A grpo@d_exp (control)", "B": "B DPH-JS 0.2 as written", "C": "C DPH-JS 0.2 as run",
              "D": "D PG on D_pef alone", "J": "J DPH-JS 200, pool 25%"}
RIVAL_LABEL = "reverse KL (0.01, 0.1, 1)"


def figure(tasks: dict[str, Sweeps]):
    """The matplotlib figure, one panel per task (in percent)."""
    plt = pyplot()
    colour = colour_map(["reverse KL", *ARM_LABELS])
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 5), squeeze=False)
    for ax, (task, sweeps) in zip(axes[0], tasks.items(), strict=True):
        rival = [(arm[1].split(":")[1], p) for arm in RIVAL if (p := point(sweeps, arm)) is not None]
        if rival:
            _errorbar(ax, [p for _, p in rival], colour["reverse KL"], RIVAL_LABEL, "-o")
            for coeff, (x, y) in rival:
                ax.annotate(coeff, (100 * x.mean, 100 * y.mean), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        for name, arm in {"A": ARMS["A"], **SECONDARY}.items():
            if (p := point(sweeps, arm)) is not None:
                _errorbar(ax, [p], colour[name], ARM_LABELS[name], "s")
        base = next((r.metrics for r in sweeps[0] if r.group == BASE), None)
        if base is not None and pass_key(K) in base:
            ax.plot(100 * base[pass_key(1)], 100 * base[pass_key(K)], "k*", ms=12, label="π₀")
        ax.set(title=f"{task}: in-domain Pass@{K} against Pass@1", xlabel="Pass@1 (%)", ylabel=f"Pass@{K} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot(tasks: dict[str, Sweeps], out: Path, source: str | None = None) -> None:
    """The figure, drawn to a PNG at `out`; `source`: its Source text chunk (what it was drawn from)."""
    save(figure(tasks), out, source)


def save(fig, out: Path, source: str | None = None) -> None:
    """Write `fig` as a PNG (with `source` as its Source text chunk) and close it."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png", dpi=120, metadata={"Source": source} if source else None)
    finally:
        pyplot().close(fig)


def _errorbar(ax, points: list[tuple[Stat, Stat]], colour: str, label: str, fmt: str) -> None:
    ax.errorbar([100 * x.mean for x, _ in points], [100 * y.mean for _, y in points],
                xerr=[100 * (x.se or 0.0) for x, _ in points], yerr=[100 * (y.se or 0.0) for _, y in points],
                fmt=fmt, color=colour, label=label, capsize=2, ms=5)
