"""A sweep's raw results as data: seeds.csv, one row per finished cell (one seed of one group).

Small enough to commit beside the docs (a few KB for 40 cells), and everything a table of means,
standard errors and paired tests needs: every figure in docs/ablations.md that comes from a sweep can
be re-derived from these rows (`dph-async ablate confirm` reads them). Columns:

    cell, group, mode, seed, coeff, share       what ran (the sweep's cell)
    task, pg_share, steps, base                 the sweep's base config: its task (task.name, or
                                                `data:` and the data file's name),
                                                learner.loss.reference_pg_share, steps, and a
                                                fingerprint of pi_0's files (`fingerprint`)
    ood_share                                   task.ood_warm_share (files written before it was
                                                recorded lack the column: read as 1)
    mini_batches                                learner.mini_batches (absent from older files: read
                                                as 1, the default they ran with)
    commit, date, load, resumed                 the code, when it finished, the machine's 1-minute
                                                load then, whether it resumed after an interruption
    reward, wall_s, samples                     final training reward, wall seconds, fresh samples
    staleness_mean, staleness_max               of the groups the learner consumed (the replay's
                                                histogram: versions between a group's oldest token
                                                and the version that trained on it)
    clip_frac, mismatch_kl_k1                   the learner's clipped-token share and behaviour-to-
                                                learner KL, means over the steps (newer files)
    <split>/greedy, <split>/pass@1, <split>/pass@<k>, <split>/distinct    the final model, per test split
    <split>/pass@1_se                           the s.d. of its per-prompt Pass@1 / sqrt(prompts): one
                                                evaluation's own error (newer files)

The first row is pi_0 (cell and group `pi_0`, mode `base`, the base config's seed): the base model
every cell starts from, its split columns only. A cell finished before cells recorded their
provenance has empty commit, date and load.
"""

from __future__ import annotations

import csv
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

from dph_async.config import RunConfig
from dph_async.tools.ablate.results import CellResult, cell_metrics, split_metrics

_Reader = type(csv.reader([]))  # csv's reader: its records and the line it has read to
IDENTITY = ("cell", "group", "mode", "seed", "coeff", "share")
CONFIG = ("task", "pg_share", "steps", "base")
PROVENANCE = ("commit", "date", "load", "resumed")
RUN = ("reward", "wall_s", "samples", "staleness_mean", "staleness_max", "clip_frac", "mismatch_kl_k1")
TEXT = (*IDENTITY, *CONFIG, *PROVENANCE)  # the columns every file has that are not figures
OPTIONAL = ("ood_share", "mini_batches")  # columns that are not figures, absent from files written before them
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
    base: str
    commit: str
    date: str
    load: float | None
    resumed: bool
    metrics: dict[str, float]  # reward, wall_s, samples and the split columns
    ood_share: float = 1.0
    mini_batches: int = 1


def repeated_seed(rows: list[SeedRow]) -> tuple[str, int] | None:
    """The first (group, seed) that two rows share: one seed's cell can be counted only once."""
    seen: set[tuple[str, int]] = set()
    for r in rows:
        if (r.group, r.seed) in seen:
            return r.group, r.seed
        seen.add((r.group, r.seed))
    return None


def split_columns(splits: list[str], k_max: int) -> list[str]:
    return [f"{s}/{m}" for s in splits for m in ("greedy", "pass@1", f"pass@{k_max}", "distinct", "pass@1_se")]


def task_name(cfg: RunConfig) -> str:
    """The embedded task's name, or `data:` and the data file's name (never an embedded task's name)."""
    return cfg.task.name if cfg.task.data is None else f"data:{Path(cfg.task.data).name}"


def fingerprint(model_dir: Path) -> str:
    """12 hex digits of SHA-256 over the names, sizes and first and last MiB of the model's files: two
    sweeps that start from the same pi_0 share it, whatever their evaluations (cheap on a large model)."""
    h = hashlib.sha256()
    for f in sorted(p for p in model_dir.iterdir() if p.is_file()):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as data:
            h.update(data.read(2**20))
            data.seek(max(0, size - 2**20))
            h.update(data.read(2**20))
    return h.hexdigest()[:12]


