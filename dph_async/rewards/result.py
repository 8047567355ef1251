"""The structured result every reward function returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "timeout", "error", "verifier_error", "parse_error", "rejected"]


@dataclass(frozen=True)
class RewardResult:
    """What a reward function found.

    score: the reward used for training (may include partial credit).
    correct: exact correctness; what accuracy, Pass@k and the D_pef split count.
    format_ok: the response had the expected shape (e.g. a ```sql block, a boxed answer).
    status: "ok" unless scoring itself failed; a failure scores 0 and says why here.
    """

    score: float
    correct: bool
    format_ok: bool = True
    status: Status = "ok"
    latency_s: float = 0.0
    detail: str = ""
