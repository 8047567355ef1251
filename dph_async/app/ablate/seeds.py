"""A sweep's raw results as data: seeds.csv, one row per finished cell (one seed of one group).

Small enough to commit beside the docs (a few KB for 40 cells), and everything a table of means,
standard errors and paired tests needs: every figure in docs/ablations.md that comes from a sweep can
be re-derived from these rows (`dph-async ablate confirm` reads them). Columns:

    cell, group, mode, seed, coeff, share       what ran (the sweep's cell)
    task, pg_share, steps                       the sweep's base config: its task (task.name, or the
                                                data file), learner.loss.reference_pg_share, steps
    commit, date, load, resumed                 the code, when it finished, the machine's 1-minute
                                                load then, whether it resumed after an interruption
    reward, wall_s, samples                     final training reward, wall seconds, fresh samples
    staleness_mean, staleness_max               of the groups the learner consumed (the replay's
                                                histogram: versions between a group's oldest token
                                                and the version that trained on it)
    <split>/greedy, <split>/pass@1, <split>/pass@<k>, <split>/distinct    the final model, per test split

The first row is pi_0 (cell and group `pi_0`, mode `base`, the base config's seed): the base model
every cell starts from, its split columns only. A cell finished before cells recorded their
provenance has empty commit, date and load.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

from dph_async.app.ablate.results import CellResult, cell_metrics, split_metrics
from dph_async.config import RunConfig

IDENTITY = ("cell", "group", "mode", "seed", "coeff", "share")
CONFIG = ("task", "pg_share", "steps")
PROVENANCE = ("commit", "date", "load", "resumed")
RUN = ("reward", "wall_s", "samples", "staleness_mean", "staleness_max")
TEXT = (*IDENTITY, *CONFIG, *PROVENANCE)  # the columns that are not figures
BASE = "pi_0"


@dataclass(frozen=True)
class SeedRow:
    """One cell's final figures, as read back from seeds.csv."""

    cell: str
    group: str
    mode: str
    seed: int
    coeff: float
    share: float
    task: str
    pg_share: float
    steps: int
    commit: str
    date: str
    load: float | None
    resumed: bool
    metrics: dict[str, float]  # reward, wall_s, samples and the split columns


def split_columns(splits: list[str], k_max: int) -> list[str]:
    return [f"{s}/{m}" for s in splits for m in ("greedy", "pass@1", f"pass@{k_max}", "distinct")]


def task_name(cfg: RunConfig) -> str:
    return cfg.task.name if cfg.task.data is None else Path(cfg.task.data).name


def write_seeds(path: Path, cells: list[CellResult], splits: list[str], k_max: int, cfg: RunConfig) -> None:
    """seeds.csv: pi_0's row (its evaluation is every cell's version 0), then the finished cells in the
    sweep's order. `cfg`: the sweep's base config."""
    figures = [*RUN, *split_columns(splits, k_max)]
    config = [task_name(cfg), cfg.learner.loss.reference_pg_share, cfg.learner.steps]
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*TEXT, *figures])
        base = {}
        for split, res in cells[0].evals[0].splits.items():
            base.update(split_metrics(split, res, None))
        out.writerow([BASE, BASE, "base", cfg.seed, 0.0, 0.0, *config, "", "", "", "",
                      *(_number(base.get(k)) for k in figures)])
        for c in cells:
            m, prov = {**cell_metrics(c), **staleness(c.staleness_hist)}, c.provenance
            load = (prov.get("machine") or {}).get("load_avg") or [None]
            out.writerow([c.cell.key, c.cell.group, c.cell.mode, c.cell.seed, c.cell.factors.get("coeff", 0.0),
                          c.cell.factors.get("share", 0.0), *config, prov.get("commit") or "",
                          prov.get("date") or "", "" if load[0] is None else f"{load[0]:.2f}", int(c.resumed),
                          *(_number(m.get(k)) for k in figures)])


def staleness(hist: dict[int, int]) -> dict[str, float]:
    """Mean and largest staleness of the consumed groups; none without a histogram."""
    total = sum(hist.values())
    if not total:
        return {}
    return {"staleness_mean": sum(s * n for s, n in hist.items()) / total,
            "staleness_max": float(max(s for s, n in hist.items() if n))}


def _number(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else repr(float(x))


def _finite(text: str, column: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise ValueError(f"{column}: {text!r} is not a finite number")
    return x


def read_seeds(path: Path) -> list[SeedRow]:
    """The rows of a seeds.csv; a missing column, or a value that is not a finite number, is named."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in TEXT if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} (not a sweep's seeds.csv)")
        rows = []
        for line, r in enumerate(reader, start=2):
            try:
                metrics = {k: _finite(v, k) for k, v in r.items() if k not in TEXT and v}
                rows.append(SeedRow(r["cell"], r["group"], r["mode"], int(r["seed"]), _finite(r["coeff"], "coeff"),
                                    _finite(r["share"], "share"), r["task"], _finite(r["pg_share"], "pg_share"),
                                    int(r["steps"]), r["commit"], r["date"],
                                    _finite(r["load"], "load") if r["load"] else None, r["resumed"] == "1",
                                    metrics))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}, line {line}: {e}") from None
    return rows
