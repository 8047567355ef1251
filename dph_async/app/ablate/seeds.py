"""A sweep's raw results as data: seeds.csv, one row per finished cell (one seed of one group).

Small enough to commit beside the docs (a few KB for 40 cells), and everything a table of means,
standard errors and paired tests needs: every figure in docs/ablations.md that comes from a sweep can
be re-derived from these rows (`dph-async ablate confirm` reads them). Columns:

    cell, group, mode, seed, coeff, share      what ran (the sweep's cell)
    commit, date, load                          the code and the machine's 1-minute load when it finished
    reward, wall_s, samples                     final training reward, wall seconds, fresh samples
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

IDENTITY = ("cell", "group", "mode", "seed", "coeff", "share")
PROVENANCE = ("commit", "date", "load")
RUN = ("reward", "wall_s", "samples")


@dataclass(frozen=True)
class SeedRow:
    """One cell's final figures, as read back from seeds.csv."""

    cell: str
    group: str
    mode: str
    seed: int
    coeff: float
    share: float
    commit: str
    date: str
    load: float | None
    metrics: dict[str, float]  # reward, wall_s, samples and the split columns


def split_columns(splits: list[str], k_max: int) -> list[str]:
    return [f"{s}/{m}" for s in splits for m in ("greedy", "pass@1", f"pass@{k_max}", "distinct")]


BASE = "pi_0"


def write_seeds(path: Path, cells: list[CellResult], splits: list[str], k_max: int, base_seed: int) -> None:
    """seeds.csv: pi_0's row (its evaluation is every cell's version 0), then the finished cells in the
    sweep's order."""
    columns = [*IDENTITY, *PROVENANCE, *RUN, *split_columns(splits, k_max)]
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(columns)
        base = {}
        for split, res in cells[0].evals[0].splits.items():
            base.update(split_metrics(split, res, None))
        out.writerow([BASE, BASE, "base", base_seed, 0.0, 0.0, "", "", "", "", "", "",
                      *(_number(base.get(k)) for k in split_columns(splits, k_max))])
        for c in cells:
            m = cell_metrics(c)
            prov = c.provenance
            load = (prov.get("machine") or {}).get("load_avg") or [None]
            out.writerow([c.cell.key, c.cell.group, c.cell.mode, c.cell.seed, c.cell.factors.get("coeff", 0.0),
                          c.cell.factors.get("share", 0.0), prov.get("commit") or "", prov.get("date") or "",
                          "" if load[0] is None else f"{load[0]:.2f}",
                          *(_number(m.get(k)) for k in (*RUN, *columns[len(IDENTITY) + len(PROVENANCE) + len(RUN):]))])


def _number(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else repr(float(x))


def read_seeds(path: Path) -> list[SeedRow]:
    """The rows of a seeds.csv; a missing column or a value that is not a number is named."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in (*IDENTITY, *PROVENANCE) if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no column {', '.join(missing)} (not a sweep's seeds.csv)")
        rows = []
        for line, r in enumerate(reader, start=2):
            try:
                metrics = {k: float(v) for k, v in r.items() if k not in (*IDENTITY, *PROVENANCE) and v}
                rows.append(SeedRow(r["cell"], r["group"], r["mode"], int(r["seed"]), float(r["coeff"]),
                                    float(r["share"]), r["commit"], r["date"],
                                    float(r["load"]) if r["load"] else None, metrics))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}, line {line}: {e}") from None
    return rows