def write_seeds(path: Path, cells: list[CellResult], splits: list[str], k_max: int, cfg: RunConfig,
                base_model: Path) -> None:
    """seeds.csv: pi_0's row (its evaluation is every cell's version 0), then the finished cells in the
    sweep's order. `cfg`: the sweep's base config; `base_model`: pi_0's directory."""
    figures = [*RUN, *split_columns(splits, k_max)]
    config = [task_name(cfg), cfg.learner.loss.reference_pg_share, cfg.learner.steps, fingerprint(base_model)]
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow([*TEXT, *OPTIONAL, *figures])
        base = {}
        for split, res in cells[0].evals[0].splits.items():
            base.update(split_metrics(split, res, None))
        share = (repr(cfg.task.ood_warm_share), cfg.learner.mini_batches)
        out.writerow([BASE, BASE, "base", cfg.seed, 0.0, 0.0, *config, "", "", "", "", *share,
                      *(_number(base.get(k)) for k in figures)])
        for c in cells:
            m, prov = {**cell_metrics(c), **staleness(c.staleness_hist)}, c.provenance
            load = (prov.get("machine") or {}).get("load_avg") or [None]
            out.writerow([c.cell.key, c.cell.group, c.cell.mode, c.cell.seed, c.cell.factors.get("coeff", 0.0),
                          c.cell.factors.get("share", 0.0), *config, prov.get("commit") or "",
                          prov.get("date") or "", "" if load[0] is None else f"{load[0]:.2f}", int(c.resumed),
                          *share, *(_number(m.get(k)) for k in figures)])


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
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"{column}: {text!r} is not a number") from None
    if not math.isfinite(x):
        raise ValueError(f"{column}: {text!r} is not a finite number")
    return x


def _in_range(column: str, x: float) -> float:
    """Shares (Pass@k, greedy accuracy, the clipped share) lie in [0, 1]; seconds and counts are not negative."""
    name = column.rsplit("/", 1)[-1]
    if (name.startswith("pass@") or name in ("greedy", "clip_frac")) and not 0.0 <= x <= 1.0:
        raise ValueError(f"{column}: {x!r} is not a share in [0, 1]")
    if name in ("wall_s", "samples", "distinct", "staleness_mean", "staleness_max") and x < 0:
        raise ValueError(f"{column}: {x!r} is negative")
    return x


def _share(text: str) -> float:
    x = _finite(text, "ood_share")
    if not 0.0 < x <= 1.0:
        raise ValueError(f"ood_share: {x!r} is not a share in (0, 1]")
    return x


def _whole(text: str, column: str) -> int:
    """A count as the writer writes it: decimal digits, no sign, space or leading zero."""
    if not re.fullmatch(r"0|[1-9][0-9]{0,8}", text):
        raise ValueError(f"{column}: {text[:40]!r} is not a whole number")
    return int(text)


def _mini_batches(text: str | None) -> int:
    """learner.mini_batches; a file without the column ran at the default, 1."""
    if text is None:
        return 1
    n = _whole(text, "mini_batches")
    if n < 1:
        raise ValueError(f"mini_batches: {n} is not at least 1")
    return n


def read_seeds(path: Path) -> list[SeedRow]:
    """The rows of a seeds.csv; a missing or repeated column, a row of another width, or a value that
    is not a finite number in its range, is named with the file and line."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            return _rows(path, csv.reader(f))
    except (csv.Error, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a CSV file of UTF-8 text ({e})") from None


def _rows(path: Path, reader: _Reader) -> list[SeedRow]:
    header = next(reader, [])
    twice = sorted({c for c in header if header.count(c) > 1})
    if twice:
        raise ValueError(f"{path}: column {', '.join(twice)} given twice")
    missing = [c for c in TEXT if c not in header]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(missing)} (not a sweep's seeds.csv)")
    rows = []
    for values in reader:
        line = reader.line_num  # of the record's last line: a quoted field may hold line breaks
        try:
            if len(values) != len(header):
                raise ValueError(f"{len(values)} fields, the header has {len(header)}")
            r = dict(zip(header, values, strict=True))
            metrics = {k: _in_range(k, _finite(v, k)) for k, v in r.items() if k not in (*TEXT, *OPTIONAL) and v}
            rows.append(SeedRow(r["cell"], r["group"], r["mode"], _whole(r["seed"], "seed"),
                                _finite(r["coeff"], "coeff"), _finite(r["share"], "share"), r["task"],
                                _finite(r["pg_share"], "pg_share"),
                                _whole(r["steps"], "steps"), r["base"], r["commit"], r["date"],
                                _finite(r["load"], "load") if r["load"] else None, r["resumed"] == "1", metrics,
                                _share(r["ood_share"]) if "ood_share" in r else 1.0,
                                _mini_batches(r.get("mini_batches"))))
        except ValueError as e:
            raise ValueError(f"{path}, line {line}: {e}") from None
    return rows
