"""Math rewards with an LLM verifier (TinyV), for sources ending in "_tinyv" (e.g. "polaris_tinyv").

ground_truth: the reference answer (as for the math rewards); extra_info["question"]: the problem text
the verifier is shown. The rule check is math-verify on the last \\boxed{} answer. With w =
`rewards.verifier.weight` and v = 1 if the verifier says True:
- addon: 1 if the rule check passes, else w * v (the verifier is asked only then);
- verifier_only: v (the rule check is not run);
- mixed: w * v + (1 - w) * rule (the verifier always asked).
`correct` means full marks (score 1). If the verifier fails, the status is "verifier_error" and the
score keeps only the rule check's share, so a trainer can tell a failure from a wrong answer.
"""

from __future__ import annotations

from typing import Any

from dph_async.rewards import context
from dph_async.rewards.math_score import last_boxed, score_boxed
from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult, failure
from dph_async.rewards.verifier import get_verifier


def _rule_check(response: str, ground_truth: Any) -> RewardResult:
    try:
        return score_boxed(response, ground_truth)
    except ValueError as e:
        # A reference math-verify cannot parse ("an isosceles triangle") is the verifier's job.
        return RewardResult(score=0.0, correct=False, detail=f"rule check: {e}")


@register("_tinyv", suffix=True)
def tinyv_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    cfg = context.config().verifier
    rule = None if cfg.mode == "verifier_only" else _rule_check(response, ground_truth)
    if rule is not None and (rule.correct or rule.status == "rejected") and cfg.mode == "addon":
        return rule
    boxed = last_boxed(response)
    answer = boxed if cfg.answer == "extracted" else response
    if answer is None:
        return rule or failure("parse_error", "no \\boxed{} answer for the verifier")
    question = extra_info.get("question")
    if not isinstance(question, str):
        return failure("error", "extra_info.question is needed by the verifier", format_ok=True)
    verdict = get_verifier().judge(question, str(ground_truth), answer)
    rule_score = rule.score if rule is not None else 0.0
    w = cfg.weight
    if verdict.correct is None:
        kept = {"addon": rule_score, "verifier_only": 0.0, "mixed": (1 - w) * rule_score}[cfg.mode]
        return RewardResult(score=kept, correct=False, format_ok=boxed is not None, status="verifier_error",
                            detail=verdict.detail)
    v = float(verdict.correct)
    score = {"addon": w * v, "verifier_only": v, "mixed": w * v + (1 - w) * rule_score}[cfg.mode]
    return RewardResult(score=score, correct=score > 1.0 - 1e-9, format_ok=boxed is not None,
                        detail=f"verifier says {verdict.correct}")
