"""The structured result every reward function returns."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, get_args

# Who is to blame decides what a trainer does with a zero:
#   the response's doing (a legitimate 0 to learn from):
#     ok             scored normally (right or wrong)
#     parse_error    no answer could be extracted or parsed (missing ```sql block, \boxed{}, <answer>)
#     rejected       the sandbox refused it: not a read-only query, several statements, a forbidden
#                    operator, a size or memory limit
#     exec_error     the extracted program ran and failed (SQL syntax error, unknown column)
#     timeout        scoring overran its deadline (the worker was stopped or killed)
#   the scorer's doing (no information about the response; a trainer may mask these):
#     error          bad ground truth, missing database, a worker that died, a service out of reach
#     verifier_error the LLM verifier was down, timed out or answered neither True nor False
Status = Literal["ok", "parse_error", "rejected", "exec_error", "timeout", "error", "verifier_error"]
STATUSES: tuple[str, ...] = get_args(Status)
SCORER_FAILURES = frozenset({"error", "verifier_error"})


@dataclass(frozen=True)
class RewardResult:
    """What a reward function found.

    score: the reward used for training (may include partial credit).
    correct: exact correctness; what accuracy, Pass@k and the D_pef split count.
    format_ok: the response had the expected shape (e.g. a ```sql block, a boxed answer).
    status: "ok" unless something stopped normal scoring; see `Status` above. A failure scores 0
        (except where a verifier failure leaves the rule check's share) and says why in `detail`.
    latency_s: wall time spent scoring this response, as seen by whoever ran it.
    """

    score: float
    correct: bool
    format_ok: bool = True
    status: Status = "ok"
    latency_s: float = 0.0
    detail: str = ""

    @property
    def scorer_failed(self) -> bool:
        """True when the zero says nothing about the response (the scorer or verifier failed)."""
        return self.status in SCORER_FAILURES


def failure(status: Status, detail: str, *, format_ok: bool = False) -> RewardResult:
    """A zero-score result for a response that could not be scored normally."""
    return RewardResult(score=0.0, correct=False, format_ok=format_ok, status=status, detail=detail)


def origin(fn: Callable) -> str:
    """A reward function as a user finds it: its name and the file that defines it (a plugin's path)."""
    try:
        where = inspect.getsourcefile(fn) or fn.__module__
    except TypeError:  # a builtin or a callable object
        where = getattr(fn, "__module__", "?")
    return f"reward function {getattr(fn, '__qualname__', repr(fn))} ({where})"


def checked(value: object, fn: Callable) -> RewardResult:
    """What reward function `fn` returned, if it keeps the contract: a RewardResult whose score is a finite
    number and whose status is one of `Status`. Anything else becomes a scorer failure (status "error",
    masked by the learner) that names the function, its file and the rule it broke, so that no NaN,
    infinity or non-number ever reaches a batch."""
    if not isinstance(value, RewardResult):
        return failure("error", f"{origin(fn)} returned {type(value).__name__}; a reward function must return "
                                "a RewardResult (dph_async.rewards.result)")
    if value.status not in STATUSES:
        return failure("error", f"{origin(fn)} returned status {value.status!r}; one of {', '.join(STATUSES)}")
    score = value.score
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        return failure("error", f"{origin(fn)} returned a score of type {type(score).__name__}; a score is a "
                                "finite float")
    if not math.isfinite(score):
        return failure("error", f"{origin(fn)} returned a non-finite score ({float(score)}); a score is a "
                                "finite float")
    return value if type(score) is float else replace(value, score=float(score))
