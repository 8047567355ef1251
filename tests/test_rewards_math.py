"""Math rewards: boxed extraction, math-verify equivalence off the main thread, GSM8K answers."""

import threading

import pytest

from dph_async.rewards.math_score import last_boxed
from dph_async.rewards.worker import ScoreRequest, score_one


def score(source, response, truth):
    return score_one(ScoreRequest(source, response, truth, {}))


@pytest.mark.parametrize(("text", "expected"), [
    (r"so \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
    (r"\boxed{1} then \boxed{x^{2}+1}", "x^{2}+1"),
    (r"\fbox{7}", "7"),
    (r"the answer is \boxed 5.", "5"),
    (r"\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(("answer", "truth", "correct"), [
    (r"\frac{1}{2}", "0.5", True),
    ("0.5", r"\frac12", True),
    (r"2\sqrt{2}", r"\sqrt{8}", True),
    ("3", "0.5", False),
    (r"x^2+1", r"$1 + x^2$", True),
    ("12", 12, True),
])
def test_math_verify_equivalence(answer, truth, correct):
    result = score("math", f"Work... so \\boxed{{{answer}}}", truth)
    assert (result.correct, result.score, result.status) == (correct, float(correct), "ok")


def test_mathverify_suffix_and_missing_box():
    assert score("deepscaler_mathverify", r"\boxed{4}", "4").correct
    missing = score("math", "The answer is 4.", "4")
    assert (missing.status, missing.format_ok, missing.score) == ("parse_error", False, 0.0)


def test_unparseable_ground_truth_is_a_scorer_error():
    result = score("math", r"\boxed{4}", [1, 2])
    assert result.status == "error" and result.scorer_failed


def test_math_verify_works_off_the_main_thread():
    """math-verify's own SIGALRM timeouts would raise here; ours are off (the pool enforces deadlines)."""
    results = []
    thread = threading.Thread(target=lambda: results.append(score("math", r"\boxed{\frac{2}{4}}", "0.5")))
    thread.start()
    thread.join()
    assert results[0].correct and results[0].status == "ok"


@pytest.mark.parametrize(("response", "truth", "correct", "status"), [
    ("... so she has 1,000 apples.\n#### 1,000", "1000", True, "ok"),
    ("#### $18", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", True, "ok"),
    ("#### 18.0", "18", True, "ok"),
    ("#### 17", "18", False, "ok"),
    ("The answer is 18", "18", False, "parse_error"),
])
def test_gsm8k_strict_answers(response, truth, correct, status):
    result = score("openai/gsm8k", response, truth)
    assert (result.correct, result.status) == (correct, status)
