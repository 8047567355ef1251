"""What a finished cell measured, and its group's mean and standard error over seeds.

Per cell, from its run directory: the learner's per-step curve (training reward against learner
version, fresh samples consumed and wall time since the first training step began), evaluations
along the run (greedy accuracy and Pass@k per test split; version 0 is the shared base model),
the staleness histogram and drops of the replay, and IS diagnostics averaged over the steps.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from dph_async.run_stats import read_result
from dph_async.runtime.evaluate import SplitResult, by_base_difficulty, load_results
from dph_async.tools.ablate.cells import Cell

# Diagnostics averaged over a run's steps: name -> metrics.jsonl key.
DIAGNOSTICS = {
    "staleness": "staleness/mean",
    "eta": "staleness/eta",  # replay.max_staleness=auto: the bound the learner set
    "ess": "policy/ess",
    "data_wait": "time/data_wait",  # the fraction of the learner's time spent waiting for data
    "clip_frac": "policy/clip_frac",
    "kept_frac": "policy/kept_frac",
    "is_weight_max": "policy/is_weight_max",
    "mismatch_kl_k1": "policy/mismatch_kl_k1",
    "mismatch_kl_k3": "policy/mismatch_kl_k3",
    "entropy": "policy/entropy",
}
# The training reward of a run: the mean over its last fifth of steps (one batch is noisy).
FINAL_SHARE = 0.2


@dataclass
class EvalPoint:
    version: int
    samples: float  # fresh samples the learner consumed up to this version
    wall: float  # seconds since the first training step began
    splits: dict[str, SplitResult]


@dataclass
class CellResult:
    cell: Cell
    version: list[int]
    samples: list[float]  # cumulative fresh samples consumed
    wall: list[float]
    reward: list[float]
    evals: list[EvalPoint]
    staleness_hist: dict[int, int]
    drops: dict[str, int]
    diagnostics: dict[str, float]
    resumed: bool
    provenance: dict = field(default_factory=dict)  # date, commit, command, machine; {} in older cells

    @property
    def final_reward(self) -> float:
        tail = self.reward[-max(1, round(len(self.reward) * FINAL_SHARE)):]
        return sum(tail) / len(tail)


def load_cell(rl_dir: Path, base_eval: dict[str, SplitResult]) -> CellResult:
    record = json.loads((rl_dir / "cell.json").read_text())
    cell = Cell(record["key"], record["group"], record["factors"], record["seed"], record["mode"],
                tuple(record["overrides"]))
    rows = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    # Wall time starts when the first training step began: process start-up is not the algorithm's.
    t0 = rows[0]["time/wall"] - rows[0]["learner/step_seconds"]
    samples, total = [], 0.0
    for r in rows:
        total += r["batch/fresh_samples"]
        samples.append(total)
    version = [int(r["learner/version"]) for r in rows]
    wall = [r["time/wall"] - t0 for r in rows]
    evals = [EvalPoint(0, 0.0, 0.0, base_eval)]
    for f in sorted((rl_dir / "eval").glob("v*.json"), key=lambda p: int(p.stem[1:])):
        v = int(f.stem[1:])
        i = version.index(v)
        evals.append(EvalPoint(v, samples[i], wall[i], load_results(f)))
    replay = read_result(rl_dir).replay
    diagnostics = {}
    for name, key in DIAGNOSTICS.items():
        values = [r[key] for r in rows if key in r]
        if values:
            diagnostics[name] = sum(values) / len(values)
    return CellResult(cell, version, samples, wall, [r["reward/mean"] for r in rows], evals,
                      replay.staleness_hist, replay.drops, diagnostics,
                      record["resumed"], record.get("provenance", {}))


@dataclass(frozen=True)
class Stat:
    mean: float
    se: float | None  # standard error of the mean; None with one seed
    n: int

    def fmt(self, scale: float = 1.0, digits: int = 3) -> str:
        m = f"{scale * self.mean:.{digits}f}"
        return m if self.se is None else f"{m} ± {scale * self.se:.{digits}f}"


def stat(values: list[float]) -> Stat:
    n = len(values)
    se = statistics.stdev(values) / math.sqrt(n) if n > 1 else None
    return Stat(statistics.fmean(values), se, n)


def split_metrics(split: str, res: SplitResult, base: SplitResult | None) -> dict[str, float]:
    """Greedy, Pass@k and distinct correct answers of one test split; with the base model's results of
    the same prompts, also per subset of prompts by what pi_0 did on them (`{split}/{subset}/...`)."""
    m = {f"{split}/greedy": res.greedy_accuracy, f"{split}/distinct": res.distinct_correct,
         **{f"{split}/pass@{k}": p for k, p in res.pass_at_k.items()}}
    if len(res.per_prompt) > 1 and res.samples:  # one evaluation's own error of its Pass@1
        shares = [p.correct / res.samples for p in res.per_prompt]
        m[f"{split}/pass@1_se"] = statistics.stdev(shares) / math.sqrt(len(shares))
    if base is not None and base.per_prompt and res.per_prompt:
        for subset, sub in by_base_difficulty(base, res).items():
            m[f"{split}/{subset}/prompts"] = float(sub.prompts)
            m[f"{split}/{subset}/distinct"] = sub.distinct_correct
            m.update({f"{split}/{subset}/pass@{k}": p for k, p in sub.pass_at_k.items()})
    return m


def cell_metrics(r: CellResult) -> dict[str, float]:
    """The figures of one cell that a summary averages."""
    base, final = r.evals[0], r.evals[-1]
    m = {"reward": r.final_reward, "wall_s": r.wall[-1], "samples": r.samples[-1],
         "dropped": float(sum(r.drops.values())), **r.diagnostics}
    for split, res in final.splits.items():
        m.update(split_metrics(split, res, base.splits.get(split)))
    return m


@dataclass
class Group:
    name: str
    factors: dict[str, str | int | float]
    cells: list[CellResult]
    metrics: dict[str, Stat]
    # metric -> seed -> the cell's value: what a comparison paired by seed takes.
    by_seed: dict[str, dict[int, float]] = field(default_factory=dict)


def summarize(cells: list[CellResult]) -> list[Group]:
    """Cells grouped over seeds (in the sweep's order), every metric as mean and standard error."""
    by_group: dict[str, list[CellResult]] = {}
    for c in cells:
        by_group.setdefault(c.cell.group, []).append(c)
    groups = []
    for name, members in by_group.items():
        per_cell = [cell_metrics(c) for c in members]
        keys = [k for k in per_cell[0] if all(k in m for m in per_cell)]
        groups.append(Group(name, members[0].cell.factors, members, {k: stat([m[k] for m in per_cell]) for k in keys},
                            {k: {c.cell.seed: m[k] for c, m in zip(members, per_cell, strict=True)} for k in keys}))
    return groups
