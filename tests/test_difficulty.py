"""Test prompts split by what pi_0 did on them: each part's Pass@k from the per-prompt counts, checked
against enumerating every k-subset of the samples."""

from __future__ import annotations

import itertools

import pytest

from dph_async.pipeline.report import difficulty_rows, tables_by_test_set
from dph_async.runtime.evaluate import DIFFICULTY, PromptResult, SplitResult, by_base_difficulty
from dph_async.tools.ablate.report import difficulty_tables
from dph_async.tools.ablate.results import Group, Stat


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


def evals_of_two_test_sets() -> dict[str, dict[str, SplitResult]]:
    n = 6
    counts = {"base": {"a": 6, "b": 3, "c": 1, "d": 0}, "grpo@d_exp": {"a": 6, "b": 5, "c": 0, "d": 1},
              "js_low_var": {"a": 5, "b": 6, "c": 2, "d": 0}}
    return {name: {s: split(c, n, distinct=2) for s in ("in_domain", "ood")} for name, c in counts.items()}


def test_the_per_band_table_is_one_narrow_table_per_test_set():
    evals = evals_of_two_test_sets()
    header, rows = difficulty_rows(evals)
    lines = tables_by_test_set(header, rows)
    assert [line for line in lines if line.startswith("###")] == ["### in_domain", "### ood"]
    table = [line for line in "\n".join(lines).splitlines() if line.startswith("|")]
    assert table and all(len(line) <= 100 for line in table), max(table, key=len)
    # Each row holds what by_base_difficulty gives for its model on its part of the prompts.
    assert len(rows) == 2 * 4 * 3  # test sets x parts (one prompt each) x models
    for test_set, part, prompts, model, p1, p6, distinct in rows:
        key = next(k for k, v in DIFFICULTY.items() if v == part)
        sub = by_base_difficulty(evals["base"][test_set], evals[model][test_set])[key]
        assert (int(prompts), p1, p6, distinct) == (sub.prompts, f"{100 * sub.pass_at_k[1]:.1f}",
                                                    f"{100 * sub.pass_at_k[6]:.1f}", f"{sub.distinct_correct:.2f}")
    assert header[-2] == "P@6"


def test_a_sweeps_per_band_table_is_one_narrow_table_per_band():
    base = evals_of_two_test_sets()["base"]
    parts = by_base_difficulty(base["in_domain"], base["in_domain"])

    def group(mode: str, coeff: float) -> Group:
        metrics = {f"in_domain/{kind}/{m}": Stat(v, 0.012, 3) for kind, sub in parts.items()
                   for m, v in (("pass@1", sub.pass_at_k[1]), ("pass@6", sub.pass_at_k[6]),
                                ("distinct", sub.distinct_correct))}
        return Group(f"{mode}-{coeff}", {"mode": mode, "coeff": coeff}, [], metrics)

    lines = difficulty_tables([group("js_low_var", 0.2), group("reverse_kl", 0.1)], "in_domain", 6, base, None)
    assert [line for line in lines if line.startswith("###")] == [f"### {DIFFICULTY[k]} (1 prompts)" for k in parts]
    table = [line for line in "\n".join(lines).splitlines() if line.startswith("|")]
    assert table and all(len(line) <= 100 for line in table), max(table, key=len)
    assert "| js_low_var | 0.2 | 0 | 100.0 ± 1.2 | 100.0 ± 1.2 | 2.00 ± 0.01 |" in table  # no cells: 0 seeds
