"""The reward contract (dph_async/rewards/result.py), in-process: what `checked` lets through, how it
names what it refuses, and where a detail is cut."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dph_async.rewards.result import (
    MAX_DETAIL_CHARS,
    SCORER_FAILURES,
    STATUSES,
    RewardResult,
    checked,
    failure,
    origin,
)


def team_reward(response, ground_truth, extra_info):
    return RewardResult(1.0, True)


class Scorer:
    def __call__(self, response, ground_truth, extra_info):
        return RewardResult(1.0, True)


HERE = f"reward function team_reward ({__file__})"


def test_a_plain_result_says_ok_and_keeps_its_format():
    r = RewardResult(0.5, False)
    assert (r.format_ok, r.status, r.latency_s, r.detail, r.scorer_failed) == (True, "ok", 0.0, "", False)


@pytest.mark.parametrize("status", STATUSES)
def test_only_the_scorer_s_own_failures_are_scorer_failures(status):
    assert RewardResult(0.0, False, status=status).scorer_failed == (status in ("error", "verifier_error"))
    assert set(STATUSES) >= SCORER_FAILURES


def test_a_failure_scores_zero_is_wrong_and_keeps_its_reason():
    assert failure("timeout", "ran 10 s") == RewardResult(0.0, False, False, "timeout", 0.0, "ran 10 s")
    assert failure("parse_error", "no \\boxed{}", format_ok=True).format_ok is True


def test_origin_names_the_function_and_where_it_was_found():
    assert origin(team_reward) == HERE
    # A plugin compiled from text has no file on disk: its module stands in.
    namespace = {"__name__": "team_plugin"}
    exec(compile("def fn(response, ground_truth, extra_info):\n    pass\n", "<plugin>", "exec"), namespace)
    assert origin(namespace["fn"]) == "reward function fn (team_plugin)"
    # A builtin or a callable object has no source file either.
    assert origin(len) == "reward function len (builtins)"
    scorer = Scorer()
    assert origin(scorer) == f"reward function {scorer!r} ({__name__})"
    assert origin((1).__add__) == "reward function int.__add__ (?)"  # no __module__ at all


def test_what_keeps_the_contract_is_rebuilt_from_plain_values():
    class Detail(str):
        pass

    value = RewardResult(np.float32(0.25), np.bool_(True), np.bool_(False), "rejected", 3.5, Detail("why"))
    got = checked(value, team_reward)
    assert got == RewardResult(0.25, True, False, "rejected", 0.0, "why")
    assert [type(x) for x in (got.score, got.correct, got.format_ok, got.detail)] == [float, bool, bool, str]
    assert checked(RewardResult(3, False), team_reward) == RewardResult(3.0, False)  # an int is a number


@pytest.mark.parametrize(("value", "says"), [
    (None, "returned NoneType; a reward function must return a RewardResult (dph_async.rewards.result)"),
    (1.0, "returned float; a reward function must return a RewardResult (dph_async.rewards.result)"),
    (RewardResult(1.0, True, status="great"),
     "returned status 'great'; one of ok, parse_error, rejected, exec_error, timeout, error, verifier_error"),
    (RewardResult(True, True), "returned a score of type bool; a score is a finite float"),
    (RewardResult("1", True), "returned a score of type str; a score is a finite float"),
    (RewardResult(None, True), "returned a score of type NoneType; a score is a finite float"),
    (RewardResult(float("nan"), True), "returned a non-finite score (nan); a score is a finite float"),
    (RewardResult(-np.inf, True), "returned a non-finite score (-inf); a score is a finite float"),
    (RewardResult(1.0, 1), "returned correct of type int; correct is a bool (True or False)"),
    (RewardResult(1.0, np.int64(0)), "returned correct of type int64; correct is a bool (True or False)"),
    (RewardResult(1.0, True, format_ok=None),
     "returned format_ok of type NoneType; format_ok is a bool (True or False)"),
    (RewardResult(1.0, True, format_ok=1.0), "returned format_ok of type float; format_ok is a bool (True or False)"),
    (RewardResult(1.0, True, detail=b"x"), "returned a detail of type bytes; detail is a str"),
])
def test_a_broken_contract_is_a_scorer_failure_naming_function_and_rule(value, says):
    assert checked(value, team_reward) == RewardResult(0.0, False, False, "error", 0.0, f"{HERE} {says}")


@given(st.integers(0, 3 * MAX_DETAIL_CHARS), st.characters(codec="utf-8"))
def test_a_detail_is_kept_up_to_the_limit_and_cut_to_exactly_the_limit_past_it(n, c):
    detail = checked(RewardResult(0.0, False, detail=c * n), team_reward).detail
    if n <= MAX_DETAIL_CHARS:
        assert detail == c * n
    else:
        assert detail == c * (MAX_DETAIL_CHARS - 1) + "…"


@pytest.mark.parametrize("n", [MAX_DETAIL_CHARS - 1, MAX_DETAIL_CHARS, MAX_DETAIL_CHARS + 1])
def test_a_detail_of_exactly_the_limit_is_whole_and_one_more_is_cut(n):
    detail = checked(RewardResult(0.0, False, detail="d" * n), team_reward).detail
    assert len(detail) == min(n, MAX_DETAIL_CHARS) and detail.endswith("…") == (n > MAX_DETAIL_CHARS)
