"""Countdown (TinyZero's task): combine the given numbers with + - * / into an expression equal to a target.

Registered data_source: "countdown". ground_truth: {"target": int, "numbers": [int, ...]}.
The answer is the last <answer>...</answer> of the response. It is parsed with `ast` and evaluated
over a whitelist (integer literals, parentheses, binary + - * /) in exact fractions; it is never
`eval`ed: TinyZero's character filter lets `2**99**99` through to `eval`, which then never returns.
Each given number must be used exactly once. Score 1 (correct) when the value equals the target,
else 0.
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from dph_async.rewards import context
from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult, failure

MAX_EXPRESSION_CHARS = 1_000
_OPERATORS: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class Rejected(ValueError):
    """The expression uses something outside the whitelist."""


def _evaluate(node: ast.AST, literals: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        literals.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left, literals), _evaluate(node.right, literals)
        return _OPERATORS[type(node.op)](left, right)
    what = type(node.op if isinstance(node, ast.BinOp) else node).__name__
    raise Rejected(f"{what} is not allowed (only integers, parentheses and + - * /)")


def evaluate_arithmetic(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integer literals it uses.

    Raises Rejected for anything outside the whitelist, SyntaxError when it does not parse and
    ZeroDivisionError on a division by zero.
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise Rejected(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    tree = ast.parse(expression.strip(), mode="eval")
    literals: list[int] = []
    return _evaluate(tree.body, literals), literals


def last_answer(response: str) -> str | None:
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end) if end >= 0 else -1
    return response[start + len("<answer>") : end] if start >= 0 else None


def _ground_truth(ground_truth: Any) -> tuple[Fraction, list[int]]:
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError('countdown ground_truth must be {"target": int, "numbers": [int, ...]}')
    return Fraction(int(ground_truth["target"])), [int(n) for n in ground_truth["numbers"]]


@register("countdown")
def countdown_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    target, numbers = _ground_truth(ground_truth)
    expression = last_answer(response)
    if expression is None:
        return failure("parse_error", "no <answer>...</answer> in the response")
    context.stage("response", format_ok=True)
    try:
        value, used = evaluate_arithmetic(expression)
    except Rejected as e:
        return failure("rejected", str(e), format_ok=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as e:
        return failure("parse_error", f"not an arithmetic expression: {type(e).__name__}", format_ok=True)
    except ZeroDivisionError:
        return RewardResult(score=0.0, correct=False, detail="division by zero")
    if Counter(used) != Counter(numbers):
        detail = f"uses {sorted(used)}, must use {sorted(numbers)} once each"
        return RewardResult(score=0.0, correct=False, detail=detail)
    correct = value == target
    detail = "" if correct else f"value {value} != {target}"
    return RewardResult(score=float(correct), correct=correct, detail=detail)
