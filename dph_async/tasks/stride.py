"""The stride task: count in steps of a digit up to a bound; answer lengths have a long tail.

    prompt  "137-7>50="  answer "137,130,123,116,109,102,95,88,81,74,67,60,53"  (in-domain: down, terms > 50)
    prompt  "4+7<60="    answer "4,11,18,25,32,39,46,53"                         (OOD rule: up, terms < 60)

One correct answer per problem, checked exactly. A problem's number of terms T follows a power law,
P(T) proportional to T^-1.5 on [2, 100]: a quarter of the problems have two terms, the median five,
the mean 12.4, one in seventeen has 50 or more and the longest answers run to 399 characters. A
synchronous trainer waits for the longest completion of every batch; an asynchronous one does not:
the workload time-to-accuracy is measured on (docs/decisions.md, The stride task). Each term depends
only on the one before it and the prompt, so a tiny model learns the rule, and a per-character error
rate makes long answers fail more often: pi_0 leaves RL room to gain on the tail.

Every term is in [0, 999]. RL trains on the down rule; the up rule (the same skill the other way)
measures what RL keeps, as the embedded task's difference rule does. Generated from a seed.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from typing import Any

from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult

IN_DOMAIN = "stride_down"
OUT_OF_DOMAIN = "stride_up"
ALPHABET = "0123456789,+-<>="
MIN_TERMS, MAX_TERMS, EXPONENT = 2, 100, 1.5
TOP = 999  # the largest term
# The longest answer: MAX_TERMS terms of up to three digits and their commas; a prompt has at most
# ten characters ("999-1>997="). With BOS and EOS, what sampling.max_tokens and model.max_model_len hold.
MAX_ANSWER_CHARS = MAX_TERMS * 4 - 1
MAX_PROMPT_CHARS = 10
WARM_DOWN, WARM_UP = 4000, 2000  # warm-start problems of each rule
# Distinct problems a split may ask of one rule. A rule has millions, but the last of them
# take ever more draws to find (a long one is drawn with chance ~3e-8): far below, drawing stays fast.
MAX_PROBLEMS = 50_000
_ANSWER = re.compile(r"[0-9]{1,3}(?:,[0-9]{1,3})*")
_TERMS = list(range(MIN_TERMS, MAX_TERMS + 1))
_CUMULATIVE = list(itertools.accumulate(t ** -EXPONENT for t in _TERMS))


@dataclass(frozen=True)
class StrideProblem:
    start: int
    step: int  # 1-9
    bound: int  # down: every term > bound; up: every term < bound
    op: str  # "-" (down) or "+" (up)

    @property
    def prompt(self) -> str:
        return f"{self.start}{self.op}{self.step}{'>' if self.op == '-' else '<'}{self.bound}="

    @property
    def data_source(self) -> str:
        return IN_DOMAIN if self.op == "-" else OUT_OF_DOMAIN

    @property
    def out_of_domain(self) -> bool:
        return self.op == "+"

    @property
    def ground_truth(self) -> dict[str, Any]:
        return {"start": self.start, "step": self.step, "bound": self.bound, "op": self.op}

    def terms(self) -> list[int]:
        if self.op == "-":
            return list(range(self.start, self.bound, -self.step))
        return list(range(self.start, self.bound, self.step))

    def solutions(self) -> list[str]:
        """The one correct answer."""
        return [",".join(map(str, self.terms()))]

    def wrong_answer(self, rng: random.Random) -> str:
        """A well-formed wrong answer: one term too few, one too many, or one term off by one."""
        terms = self.terms()
        sign = -1 if self.op == "-" else 1
        beyond = terms[-1] + sign * self.step
        kind = rng.choice(["short", "long", "off"] if 0 <= beyond <= TOP else ["short", "off"])
        if kind == "short":
            terms = terms[:-1]
        elif kind == "long":
            terms = [*terms, beyond]
        else:
            i = rng.randrange(len(terms))
            terms[i] += 1 if terms[i] < TOP else -1
        return ",".join(map(str, terms))


def _problem(truth: Any) -> StrideProblem:
    """The problem a ground truth names, refused (ValueError) unless the task could have made it: a
    hostile or mistaken data file must cost no more than the task's own problems (at most 999 terms)."""
    try:
        start, step, bound, op = (truth[k] for k in ("start", "step", "bound", "op"))
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"stride ground_truth must hold start, step, bound and op; got {truth!r:.200}") from None
    ints = all(type(x) is int for x in (start, step, bound))
    if not (ints and 0 <= start <= TOP and 0 <= bound <= TOP and 1 <= step <= 9 and op in ("-", "+")):
        raise ValueError(f"stride ground_truth out of range (start and bound integers in 0-{TOP}, step 1-9, "
                         f"op - or +): {truth!r:.200}")
    return StrideProblem(start, step, bound, op)


def check(answer: str, truth: Any) -> tuple[bool, bool]:
    """(format_ok, correct) for an answer: comma-separated terms of one to three digits, correct when
    they are exactly the problem's terms."""
    problem = _problem(truth)
    if not _ANSWER.fullmatch(answer):
        return False, False
    return True, answer == problem.solutions()[0]


# A regular expression and a range over a string of at most max_tokens characters: scored inline.
@register(IN_DOMAIN, inline=True)
@register(OUT_OF_DOMAIN, inline=True)
def score(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    """1 if the response is the problem's terms, else 0. ground_truth: {"start", "step", "bound", "op"}."""
    fmt, ok = check(response.strip(), ground_truth)
    return RewardResult(score=float(ok), correct=ok, format_ok=fmt)


def draw(rng: random.Random, op: str) -> StrideProblem:
    """One problem of the rule `op`: T terms from the power law, a step of 1-9, the first term and the
    bound uniform where T terms of that step fit in [0, 999]."""
    t = rng.choices(_TERMS, cum_weights=_CUMULATIVE)[0]
    step = rng.randint(1, 9)
    span = (t - 1) * step
    if op == "-":  # start down to start - span, the bound below that and at or above the next term
        start = rng.randint(span + 1, TOP)
        bound = rng.randint(max(0, start - span - step), start - span - 1)
    else:
        start = rng.randint(0, TOP - span - 1)
        bound = rng.randint(start + span + 1, min(TOP, start + span + step))
    return StrideProblem(start, step, bound, op)


def _distinct(rng: random.Random, op: str, count: int) -> list[StrideProblem]:
    seen: dict[StrideProblem, None] = {}
    while len(seen) < count:
        seen.setdefault(draw(rng, op))
    return list(seen)


def make_splits(seed: int, num_train: int, num_test: int) -> dict[str, list[StrideProblem]]:
    """Train / test / OOD-test / warm-start problems with disjoint prompts (two that differ only in the
    bound may share an answer), all from `seed`: the down rule's test, train and WARM_DOWN warm-start
    problems, the up rule's OOD test and WARM_UP warm-start problems."""
    if num_test + num_train + WARM_DOWN > MAX_PROBLEMS:
        raise ValueError(f"task.num_train + task.num_test must be <= {MAX_PROBLEMS - WARM_DOWN} for the stride task")
    rng = random.Random(seed)
    down = _distinct(rng, "-", num_test + num_train + WARM_DOWN)
    up = _distinct(rng, "+", num_test + WARM_UP)
    warm = down[num_test + num_train:] + up[num_test:]
    rng.shuffle(warm)
    return {"train": down[num_test:num_test + num_train], "test": down[:num_test], "ood_test": up[:num_test],
            "warmstart": warm}
