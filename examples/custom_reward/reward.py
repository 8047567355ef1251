"""A reward plugin: the user's own reward, loaded with `rewards.plugins=[examples/custom_reward/reward.py]`.

The task: spell a word backwards. Registered data_source: "reverse_word"; ground_truth: the word
reversed. The answer is the last <answer>...</answer> of the response; score 1 (correct) when it
equals the ground truth, ignoring case and surrounding spaces, else 0.
"""

from __future__ import annotations

import re
from typing import Any

from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult, failure

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@register("reverse_word", inline=True)  # pure and linear in the response: safe in the caller's process
def reverse_word(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    answers = ANSWER.findall(response)
    if not answers:
        return failure("parse_error", "no <answer>...</answer> in the response")
    correct = answers[-1].strip().lower() == str(ground_truth).strip().lower()
    return RewardResult(score=float(correct), correct=correct, detail=f"answer {answers[-1].strip()[:40]!r}")
