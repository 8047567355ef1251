"""The cells of a sweep: one RL run each, named by its factors and seed.

A cell is a set of dotted config overrides on top of the sweep's base config. Cells that differ only
in their seed form a group; the summary averages over a group. Every cell trains from the same base
model pi_0 (prepared once for the sweep), so the seed changes only the RL run: sampling, prompt order,
learner initialisation of its random state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import get_args

from dph_async.app.specs import RunSpec
from dph_async.config.loss import Correction
from dph_async.samplers import SAMPLERS

CORRECTIONS = get_args(Correction)


@dataclass(frozen=True)
class Cell:
    key: str  # directory name under rl/
    group: str  # the cell without its seed
    factors: dict[str, str | int | float]  # e.g. {"eta": 4, "correction": "decoupled"}
    seed: int
    mode: str  # the run spec (dph_async/app/specs.py): objective, coefficient, prompts
    overrides: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Sweep:
    kind: str  # "staleness", "divergence" or "samplers"
    cells: list[Cell]
    x: str  # the factor on the x axis of summary plots
    panel: str | None  # the factor that splits plots into panels (None: one panel)


def staleness_sweep(etas: list[int | str], corrections: list[str], seeds: list[int], mode: str) -> Sweep:
    """eta (replay.max_staleness: an int, or auto) x off-policy correction x seeds; eta = 0 is
    synchronous RL."""
    for c in corrections:
        if c not in CORRECTIONS:
            raise ValueError(f"correction {c!r}: choose from {', '.join(CORRECTIONS)}")
    if any(e != "auto" and (not isinstance(e, int) or e < 0) for e in etas):
        raise ValueError(f"eta must be an integer >= 0 or auto, got {etas}")
    cells = [
        Cell(f"eta{eta}-{corr}-seed{seed}", f"eta{eta}-{corr}", {"eta": eta, "correction": corr}, seed, mode,
             (f"replay.max_staleness={eta}", f"learner.loss.correction={corr}", f"seed={seed}"))
        for corr in corrections for eta in etas for seed in seeds
    ]
    return Sweep("staleness", cells, x="eta", panel="correction")


def divergence_sweep(specs: list[str], coeffs: list[float] | None, seeds: list[int]) -> Sweep:
    """Run specs x coefficients x seeds. A spec's own coefficient (forward:0.05) is used as given;
    otherwise every value of `coeffs`, or, without them, the objective's reference values
    (`sweep_coeffs`; an objective without a divergence takes none)."""
    cells = []
    for text in specs:
        spec = RunSpec.parse(text)
        objective = spec.objective_class()
        values = coeffs or objective.sweep_coeffs
        if spec.coeff is None and objective.has_divergence() and values:
            variants = [replace(spec, coeff=c) for c in values]
        else:
            variants = [spec]
        for v in variants:
            factors = {"mode": v.objective if v.prompts == "auto" else f"{v.objective}@{v.prompts}",
                       "coeff": v.effective_coeff}
            cells += [Cell(f"{v.slug}-seed{seed}", v.name, factors, seed, v.name, (f"seed={seed}",))
                      for seed in seeds]
    return Sweep("divergence", cells, x="mode", panel=None)




def samplers_sweep(samplers: list[str], seeds: list[int], mode: str) -> Sweep:
    """actors.sampler x seeds for one objective (the preset's; online DPO with the `dpo` preset)."""
    for s in samplers:
        if s not in SAMPLERS:
            raise ValueError(f"sampler {s!r}: choose from {', '.join(SAMPLERS)}")
    cells = [Cell(f"{s}-seed{seed}", s, {"sampler": s}, seed, mode, (f"actors.sampler={s}", f"seed={seed}"))
             for s in samplers for seed in seeds]
    return Sweep("samplers", cells, x="sampler", panel=None)
