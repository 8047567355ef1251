"""Test prompts split by what pi_0 did on them: each part's Pass@k from the per-prompt counts, checked
against enumerating every k-subset of the samples."""

from __future__ import annotations

import itertools

import pytest

from dph_async.app.evaluate import PromptResult, SplitResult, by_base_difficulty


def split(counts: dict[str, int], n: int, distinct: int = 1) -> SplitResult:
    rows = [PromptResult(pid, c, min(c, distinct), c > 0) for pid, c in counts.items()]
    return SplitResult("t", len(rows), 0.0, {}, 0.0, 0.0, 0.0, samples=n, per_prompt=rows)


def brute_pass_at_k(n: int, c: int, k: int) -> float:
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(samples, k))
    return sum(any(s) for s in subsets) / len(subsets)


def test_subsets_follow_the_base_models_counts():
    n = 6
    base = split({"a": 6, "b": 6, "c": 3, "f": 5, "d": 1, "g": 2, "e": 0}, n)
    model = split({"a": 6, "b": 2, "c": 0, "f": 3, "d": 4, "g": 5, "e": 1}, n, distinct=2)
    parts = by_base_difficulty(base, model)
    assert {k: v.prompts for k, v in parts.items()} == {"always": 2, "mostly": 2, "rarely": 2, "never": 1}
    for k in range(1, n + 1):
        always = (brute_pass_at_k(n, 6, k) + brute_pass_at_k(n, 2, k)) / 2
        mostly = (brute_pass_at_k(n, 0, k) + brute_pass_at_k(n, 3, k)) / 2
        rarely = (brute_pass_at_k(n, 4, k) + brute_pass_at_k(n, 5, k)) / 2
        assert parts["always"].pass_at_k[k] == pytest.approx(always)
        assert parts["mostly"].pass_at_k[k] == pytest.approx(mostly)
        assert parts["rarely"].pass_at_k[k] == pytest.approx(rarely)
        assert parts["never"].pass_at_k[k] == pytest.approx(brute_pass_at_k(n, 1, k))
    assert parts["always"].distinct_correct == pytest.approx(2.0)
    assert parts["mostly"].distinct_correct == pytest.approx(1.0)
    assert parts["rarely"].distinct_correct == pytest.approx(2.0)
