"""The key figures of a finished run, as `dph-async status` shows them: read from the summary.json
that `dph-async run` writes last (so its presence says the run finished), and from an RL run's
result.json. Light: no torch, Ray or matplotlib."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dph_async.run_stats import RLResult, read_result, result_from


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


def _scores(evals: dict[str, dict[str, dict]]) -> list[Score]:
    out = []
    for model, splits in evals.items():
        for split, r in sorted(splits.items()):
            k = max(int(x) for x in r["pass_at_k"])
            out.append(Score(model, split, r["greedy_accuracy"], k, r["pass_at_k"][str(k)], r["distinct_correct"]))
    return out


def finished_run(root: Path) -> RunOutcome | None:
    """The outcome of the run in `root`, or None while it has no summary.json (not finished)."""
    path = root / "summary.json"
    if not path.is_file():
        return None
    summary = json.loads(path.read_text())
    return RunOutcome(root, path.stat().st_mtime, float(summary["wall_seconds"]), summary["stage_seconds"],
                      [RLOutcome.of(name, result_from(r)) for name, r in summary["rl"].items()],
                      _scores(summary.get("eval", {})))


def finished_rl(rl_dir: Path) -> RLOutcome | None:
    """The outcome of the RL run in `rl_dir` (rl/<mode>), or None while it has no result.json."""
    return RLOutcome.of(rl_dir.name, read_result(rl_dir)) if (rl_dir / "result.json").is_file() else None
