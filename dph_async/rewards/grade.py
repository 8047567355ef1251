"""The 'grade' reward, for training a rubric reward model (RRM) to grade answers out of 10.

Registered data_source: "grade". ground_truth: the reference grade normalised to [0, 1].
The response's grade is the number after its last "Total Score" ("Total Score: 7/10" -> 7), clipped to
[0, 10] and divided by 10; score = max(0, 1 - |grade - ground_truth|)^2, correct when they are equal.

The original reward clips only from above, so a grade of -5 against a reference of 1 still earns
(1 - 1.5)^2 = 0.25: the reward stops falling and rises again below 0. Clipping at both ends fixes that.
"""

from __future__ import annotations

import re
from typing import Any

from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult, failure

_TOTAL = re.compile(r"total score", re.IGNORECASE)
# After "Total Score": decoration such as ": **", "[", "|", quotes, then the number.
_NUMBER = re.compile(r"[\s:*\[\]|'\"=]*([-+]?\d+(?:\.\d+)?)")
MAX_GRADE = 10.0


def parse_total_score(text: str) -> float | None:
    matches = list(_TOTAL.finditer(text))
    if not matches:
        return None
    number = _NUMBER.match(text, matches[-1].end())
    return float(number.group(1)) if number else None


def grade_score(grade: float, reference: float) -> float:
    """(1 - |clip(grade, 0, 10)/10 - reference|)^2, never below 0 and never rising past the ends."""
    normalised = min(max(grade, 0.0), MAX_GRADE) / MAX_GRADE
    return max(0.0, 1.0 - abs(normalised - reference)) ** 2


@register("grade")
def grade_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    reference = float(ground_truth)
    if not 0.0 <= reference <= 1.0:  # also refuses NaN
        raise ValueError(f"grade ground_truth must be in [0, 1], got {ground_truth!r}")
    grade = parse_total_score(response)
    if grade is None:
        return failure("parse_error", "no 'Total Score: <number>' in the response")
    score = grade_score(grade, reference)
    return RewardResult(score=score, correct=score == 1.0, detail=f"grade {grade:g}/10")
