"""The embedded verifiable task: pick digits from a given set that reach a target.

    prompt  "25789+17="   answer "8+9" or "2+7+8"   (in-domain: a sum of 2+ distinct given digits)
    prompt  "25789-3="    answer "5-2" or "8-5"     (out-of-domain rule variant: a difference of two)

Each of the five given digits may be used at most once. Most problems have several correct answers,
so Pass@k and the number of distinct correct answers measure diversity. The base policy is trained
on both rules; RL trains on the sum rule only, and the difference rule measures what RL forgot.
Everything is generated from a seed: nothing is downloaded.
"""

from __future__ import annotations

import functools
import itertools
import random
import re
from dataclasses import dataclass
from typing import Any

from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult

IN_DOMAIN = "embedded_sum"
OUT_OF_DOMAIN = "embedded_diff"
RULE_OF = {IN_DOMAIN: "+", OUT_OF_DOMAIN: "-"}
NUM_DIGITS = 5
ALPHABET = "0123456789+-="


@functools.cache
def _solutions(digits: str, target: int, op: str) -> list[str]:
    ds = [int(c) for c in digits]
    if op == "-":
        return [f"{a}-{b}" for a, b in itertools.permutations(ds, 2) if a - b == target]
    return ["+".join(map(str, c)) for r in range(2, len(ds) + 1)
            for c in itertools.permutations(ds, r) if sum(c) == target]


@dataclass(frozen=True)
class Problem:
    digits: str  # distinct digits 1-9, sorted (NUM_DIGITS of them in this task)
    target: int
    op: str  # "+" or "-"

    @property
    def prompt(self) -> str:
        return f"{self.digits}{self.op}{self.target}="

    @property
    def data_source(self) -> str:
        return IN_DOMAIN if self.op == "+" else OUT_OF_DOMAIN

    @property
    def ground_truth(self) -> dict[str, Any]:
        return {"digits": self.digits, "target": self.target, "op": self.op}

    @property
    def out_of_domain(self) -> bool:
        return self.op == "-"

    def solutions(self) -> list[str]:
        """Every correct answer, terms in any order."""
        return _solutions(self.digits, self.target, self.op)

    def wrong_answer(self, rng: random.Random) -> str:
        """A well-formed answer that is usually wrong: two or three of the given digits (two for a
        difference) in a random order."""
        k = 2 if self.op == "-" else rng.randint(2, 3)
        return self.op.join(rng.sample(self.digits, k))



def check(answer: str, digits: str, target: int, op: str) -> tuple[bool, bool]:
    """(format_ok, correct) for an answer to the problem (digits, op, target)."""
    terms = answer.split(op)
    if not all(re.fullmatch(r"[1-9]", t) for t in terms) or len(terms) < 2:
        return False, False
    if op == "-" and len(terms) != 2:
        return True, False
    pool = list(digits)
    for t in terms:
        if t not in pool:
            return True, False
        pool.remove(t)
    value = sum(map(int, terms)) if op == "+" else int(terms[0]) - int(terms[1])
    return True, value == target


# A regular expression and a digit sum over a short string: scored inline, without a worker round trip.
@register(IN_DOMAIN, inline=True)
@register(OUT_OF_DOMAIN, inline=True)
def score(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    """1 if the response is a correct answer, else 0. ground_truth: {"digits", "target", "op"}."""
    answer = response.strip()
    fmt, ok = check(answer, str(ground_truth["digits"]), int(ground_truth["target"]), str(ground_truth["op"]))
    return RewardResult(score=float(ok), correct=ok, format_ok=fmt)


def problems_of(digits: str, op: str) -> list[Problem]:
    """Every problem of one digit set under one rule: one per reachable target, in target order."""
    ds = [int(c) for c in digits]
    targets = {a - b for a, b in itertools.permutations(ds, 2) if a > b} if op == "-" else {
        sum(c) for r in range(2, len(ds) + 1) for c in itertools.combinations(ds, r)}
    return [Problem(digits, t, op) for t in sorted(targets)]


def digit_sets(size: int) -> list[str]:
    """Every set of `size` distinct digits 1-9, as sorted strings."""
    return ["".join(c) for c in itertools.combinations("123456789", size)]


def _all_problems(op: str) -> list[Problem]:
    return [p for digits in digit_sets(NUM_DIGITS) for p in problems_of(digits, op)]


def make_splits(seed: int, num_train: int, num_test: int) -> dict[str, list[Problem]]:
    """Disjoint train / test / OOD-test / warm-start problem sets, all from `seed`.

    The warm-start set (both rules) shares no prompt with the test sets, so test accuracy measures
    generalisation. RL trains on `train` (sum rule only).
    """
    rng = random.Random(seed)
    sums, diffs = _all_problems("+"), _all_problems("-")
    rng.shuffle(sums)
    rng.shuffle(diffs)
    if num_train + 2 * num_test > len(sums) or 2 * num_test > len(diffs):
        raise ValueError(f"task.num_train + 2*task.num_test must be <= {len(sums)} (and num_test <= {len(diffs)//2})")
    test, train = sums[:num_test], sums[num_test:num_test + num_train]
    ood_test = diffs[:num_test]
    warm = sums[num_test + num_train:] + diffs[num_test:]
    rng.shuffle(warm)
    return {"train": train, "test": test, "ood_test": ood_test, "warmstart": warm}
