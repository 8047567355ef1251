"""The cells of a sweep: one RL run each, named by its factors and seed.

A cell is a set of dotted config overrides on top of the sweep's base config. Cells that differ only
in their seed form a group; the summary averages over a group. Every cell trains from the same base
model pi_0 (prepared once for the sweep), so the seed changes only the RL run: sampling, prompt order,
learner initialisation of its random state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CORRECTIONS = ("behavior", "decoupled", "masked")


@dataclass(frozen=True)
class Cell:
    key: str  # directory name under rl/
    group: str  # the cell without its seed
    factors: dict[str, str | int | float]  # e.g. {"eta": 4, "correction": "decoupled"}
    seed: int
    mode: str  # the pipeline's mode: grpo, forward, js_low_var, alpha, js, reverse_kl
    overrides: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Sweep:
    kind: str  # "staleness" or "divergence"
    cells: list[Cell]
    x: str  # the factor on the x axis of summary plots
    panel: str | None  # the factor that splits plots into panels (None: one panel)


def staleness_sweep(etas: list[int], corrections: list[str], seeds: list[int], mode: str) -> Sweep:
    """eta (replay.max_staleness) x off-policy correction x seeds; eta = 0 is synchronous RL."""
    for c in corrections:
        if c not in CORRECTIONS:
            raise ValueError(f"correction {c!r}: choose from {', '.join(CORRECTIONS)}")
    if any(e < 0 for e in etas):
        raise ValueError(f"eta must be >= 0, got {etas}")
    cells = [
        Cell(f"eta{eta}-{corr}-seed{seed}", f"eta{eta}-{corr}", {"eta": eta, "correction": corr}, seed, mode,
             (f"replay.max_staleness={eta}", f"learner.loss.correction={corr}", f"seed={seed}"))
        for corr in corrections for eta in etas for seed in seeds
    ]
    return Sweep("staleness", cells, x="eta", panel="correction")


def divergence_sweep(modes: list[str], coeffs: list[float], seeds: list[int]) -> Sweep:
    """DPH divergence mode x coefficient x seeds; `grpo` (no divergence) takes no coefficient."""
    from dph_async.app.pipeline import MODES

    for m in modes:
        if m not in MODES:
            raise ValueError(f"mode {m!r}: choose from {', '.join(MODES)}")
    cells = []
    for mode in modes:
        for coeff in [None] if mode == "grpo" else coeffs:
            group = mode if coeff is None else f"{mode}-c{coeff:g}"
            factors = {"mode": mode, "coeff": 0.0 if coeff is None else coeff}
            extra = () if coeff is None else (f"learner.loss.coeff={coeff}",)
            cells += [Cell(f"{group}-seed{seed}", group, factors, seed, mode, (*extra, f"seed={seed}"))
                      for seed in seeds]
    return Sweep("divergence", cells, x="mode", panel=None)
