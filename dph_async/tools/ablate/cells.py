"""The cells of a sweep: one RL run each, named by its factors and seed.

A cell is a set of dotted config overrides on top of the sweep's base config. Cells that differ only
in their seed form a group; the summary averages over a group. Every cell trains from the same base
model pi_0 (prepared once for the sweep), so the seed changes only the RL run: sampling, prompt order,
learner initialisation of its random state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import get_args

from dph_async.config.loss import Correction
from dph_async.pipeline.specs import RunSpec
from dph_async.samplers import SAMPLERS

CORRECTIONS = get_args(Correction)


@dataclass(frozen=True)
class Cell:
    key: str  # directory name under rl/
    group: str  # the cell without its seed
    factors: dict[str, str | int | float]  # e.g. {"eta": 4, "correction": "decoupled"}
    seed: int
    mode: str  # the run spec (dph_async/pipeline/specs.py): objective, coefficient, prompts
    overrides: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Sweep:
    kind: str  # "staleness", "divergence" or "samplers"
    cells: list[Cell]
    x: str  # the factor on the x axis of summary plots
    panel: str | None  # the factor that splits plots into panels (None: one panel)


def staleness_sweep(etas: list[int | str], corrections: list[str], seeds: list[int], mode: str) -> Sweep:
    """eta (replay.max_staleness: an int, or auto) x off-policy correction x seeds; eta = 0 is
    synchronous RL. Seed-major: the cells a paired comparison takes (one seed's etas and corrections)
    run side by side in time, so a drift of the machine's speed over hours does not enter a paired
    throughput ratio, and a sweep stopped early holds whole grids on its first seeds."""
    for c in corrections:
        if c not in CORRECTIONS:
            raise ValueError(f"correction {c!r}: choose from {', '.join(CORRECTIONS)}")
    if any(e != "auto" and (not isinstance(e, int) or e < 0) for e in etas):
        raise ValueError(f"eta must be an integer >= 0 or auto, got {etas}")
    cells = [
        Cell(f"eta{eta}-{corr}-seed{seed}", f"eta{eta}-{corr}", {"eta": eta, "correction": corr}, seed, mode,
             (f"replay.max_staleness={eta}", f"learner.loss.correction={corr}", f"seed={seed}"))
        for seed in seeds for corr in corrections for eta in etas
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
            cells += [Cell(f"{v.slug}-seed{seed}", v.name, _mode_factors(v), seed, v.name, (f"seed={seed}",))
                      for seed in seeds]
    return Sweep("divergence", cells, x="mode", panel=None)


def _mode_factors(spec: RunSpec) -> dict[str, str | int | float]:
    return {"mode": spec.objective if spec.prompts == "auto" else f"{spec.objective}@{spec.prompts}",
            "coeff": spec.effective_coeff}


def share_ratio(share: float) -> float:
    """replay.reference_ratio (reference samples per fresh sample) for a share of the batch."""
    return share / (1.0 - share)


def ladder(spec: RunSpec, multipliers: list[float]) -> list[RunSpec]:
    """The spec at each multiple of its objective's reference coefficient (6 significant digits, so
    that 0.2 x 3 is 0.6); a spec with a coefficient of its own, or an objective without one, as given."""
    objective = spec.objective_class()
    if spec.coeff is not None or not objective.has_divergence():
        return [spec]
    return [replace(spec, coeff=float(f"{objective.default_coeff * m:.6g}")) for m in multipliers]


def frontier_sweep(specs: list[str], multipliers: list[float], seeds: list[int], base_ratio: float,
                   shares: Sequence[float] = (), share_specs: Sequence[str] = ()) -> Sweep:
    """Each run spec over a ladder of coefficients (multiples of its reference one) x seeds, at the
    base config's reference share; plus each of `share_specs` at every share of the batch in `shares`
    (replay.reference_ratio = share / (1 - share)). Factor `share`: the reference samples' share of a
    batch (0 for an objective without a reference pool). Seed-major: a sweep stopped early holds whole
    frontiers on its first seeds."""
    if any(not 0 < s < 1 for s in shares):
        raise ValueError(f"a share of the batch must lie in (0, 1), got {list(shares)}")
    if any(m <= 0 for m in multipliers):
        raise ValueError(f"ladder multipliers must be > 0, got {multipliers}")
    base_share = round(base_ratio / (1.0 + base_ratio), 3)
    runs: list[tuple[str, str, RunSpec, dict, tuple[str, ...]]] = []  # (key stem, group, spec, factors, overrides)
    for v in (v for text in specs for v in ladder(RunSpec.parse(text), multipliers)):
        runs.append((v.slug, v.name, v, {**_mode_factors(v), "share": base_share if v.uses_pool else 0.0}, ()))
    for text in share_specs:
        spec = RunSpec.parse(text)
        if not spec.uses_pool:
            raise ValueError(f"{text}: a share of the batch applies to objectives with a reference pool")
        for share in shares:
            tag = f"share{100 * share:g}"
            runs.append((f"{spec.slug}-{tag}", f"{spec.name} {tag}", spec, {**_mode_factors(spec), "share": share},
                         (f"replay.reference_ratio={share_ratio(share):.6g}",)))
    cells = [Cell(f"{stem}-seed{seed}", group, factors, seed, spec.name, (f"seed={seed}", *extra))
             for seed in seeds for stem, group, spec, factors, extra in runs]
    return Sweep("frontier", cells, x="coeff", panel=None)


def samplers_sweep(samplers: list[str], seeds: list[int], mode: str) -> Sweep:
    """actors.sampler x seeds for one objective (the preset's; online DPO with the `dpo` preset)."""
    for s in samplers:
        if s not in SAMPLERS:
            raise ValueError(f"sampler {s!r}: choose from {', '.join(SAMPLERS)}")
    cells = [Cell(f"{s}-seed{seed}", s, {"sampler": s}, seed, mode, (f"actors.sampler={s}", f"seed={seed}"))
             for s in samplers for seed in seeds]
    return Sweep("samplers", cells, x="sampler", panel=None)
