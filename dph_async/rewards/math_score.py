"""Math rewards: the last \\boxed{} answer checked with math-verify, and GSM8K's "#### n" answers.

Registered data_sources:
- "math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", and any
  source ending in "_mathverify": ground_truth is the reference answer as LaTeX or plain text ("\\frac12",
  "0.5", "x^2+1"), or a string already holding \\boxed{} or $...$.
- "openai/gsm8k", "gsm8k": ground_truth is the number, or a full GSM8K solution ending "#### n".

math-verify's own timeouts use SIGALRM, which fails off a process's main thread; they are switched off
here and the deadline is enforced from outside: the pool kills a worker whose call overruns (parsing
nested LaTeX or comparing towers of powers can run for minutes).
"""

from __future__ import annotations

import logging
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from dph_async.rewards import context
from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult, failure

# math-verify warns once per process that its timeouts are off; that is deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# A longer boxed answer is not a final answer; refusing it keeps the parser away from megabytes of LaTeX.
MAX_ANSWER_CHARS = 2_000
_EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]
_BOXED = ("\\boxed", "\\fbox")
_GSM8K_ANSWER = re.compile(r"####\s*\$?\s*([-+]?[\d,]*\.?\d+)")


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}) with balanced braces, or None."""
    start = max(text.rfind(tag) for tag in _BOXED)
    if start < 0:
        return None
    open_brace = text.find("{", start)
    if open_brace < 0 or text[start:open_brace].strip() not in _BOXED:
        # "\boxed 5": the answer is the next token.
        rest = text[start:].split(maxsplit=2)
        return rest[1].strip("$.") if len(rest) > 1 and rest[0] in _BOXED else None
    depth = 0
    for i in range(open_brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_brace + 1 : i]
    return None


def _as_latex(answer: str) -> str:
    return answer if "\\boxed" in answer or "$" in answer else f"\\boxed{{{answer}}}"


def math_equal(gold: str, answer: str) -> bool | None:
    """math-verify's verdict on `answer` against `gold`; None when the answer does not parse."""
    context.stage("reference", format_ok=True)
    gold_parsed = parse(_as_latex(gold), extraction_config=_EXTRACTION, parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"ground truth {gold[:80]!r} could not be parsed")
    context.stage("response", format_ok=True)
    answer_parsed = parse(f"\\boxed{{{answer}}}", extraction_config=_EXTRACTION, parsing_timeout=None)
    if not answer_parsed:
        return None
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def score_boxed(response: str, ground_truth: Any) -> RewardResult:
    if not isinstance(ground_truth, (str, int, float)):
        raise ValueError(f"math ground_truth must be a string or number, got {type(ground_truth).__name__}")
    answer = last_boxed(response)
    if answer is None:
        return failure("parse_error", "no \\boxed{} answer in the response")
    if len(answer) > MAX_ANSWER_CHARS:
        return failure("rejected", f"boxed answer has {len(answer)} characters (limit {MAX_ANSWER_CHARS})",
                       format_ok=True)
    verdict = math_equal(str(ground_truth), answer)
    if verdict is None:
        return failure("parse_error", "the boxed answer could not be parsed", format_ok=True)
    return RewardResult(score=float(verdict), correct=verdict)


@register("math")
@register("lighteval/MATH")
@register("DigitalLearningGmbH/MATH-lighteval")
@register("HuggingFaceH4/MATH-500")
@register("_mathverify", suffix=True)
def mathverify_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    return score_boxed(response, ground_truth)


def _number(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("$", "").strip().rstrip("."))
    except InvalidOperation:
        return None


@register("openai/gsm8k")
@register("gsm8k")
def gsm8k_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    """Strict GSM8K: the number after the last "####" must equal the reference number."""
    gold_text = str(ground_truth)
    if "####" in gold_text:
        gold_text = gold_text.rsplit("####", 1)[1]
    gold = _number(gold_text)
    if gold is None:
        raise ValueError(f"gsm8k ground_truth {str(ground_truth)[:80]!r} is not a number")
    found = _GSM8K_ANSWER.findall(response)
    if not found:
        return failure("parse_error", "no '#### <number>' answer in the response")
    answer = _number(found[-1])
    if answer is None:
        return failure("parse_error", f"{found[-1][:40]!r} is not a number", format_ok=True)
    return RewardResult(score=float(answer == gold), correct=answer == gold)
