"""The learner guard's rules at their edges (learner/guard.py), without a trainer: the first and last
id of the vocabulary and one past each, each field of a record bad on its own, the message that
names what was taken out or what stopped the run, at the count where it starts to shorten."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from dph_async.learner.guard import (
    NonFiniteTraining,
    StepGuard,
    all_finite,
    check_finite,
    group_problem,
    reference_problem,
    screen,
)
from dph_async.protocol import Batch, Completion, ReferenceSample, RolloutGroup, SamplingInfo
from dph_async.rewards.result import RewardResult

V = 8  # the vocabulary: ids 0..7


def ids(*values: int) -> np.ndarray:
    return np.array(values, np.int32)


def completion(token_ids: np.ndarray, logprobs: np.ndarray | None = None, score: float = 1.0) -> Completion:
    lp = np.full(len(token_ids), -0.5, np.float32) if logprobs is None else logprobs.astype(np.float32)
    return Completion(token_ids, lp, np.zeros(len(token_ids), np.int32), RewardResult(score, score > 0), "stop")


def rollout(seq: int, prompt: np.ndarray, *completions: Completion, actor: int = 0) -> RolloutGroup:
    return RolloutGroup(actor, seq, f"p{seq}", "digits", prompt, list(completions), SamplingInfo(1.0, 1.0, -1, 6),
                        0.0, 0.0)


def healthy(seq: int, actor: int = 0) -> RolloutGroup:
    return rollout(seq, ids(1, 2), completion(ids(3, 4)), completion(ids(5)), actor=actor)


def sample(name: str, prompt: np.ndarray, response: np.ndarray, logprobs: np.ndarray | None = None) -> ReferenceSample:
    lp = np.full(len(response), -0.5, np.float32) if logprobs is None else logprobs.astype(np.float32)
    return ReferenceSample(name, prompt, response, lp, 1.0, "pi0")


@pytest.mark.parametrize("bad", [-1, V])
def test_an_id_one_past_either_end_of_the_vocabulary_is_refused_in_every_field(bad):
    ok = ids(0, V - 1)  # both ends are inside
    assert group_problem(rollout(0, ok, completion(ok)), V) is None
    assert reference_problem(sample("r", ok, ok), V) is None
    outside = f"token ids span [{min(bad, 0)}, {max(bad, V - 1)}], outside the vocabulary [0, {V})"
    assert group_problem(rollout(0, ids(0, bad, V - 1), completion(ok)), V) == outside
    assert group_problem(rollout(0, ok, completion(ok), completion(ids(V - 1, bad, 0))), V) == outside
    # A reference sample's prompt and response are checked each on its own.
    assert reference_problem(sample("r", ids(0, bad, V - 1), ok), V) == outside
    assert reference_problem(sample("r", ok, ids(0, bad, V - 1)), V) == outside


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_log_prob_or_reward_is_named(value):
    lp = np.array([-0.5, value, -0.5])
    assert group_problem(rollout(0, ids(1), completion(ids(1, 2, 3)), completion(ids(1, 2, 3), lp)), V) \
        == "a non-finite log-prob"
    assert reference_problem(sample("r", ids(1), ids(1, 2, 3), lp), V) == "a non-finite log-prob"
    assert group_problem(rollout(0, ids(1), completion(ids(1)), completion(ids(2), score=value)), V) \
        == f"reward {value}"
    # The response's ids are judged before its log-probs.
    assert reference_problem(sample("r", ids(1), ids(1, V, 3), lp), V).startswith("token ids span")


def test_screen_names_each_record_it_took_out_and_logs_the_first_five(caplog):
    groups = [healthy(i, actor=2) for i in range(3)]
    groups[1] = rollout(1, ids(1, V), completion(ids(1)), actor=2)
    bad_refs = [sample(f"r{i}", ids(1), ids(2), np.array([np.nan])) for i in range(5)]
    batch = Batch(9, groups, [sample("ok", ids(1), ids(2)), *bad_refs], {})
    with caplog.at_level(logging.ERROR, logger="dph_async.learner.guard"):
        clean, removed = screen(batch, V)
    outside = f"token ids span [1, {V}], outside the vocabulary [0, {V})"
    assert removed == {"2/1": outside} | {f"r{i}": "a non-finite log-prob" for i in range(5)}
    assert [g.seq for g in clean.groups] == [0, 2] and [r.sample_id for r in clean.reference] == ["ok"]
    shown = "; ".join([f"2/1: {outside}", *(f"r{i}: a non-finite log-prob" for i in range(4))])
    assert caplog.messages == [f"learner: took 6 records out of batch 9: {shown}"]


def test_all_finite_is_false_for_any_non_finite_entry_of_any_tensor():
    assert all_finite([]) and all_finite([torch.zeros(3), torch.ones(2, 2)])
    assert not all_finite([torch.zeros(3), torch.tensor([1.0, float("nan")])])
    assert not all_finite([torch.tensor([float("-inf")]), torch.zeros(3)])


def test_non_finite_weights_are_named_up_to_three_then_elided():
    nan = torch.tensor([float("nan")])
    three = {"a": nan, "ok": torch.ones(1), "b": nan, "c": nan}
    with pytest.raises(NonFiniteTraining) as e:
        check_finite(three, 4)
    assert str(e.value) == ("learner: the weights of version 4 hold non-finite values in 3 tensors (a, b, c); "
                            "they are not published, the run stops")
    with pytest.raises(NonFiniteTraining, match=r"in 4 tensors \(a, b, c, \.\.\.\)"):
        check_finite(three | {"d": nan}, 4)


def batch_of(actor_groups: list[tuple[int, int]]) -> Batch:
    return Batch(0, [healthy(seq, actor) for actor, seq in actor_groups], [], {})


def test_the_step_guard_stops_at_exactly_max_skipped_batches_in_a_row_naming_every_source(caplog):
    guard = StepGuard(max_skipped=3)
    with caplog.at_level(logging.ERROR, logger="dph_async.learner.guard"):
        guard.after_batch(batch_of([(1, 0), (2, 1)]), 1, 5)
    assert caplog.messages == ["learner: batch 5: 1 updates skipped (non-finite loss or gradient); groups 1/0, 2/1"]
    guard.after_batch(batch_of([(2, 2), (2, 3), (1, 4)]), 2, 6)
    # The groups of every batch of the streak, not only the last one's.
    assert guard.groups == ["1/0", "2/1", "2/2", "2/3", "1/4"] and guard.sources == {1: 2, 2: 3}
    with pytest.raises(NonFiniteTraining) as e:
        guard.after_batch(batch_of([(2, 5)]), 1, 7)
    assert str(e.value) == (
        "learner: 3 batches in a row (up to version 7) had a non-finite loss or gradient; they came from "
        "actor 2 (4 groups), actor 1 (2 groups): groups 1/0, 2/1, 2/2, 2/3, 1/4, 2/5. Check the reward "
        "function and those actors; learner.max_skipped_steps sets how many in a row stop the run")
    assert guard.skipped_updates == 4


@pytest.mark.parametrize(("count", "tail"), [(12, ""), (13, " ...")])
def test_the_step_guards_error_names_twelve_groups_then_elides(count, tail):
    guard = StepGuard(max_skipped=1)
    with pytest.raises(NonFiniteTraining) as e:
        guard.after_batch(batch_of([(0, s) for s in range(count)]), 1, 1)
    named = ", ".join(f"0/{s}" for s in range(12))
    assert f"groups {named}{tail}. Check" in str(e.value)


def test_a_healthy_batch_forgets_the_streaks_groups():
    guard = StepGuard(max_skipped=2)
    guard.after_batch(batch_of([(1, 0)]), 1, 1)
    guard.after_batch(batch_of([(1, 1)]), 0, 2)
    assert (guard.in_a_row, guard.groups, dict(guard.sources)) == (0, [], {})
    guard.after_batch(batch_of([(3, 2)]), 1, 3)
    with pytest.raises(NonFiniteTraining, match=r"from actor 3 \(2 groups\): groups 3/2, 3/3\. Check"):
        guard.after_batch(batch_of([(3, 3)]), 1, 4)
