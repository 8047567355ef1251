"""The stride task: its terms, its reward, its long-tailed lengths and its splits."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from dph_async.config import ConfigError, load_config
from dph_async.rewards.registry import get_reward_fn, is_inline
from dph_async.tasks import catalog, stride
from dph_async.tasks.stride import StrideProblem, check, draw, make_splits, score


def test_the_docstrings_examples_hold():
    down, up = StrideProblem(137, 7, 50, "-"), StrideProblem(4, 7, 60, "+")
    assert (down.prompt, up.prompt) == ("137-7>50=", "4+7<60=")
    assert down.solutions() == ["137,130,123,116,109,102,95,88,81,74,67,60,53"]
    assert up.solutions() == ["4,11,18,25,32,39,46,53"]
    assert (down.data_source, down.out_of_domain, up.data_source, up.out_of_domain) == (
        "stride_down", False, "stride_up", True)


def test_a_drawn_problem_has_its_terms_inside_the_bound_and_the_next_term_outside():
    seed = random.randrange(1 << 30)
    rng, steps = random.Random(seed), set()
    for _ in range(3000):
        p = draw(rng, rng.choice("-+"))
        assert p == StrideProblem(**p.ground_truth), seed
        steps.add(p.step)
        terms = p.terms()
        assert stride.MIN_TERMS <= len(terms) <= stride.MAX_TERMS and 1 <= p.step <= 9
        assert all(0 <= t <= stride.TOP for t in terms)
        sign = 1 if p.op == "+" else -1
        assert {b - a for a, b in itertools.pairwise(terms)} == {sign * p.step}
        nxt = terms[-1] + sign * p.step
        if p.op == "-":
            assert min(terms) > p.bound >= nxt and p.bound >= 0
        else:
            assert max(terms) < p.bound <= nxt and p.bound <= stride.TOP
        answer = p.solutions()[0]
        # one token a character: every character is in the tokenizer's alphabet, and the lengths fit
        assert set(p.prompt + answer) <= set(stride.ALPHABET)
        assert len(p.prompt) <= stride.MAX_PROMPT_CHARS and len(answer) <= stride.MAX_ANSWER_CHARS
    assert steps == set(range(1, 10)), seed


def test_term_counts_follow_the_power_law_with_its_long_tail():
    """P(T) proportional to T^-1.5 on [2, 100]: P(2) = 0.250, P(T >= 50) = 0.060; 20,000 draws put
    each within about 4 standard errors (0.012 and 0.007)."""
    rng = random.Random(random.randrange(1 << 30))
    counts = Counter(len(draw(rng, "-").terms()) for _ in range(20_000))
    weights = {t: t ** -1.5 for t in range(2, 101)}
    total = sum(weights.values())
    assert counts[2] / 20_000 == pytest.approx(weights[2] / total, abs=0.012)
    tail = sum(c for t, c in counts.items() if t >= 50) / 20_000
    assert tail == pytest.approx(sum(w for t, w in weights.items() if t >= 50) / total, abs=0.007)
    assert max(counts) > 90 and min(counts) == 2


@pytest.mark.parametrize("op", "-+")
def test_the_reward_takes_exactly_the_terms(op):
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(300):
        p = draw(rng, op)
        right = p.solutions()[0]
        assert score(right, p.ground_truth, {}).correct and score(f" {right}\n", p.ground_truth, {}).score == 1.0
        for wrong in (p.wrong_answer(rng), right + ",", right.rsplit(",", 1)[0], "0" + right):
            assert check(wrong, p.ground_truth) in ((True, False), (False, False)), wrong
        assert check(p.wrong_answer(rng), p.ground_truth) == (True, False)
        assert check(right.replace(",", "+"), p.ground_truth) == (False, False)
    assert check("", {"start": 5, "step": 1, "bound": 3, "op": "-"}) == (False, False)
    assert check("1000,999", {"start": 999, "step": 1, "bound": 997, "op": "-"}) == (False, False)  # 4 digits


def test_both_rules_are_registered_inline():
    for source in ("stride_down", "stride_up"):
        assert get_reward_fn(source) is score and is_inline(source)


def test_the_splits_are_disjoint_seeded_and_sized():
    splits = make_splits(7, 300, 100)
    assert {k: len(v) for k, v in splits.items()} == {
        "train": 300, "test": 100, "ood_test": 100, "warmstart": stride.WARM_DOWN + stride.WARM_UP}
    prompts = [{p.prompt for p in v} for v in splits.values()]
    assert sum(map(len, prompts)) == len(set().union(*prompts))  # distinct within and across splits
    assert {p.op for p in splits["train"] + splits["test"]} == {"-"} and {p.op for p in splits["ood_test"]} == {"+"}
    assert Counter(p.op for p in splits["warmstart"]) == {"-": stride.WARM_DOWN, "+": stride.WARM_UP}
    assert make_splits(7, 300, 100) == splits and make_splits(8, 300, 100)["test"] != splits["test"]


def test_the_catalog_keeps_a_share_of_the_warm_starts_up_rule():
    full = catalog.make_splits("stride", 3, 50, 20)["warmstart"]
    half = catalog.make_splits("stride", 3, 50, 20, ood_warm_share=0.5)["warmstart"]
    assert Counter(p.op for p in half) == {"-": stride.WARM_DOWN, "+": stride.WARM_UP // 2}
    assert set(half) <= set(full)


def test_a_run_of_the_stride_task_names_the_lengths_it_needs():
    from dph_async.pipeline.stages import validate

    cfg = load_config("default", ["task.name=stride"])
    with pytest.raises(ConfigError, match=r"sampling.max_tokens >= 400 and model.max_model_len >= sampling.max_tokens "
                                          r"\+ 11 \(got 16 and 64\); add sampling.max_tokens=400 "
                                          r"model.max_model_len=411"):
        validate(cfg, [])
    assert catalog.fits("stride", 400, 411) is None and catalog.fits("stride", 399, 411) is not None
    assert catalog.fits("stride", 400, 410) is not None and catalog.fits("embedded", 1, 8) is None
    # more room for answers takes as much more length: the prompt's room stays (450 leaves 0 for it)
    assert catalog.fits("stride", 450, 411) is not None and catalog.fits("stride", 450, 461) is None


@pytest.mark.parametrize("truth", [
    {"start": 0, "step": 1, "bound": 10**12, "op": "+"},  # a trillion terms, had it been counted
    {"start": 5, "step": 0, "bound": 1, "op": "-"}, {"start": 5, "step": 10, "bound": 1, "op": "-"},
    {"start": -1, "step": 1, "bound": 1, "op": "+"}, {"start": 5, "step": 1, "bound": 1000, "op": "+"},
    {"start": 5, "step": 1, "bound": 1, "op": "*"}, {"start": 5, "step": True, "bound": 1, "op": "-"},
    {"start": 5.0, "step": 1, "bound": 1, "op": "-"}, {"start": 5, "step": 1, "op": "-"}, [5, 1, 1, "-"], None,
])
def test_a_ground_truth_the_task_could_not_have_made_is_refused_before_any_counting(truth):
    with pytest.raises(ValueError, match="stride ground_truth"):
        check("1,2", truth)
    from dph_async.rewards.worker import _call

    result = _call("stride_down", "1,2", truth, {})  # what a worker or an inline scorer makes of it
    assert (result.status, result.score) == ("error", 0.0) and "stride ground_truth" in result.detail


def test_splits_larger_than_the_rules_can_give_quickly_are_refused():
    with pytest.raises(ValueError, match=r"task.num_train \+ task.num_test must be <= 46000 for the stride task"):
        make_splits(0, 46_000, 1)
    assert len(make_splits(0, 45_999, 1)["train"]) == 45_999  # the largest: 50,000 down problems with the warm start


@pytest.mark.parametrize(("problem", "wrong"), [
    # one term too few, one too many (the next term is in range), or one term one up
    (StrideProblem(20, 5, 4, "-"),
     {"20,15,10", "20,15,10,5,0", "21,15,10,5", "20,16,10,5", "20,15,11,5", "20,15,10,6"}),
    # a term at 999 goes one down; no term past 999 is added
    (StrideProblem(989, 9, 999, "+"), {"989", "990,998", "989,999"}),
    (StrideProblem(999, 9, 980, "-"), {"999,990", "999,990,981,972", "998,990,981", "999,991,981", "999,990,982"}),
])
def test_the_warm_starts_wrong_answers_are_exactly_the_three_kinds(problem, wrong):
    rng = random.Random(random.randrange(1 << 30))
    assert {problem.wrong_answer(rng) for _ in range(600)} == wrong


@pytest.mark.parametrize("truth", [{"start": 999, "step": 9, "bound": 0, "op": "-"},
                                   {"start": 0, "step": 1, "bound": 999, "op": "+"}])
def test_a_ground_truth_at_the_edges_of_the_range_is_taken(truth):
    p = StrideProblem(**truth)
    assert check(p.solutions()[0], truth) == (True, True)
