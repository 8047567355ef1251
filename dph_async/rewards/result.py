"""The structured result every reward function returns."""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
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


MAX_DETAIL_CHARS = 1000  # a reason, not a log: longer ones are cut


def _as_bool(x: object) -> bool | None:
    """`x` if it is a bool: Python's, or numpy's (what a numpy comparison returns; one value, one meaning,
    so it is taken as the bool it is). Anything else, 0 and 1 included, is None: a number where a bool
    belongs is usually a score in the wrong field."""
    if isinstance(x, bool):
        return x
    if type(x).__module__ == "numpy" and type(x).__name__ in ("bool", "bool_"):  # np.bool_ (numpy 1 and 2)
        return bool(x)  # type: ignore[arg-type]
    return None


def _broken_rule(value: RewardResult) -> str | None:
    """What in `value` breaks the contract, worded after "returned", or None when nothing does."""
    if value.status not in STATUSES:
        return f"status {value.status!r}; one of {', '.join(STATUSES)}"
    score = value.score
    if isinstance(score, bool) or not isinstance(score, numbers.Real):
        return f"a score of type {type(score).__name__}; a score is a finite float"
    if not math.isfinite(score):
        return f"a non-finite score ({float(score)}); a score is a finite float"
    for name in ("correct", "format_ok"):
        if _as_bool(flag := getattr(value, name)) is None:
            return f"{name} of type {type(flag).__name__}; {name} is a bool (True or False)"
    if not isinstance(value.detail, str):
        return f"a detail of type {type(value.detail).__name__}; detail is a str"
    return None


def checked(value: object, fn: Callable) -> RewardResult:
    """What reward function `fn` returned, if it keeps the contract: a RewardResult whose score is a finite
    number, whose status is one of `Status`, whose correct and format_ok are bools (numpy's taken as
    Python's) and whose detail is a str (cut at MAX_DETAIL_CHARS). Anything else becomes a scorer failure
    (status "error", masked by the learner) that names the function, its file and the rule it broke, so
    that no NaN, non-bool or unencodable value ever reaches a batch or a worker's reply. The result is
    built anew from plain values: a subclass or a numpy scalar never travels on."""
    if not isinstance(value, RewardResult):
        return failure("error", f"{origin(fn)} returned {type(value).__name__}; a reward function must return "
                                "a RewardResult (dph_async.rewards.result)")
    if (rule := _broken_rule(value)) is not None:
        return failure("error", f"{origin(fn)} returned {rule}")
    detail = str.__str__(value.detail)
    return RewardResult(score=float(value.score), correct=bool(_as_bool(value.correct)),
                        format_ok=bool(_as_bool(value.format_ok)), status=value.status,
                        detail=detail if len(detail) <= MAX_DETAIL_CHARS else detail[:MAX_DETAIL_CHARS - 1] + "…")
