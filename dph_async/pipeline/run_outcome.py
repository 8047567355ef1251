"""The key figures of a finished run, as `dph-async status` shows them: read from the summary.json
that `dph-async run` writes last (so its presence says the run finished), and from an RL run's
result.json. Light: no torch, Ray or matplotlib.

Both files may be a stranger's: read as regular files within a size (dph_async/safe_files.py) and
through their types, so a damaged one is a RunFileError naming the file and what is wrong in it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import msgspec

from dph_async.errors import UserError
from dph_async.run_stats import RLResult
from dph_async.safe_files import read_regular

MAX_FILE_BYTES = 64 << 20  # a summary of many modes, with their actors' statistics, is well under this
T = TypeVar("T")


class RunFileError(UserError):
    """A summary.json or result.json that cannot be read as one; the message names it and what is wrong."""


@dataclass(frozen=True)
class RLOutcome:
    """One RL run (a mode of --compare) as its result.json records it."""

    name: str
    steps: int
    wall_s: float
    dropped: int  # groups the replay dropped as too stale
    actor_restarts: int

    @classmethod
    def of(cls, name: str, result: RLResult) -> RLOutcome:
        return cls(name, result.learner.steps, result.wall_seconds, sum(result.replay.drops.values()),
                   result.actor_restarts)


@dataclass(frozen=True)
class Score:
    """One model on one test set: greedy accuracy and Pass@k at the largest k evaluated (fractions)."""

    model: str
    test_set: str
    greedy: float
    k: int
    pass_at_k: float
    distinct: float


@dataclass(frozen=True)
class RunOutcome:
    root: Path
    finished_at: float  # summary.json's modification time (seconds since the epoch)
    wall_s: float
    stages: dict[str, float]  # stage -> seconds
    runs: list[RLOutcome]
    scores: list[Score]


class _Split(msgspec.Struct):
    greedy_accuracy: float
    pass_at_k: dict[int, float]
    distinct_correct: float


class _Summary(msgspec.Struct):
    """What status reads of summary.json (report.py writes more)."""

    wall_seconds: float
    stage_seconds: dict[str, float]
    rl: dict[str, RLResult]
    eval: dict[str, dict[str, _Split]] = {}


def _scores(evals: dict[str, dict[str, _Split]]) -> list[Score]:
    out = []
    for model, splits in evals.items():
        for split, r in sorted(splits.items()):
            if r.pass_at_k:  # a split evaluated without Pass@k has no column to fill
                k = max(r.pass_at_k)
                out.append(Score(model, split, r.greedy_accuracy, k, r.pass_at_k[k], r.distinct_correct))
    return out


def _read(path: Path, kind: type[T]) -> tuple[T, float] | None:
    """`path` decoded as `kind`, with its modification time; None when there is no such file."""
    try:
        data = read_regular(path, MAX_FILE_BYTES)
        mtime = os.lstat(path).st_mtime
    except FileNotFoundError:
        return None
    except OSError as e:
        raise RunFileError(f"{path}: {e.strerror or e}") from None
    try:  # json, not msgspec's decoder: report.py's json.dumps may have written a NaN
        return msgspec.convert(json.loads(data), kind, strict=False), mtime
    except (ValueError, RecursionError) as e:  # not JSON, not UTF-8, or msgspec's ValidationError
        raise RunFileError(f"{path}: {' '.join(str(e).split())[:200] or type(e).__name__}") from None


def finished_run(root: Path) -> RunOutcome | None:
    """The outcome of the run in `root`, or None while it has no summary.json (not finished)."""
    found = _read(root / "summary.json", _Summary)
    if found is None:
        return None
    summary, mtime = found
    if not math.isfinite(summary.wall_seconds):
        raise RunFileError(f"{root / 'summary.json'}: wall_seconds is {summary.wall_seconds}")
    return RunOutcome(root, mtime, summary.wall_seconds, summary.stage_seconds,
                      [RLOutcome.of(name, r) for name, r in summary.rl.items()], _scores(summary.eval))


def finished_rl(rl_dir: Path) -> RLOutcome | None:
    """The outcome of the RL run in `rl_dir` (rl/<mode>), or None while it has no result.json."""
    found = _read(rl_dir / "result.json", RLResult)
    return None if found is None else RLOutcome.of(rl_dir.name, found[0])
