"""Countdown: exact fractions over an AST whitelist, every number used exactly once, never eval."""

import operator
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dph_async.rewards.countdown import Rejected, evaluate_arithmetic
from dph_async.rewards.worker import ScoreRequest, score_one

TRUTH = {"target": 24, "numbers": [3, 8, 8, 3]}


def score(response, truth=TRUTH):
    return score_one(ScoreRequest("countdown", response, truth, {}))


def test_exact_fractions():
    assert score("<think>8/(3-8/3)</think><answer>8 / (3 - 8 / 3)</answer>").correct  # 8/(1/3) = 24 exactly
    value, used = evaluate_arithmetic("(1/3) * 3")
    assert value == 1 and used == [1, 3, 3]


@pytest.mark.parametrize(("answer", "status", "why"), [
    ("8 * 3", "ok", "uses"),  # numbers missing
    ("8 * 3 * (8 - 8 + 3 - 3)", "ok", "uses"),  # numbers used twice
    ("8 + 8 + 3 + 3", "ok", "value"),
    ("8 / (3 - 3) + 8 * 3", "ok", "division by zero"),
    ("-8 * -3 + 8 - 8", "rejected", "UnaryOp"),
    ("8 ** 3", "rejected", "Pow"),
    ("__import__('os').system('true')", "rejected", "Call"),
    ("(lambda: 24)()", "rejected", "Call"),
    ("8.0 * 3 + 8 - 8", "rejected", "Constant"),
    ("8 * 3 +", "parse_error", "SyntaxError"),
])
def test_wrong_or_forbidden_answers_score_zero(answer, status, why):
    result = score(f"<answer>{answer}</answer>")
    assert (result.score, result.correct, result.status) == (0.0, False, status)
    assert why in result.detail


def test_missing_answer_and_bad_ground_truth():
    assert score("24").status == "parse_error"
    assert score("<answer>8*3</answer>", {"target": 24}).status == "error"


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@st.composite
def expressions(draw, depth=3):
    if depth == 0 or draw(st.booleans()):
        n = draw(st.integers(0, 50))
        return str(n), Fraction(n), [n]
    op = draw(st.sampled_from(["+", "-", "*", "/"]))
    left, lv, lu = draw(expressions(depth=depth - 1))
    right, rv, ru = draw(expressions(depth=depth - 1))
    if op == "/" and rv == 0:
        op = "+"
    value = lv / rv if op == "/" else _OPS[op](lv, rv)
    return f"({left} {op} {right})", value, lu + ru


@given(expressions())
def test_evaluation_matches_exact_arithmetic(case):
    text, value, literals = case
    assert evaluate_arithmetic(text) == (value, literals)


def test_length_cap():
    with pytest.raises(Rejected):
        evaluate_arithmetic("1+" * 600 + "1")
