"""The replay refuses every record the learner must not see, counted by reason, and no peer can take
the store or the tickets from the others (replay/validation.py, the budgets in replay/core.py)."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import numpy as np
import pytest

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, TicketRequest
from dph_async.replay import validation
from dph_async.replay.core import ReplayCore
from dph_async.replay.service import ReplayService
from dph_async.replay_client import RolloutSender
from dph_async.tools.bench.transport import synthetic_group

VOCAB = 1000


def core(**cfg) -> ReplayCore:
    defaults = {"wal_dir": None, "admission": False, "vocab_size": VOCAB, "max_sequence_tokens": 64}
    return ReplayCore(ReplayConfig(**(defaults | cfg)), groups_per_batch=4)


def good(seq: int, n: int = 4, tokens: int = 6, version: int = 0, actor: int = 0):
    g = synthetic_group(actor, seq, n=n, tokens=tokens, version=version, prompt_tokens=8)
    g.prompt_ids = g.prompt_ids % VOCAB
    for c in g.completions:
        c.token_ids = c.token_ids % VOCAB
    return g


def _set(array: np.ndarray, i: int, value) -> np.ndarray:
    out = array.copy()
    out[i] = value
    return out


def poison(kind: str, g, completion: int):
    """One bad value in completion `completion` (or in the group's own fields)."""
    c = g.completions[completion]
    if kind == "token_id":
        c.token_ids = _set(c.token_ids, 2, VOCAB)
    elif kind == "huge_token_id":
        c.token_ids = _set(c.token_ids, 0, 2**31 - 1)
    elif kind == "prompt_token_id":
        g.prompt_ids = _set(g.prompt_ids, 1, VOCAB + 5)
    elif kind == "nan_logprob":
        c.logprobs = _set(c.logprobs, 1, np.nan)
    elif kind == "positive_logprob":
        c.logprobs = _set(c.logprobs, 1, 0.5)
    elif kind == "far_future_version":
        c.versions = _set(c.versions, 3, 10**9)
    elif kind == "negative_version":
        c.versions = _set(c.versions, 0, -1)
    elif kind in ("nan_reward", "inf_reward", "huge_reward"):
        score = {"nan_reward": math.nan, "inf_reward": -math.inf, "huge_reward": 1e308}[kind]
        c.reward = dataclasses.replace(c.reward, score=score)
    elif kind in ("nan_temperature", "zero_top_p", "negative_top_k"):
        field, value = {"nan_temperature": ("temperature", math.nan), "zero_top_p": ("top_p", 0.0),
                        "negative_top_k": ("top_k", -5)}[kind]
        g.sampling = msgspec.structs.replace(g.sampling, **{field: value})
    elif kind == "nan_timestamp":
        g.created_at = math.nan
    elif kind == "finished_before_created":
        g.created_at, g.finished_at = 10.0, 5.0
    elif kind == "longer_than_max_tokens":
        g.sampling = msgspec.structs.replace(g.sampling, max_tokens=len(c.token_ids) - 1)
    elif kind == "past_the_context":
        g.prompt_ids = np.zeros(65, np.int32)  # with the response, one token past the context
    return g


CASES = {
    "token_id": "token_id", "huge_token_id": "token_id", "prompt_token_id": "token_id",
    "nan_logprob": "logprob", "positive_logprob": "logprob",
    "far_future_version": "version", "negative_version": "version",
    "nan_reward": "reward", "inf_reward": "reward", "huge_reward": "reward",
    "nan_temperature": "sampling", "zero_top_p": "sampling", "negative_top_k": "sampling",
    "nan_timestamp": "timestamp", "finished_before_created": "timestamp",
    "longer_than_max_tokens": "length", "past_the_context": "length",
}


@pytest.mark.parametrize("tokens", [6, 5000], ids=["joined", "per_completion"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_bad_value_is_refused_with_its_reason_and_counted(kind, tokens):
    """Small groups are checked with their completions joined, large ones one by one: both paths."""
    c = core(max_sequence_tokens=None if kind != "past_the_context" else 64 + tokens)
    bad = poison(kind, good(1, tokens=tokens), completion=2)
    (verdict,) = c.ingest([bad])
    reason = CASES[kind]
    assert verdict.status == "error" and verdict.error.startswith(f"{reason}: "), verdict.error
    if kind not in ("prompt_token_id", "nan_temperature", "zero_top_p", "negative_top_k", "nan_timestamp",
                    "finished_before_created", "past_the_context", "longer_than_max_tokens"):
        assert "completions[2]" in verdict.error  # the detail names the completion
    assert c.stats().refused.by_kind == {f"invalid_{reason}": 1}
    assert c.stats().accepted == 0 and bad.group_id not in c.accepted  # refused: the actor may send it again


def test_good_groups_around_bad_ones_are_accepted_and_served_untouched():
    c = core()
    groups = [good(0), poison("nan_reward", good(1), 0), good(2), poison("huge_token_id", good(3), 3), good(4)]
    verdicts = c.ingest(groups)
    assert [v.status for v in verdicts] == ["ok", "error", "ok", "error", "ok"]
    batch = c.request(BatchRequest(0, 10, 0.0, request_id=1))
    assert sorted(g.seq for g in batch.groups) == [0, 2, 4]
    assert all(np.isfinite(comp.reward.score) and comp.token_ids.max() < VOCAB
               for g in batch.groups for comp in g.completions)


def test_versions_may_lead_the_learner_by_the_allowed_lead_only():
    c = core(max_version_lead=1)
    c.request(BatchRequest(5, 1, 0.0, request_id=1))  # the learner is at version 5
    ok, ahead, far = good(0, version=6), good(1, version=7), good(2, version=10**9)
    assert [v.status for v in c.ingest([ok, ahead, far])] == ["ok", "error", "error"]
    assert c.stats().refused.by_kind == {"invalid_version": 2}


def test_the_store_has_a_byte_budget_and_answers_retry_past_it():
    # 0.1 MiB; held, a group of 4 x 6000 tokens costs ~0.3 MiB, one of 4 x 6 ~7 KiB
    c = core(max_store_mb=0.1, max_sequence_tokens=None)
    big = good(0, tokens=6000)
    assert c.ingest([big])[0].status == "retry"
    small = [good(i + 1) for i in range(10)]
    assert {v.status for v in c.ingest(small)} == {"ok"}
    assert c.store.cost <= 0.1 * 2**20
    assert c.stats().refused.by_kind == {} and c.metrics.counters["deferred:store_full"] == 1
    assert big.group_id not in c.accepted  # deferred, not accepted: the sender keeps it


def test_ticketless_groups_cannot_freeze_the_grants_of_honest_actors():
    """Measured before the budget: eight small ticketless groups took honest actors' grants from 4 to 0."""
    c = core(admission=True, max_staleness=1)  # capacity (eta + 1) x B = 8
    flood = [good(i, actor=99) for i in range(12)]
    verdicts = c.ingest(flood)
    assert [v.status for v in verdicts] == ["ok"] * 4 + ["retry"] * 8  # one batch of them at a time
    assert c.metrics.counters["deferred:no_ticket"] == 8
    grant = c.tickets(TicketRequest(actor_id=1, want=8)).granted
    assert grant == 8  # the flood takes none of the capacity
    honest = [good(i, actor=1) for i in range(grant)]
    assert {v.status for v in c.ingest(honest)} == {"ok"}  # ticketed groups pass whatever the flood
    # Served, the ticketless groups do count (they used batch slots), and free room for more of them.
    c.request(BatchRequest(0, 4, 0.0, request_id=1))
    assert not c.ticketless.keys() & {g.group_id for g in flood[:4]}


def test_ticketless_groups_hold_a_few_megabytes_at_most():
    """Measured before the budget: 16 ticketless groups of 60 MB took the replay from 126 to 1,087 MB."""
    c = core(admission=True, max_sequence_tokens=None, max_ticketless_mb=0.1)
    groups = [good(i, tokens=2000, actor=99) for i in range(6)]  # ~94 KiB each
    assert [v.status for v in c.ingest(groups)] == ["ok"] + ["retry"] * 5
    assert sum(c.ticketless.values()) <= 0.1 * 2**20


def test_without_admission_every_group_is_ticketless_and_only_the_byte_budget_applies():
    c = core(admission=False)
    assert {v.status for v in c.ingest([good(i, actor=5) for i in range(20)])} == {"ok"}
    assert c.admitted == 20


def test_a_sender_told_to_retry_keeps_its_group_and_it_is_accepted_once_there_is_room(tmp_path):
    cfg = ReplayConfig(admission=True, max_staleness=1, vocab_size=VOCAB)
    service = ReplayService(cfg, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 4)
    service.start_in_thread()
    try:
        sender = RolloutSender(service.ingest_endpoint, 7, token=service.actor_token, reply_timeout_s=5.0)
        for seq in range(6):  # no tickets: four fit the ticketless budget, two are told to retry
            sender.send(good(seq, actor=7))
        client = service.local_client()
        deadline_hit = not _wait(lambda: sender.deferred >= 2 and sender.unacked == 2, sender)
        assert not deadline_hit, (sender.deferred, sender.unacked)
        batch = client.get_batch(0, 4, wait_s=5.0)  # serving four frees the budget
        assert len(batch.groups) == 4
        assert sender.flush(30) and sender.accepted == 6 and not sender.rejected
        client.close()
        sender.close()
    finally:
        service.stop()


def _wait(condition, sender: RolloutSender, timeout_s: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sender.poll(0.05)
        if condition():
            return True
    return False


def _sampling(g, **fields):
    g.sampling = msgspec.structs.replace(g.sampling, **fields)
    return g


MAX = validation.MAX_INT32
# (what, the largest value that passes, its reason one past it); each is checked at and one past it.
BOUNDS = {
    "top_k": (lambda g, v: _sampling(g, top_k=v), MAX, "sampling"),
    "max_tokens": (lambda g, v: _sampling(g, max_tokens=v), MAX, "sampling"),
    "prompt_id": (lambda g, v: setattr(g, "prompt_id", "p" * v) or g, validation.MAX_NAME, "text"),
    "data_source": (lambda g, v: setattr(g, "data_source", "d" * v) or g, validation.MAX_NAME, "text"),
    "finish_reason": (lambda g, v: setattr(g.completions[1], "finish_reason", "f" * v) or g, validation.MAX_NAME,
                      "text"),
    "reward_detail": (lambda g, v: setattr(g.completions[1], "reward", dataclasses.replace(
        g.completions[1].reward, detail="x" * v)) or g, validation.MAX_DETAIL, "text"),
}


@pytest.mark.parametrize("what", sorted(BOUNDS))
def test_every_number_and_text_a_group_carries_passes_at_its_bound_and_is_refused_one_past(what):
    """Before the bounds a ticketless, unauthenticated group with top_k or max_tokens = 2^64 - 1 was
    acknowledged, and every snapshot and restart after it died storing it as int64."""
    set_value, bound, reason = BOUNDS[what]
    c = core(max_sequence_tokens=None)
    at, past = set_value(good(0), bound), set_value(good(1), bound + 1)
    assert [v.status for v in c.ingest([at, past])] == ["ok", "error"]
    assert c.stats().refused.by_kind == {f"invalid_{reason}": 1}
    if what in ("top_k", "max_tokens"):  # what the hostile peer sent: 2^63 and 2^64 - 1
        huge = [set_value(good(2), 2**63), set_value(good(3), 2**64 - 1)]
        assert [v.status for v in c.ingest(huge)] == ["error", "error"]


def test_a_prompt_of_no_tokens_is_refused():
    """The learner cannot score a response with no prompt before it (learner/logprobs.py)."""
    c = core()
    empty, one = good(0), good(1)
    empty.prompt_ids, one.prompt_ids = np.zeros(0, np.int32), np.ones(1, np.int32)
    (refused, accepted) = c.ingest([empty, one])
    assert refused.status == "error" and refused.error.startswith("length: ") and accepted.status == "ok"


@pytest.mark.parametrize("context", [64, None], ids=["configured", "default"])
def test_a_response_cut_at_the_context_limit_fits_and_one_token_more_does_not(context, monkeypatch):
    """vLLM stops a response when prompt + response reach the context: that exact fit is a group to
    train on, not a `length` refusal."""
    monkeypatch.setattr(validation, "MAX_SEQUENCE_TOKENS", 64)  # the bound without replay.max_sequence_tokens
    c = core(max_sequence_tokens=context)
    fits, past = good(0, tokens=56), good(1, tokens=57)  # prompts of 8 tokens
    assert [v.status for v in c.ingest([fits, past])] == ["ok", "error"]
    assert c.stats().refused.by_kind == {"invalid_length": 1}


def test_a_response_of_exactly_max_tokens_fits_and_one_more_does_not():
    c = core()
    fits, past = good(0, tokens=6), good(1, tokens=6)
    _sampling(fits, max_tokens=6), _sampling(past, max_tokens=5)
    assert [v.status for v in c.ingest([fits, past])] == ["ok", "error"]


def _reward(g, score: float):
    g.completions[1].reward = dataclasses.replace(g.completions[1].reward, score=score)
    return g


def _logprob(g, value: float):
    g.completions[1].logprobs = _set(g.completions[1].logprobs, 0, value)
    return g


# (what, a value that passes at the edge, the nearest value that does not, its reason); the other
# edges of BOUNDS, where a mutated comparison (< for <=, 2 for 1) changes one value's verdict.
EDGES = {
    "temperature_max": (lambda g, v: _sampling(g, temperature=v), validation.MAX_TEMPERATURE,
                        validation.MAX_TEMPERATURE * 1.0001, "sampling"),
    "temperature_zero": (lambda g, v: _sampling(g, temperature=v), 1e-6, 0.0, "sampling"),
    "top_p": (lambda g, v: _sampling(g, top_p=v), 1.0, 1.0001, "sampling"),
    "top_k": (lambda g, v: _sampling(g, top_k=v), -1, -2, "sampling"),
    "max_tokens": (lambda g, v: _sampling(g, max_tokens=v), 6, 0, "sampling"),  # responses of 6 tokens
    "reward": (_reward, 1e6, 1e6 * 1.0001, "reward"),  # replay.max_abs_reward's default
    "logprob_max": (_logprob, 1e-3, 1.001e-3, "logprob"),  # replay.logprob_tolerance: rounding above 0
    "logprob_inf": (_logprob, -1e30, -math.inf, "logprob"),
}


@pytest.mark.parametrize("what", sorted(EDGES))
def test_each_range_holds_its_own_edge_and_refuses_the_next_value(what):
    set_value, at, past, reason = EDGES[what]
    c = core(max_sequence_tokens=None)
    assert [v.status for v in c.ingest([set_value(good(0), at), set_value(good(1), past)])] == ["ok", "error"]
    assert c.stats().refused.by_kind == {f"invalid_{reason}": 1}


def test_a_single_token_response_is_within_max_tokens_one():
    c = core()
    g = _sampling(good(0, tokens=1), max_tokens=1)
    assert c.ingest([g])[0].status == "ok"


# (case, what the refusal's detail must name: the field and the value the peer sent)
DETAILS = {
    "top_p": (lambda g: _sampling(g, top_p=3.5), ["top_p 3.5", "]: not all hold"]),
    "prompt_id": (lambda g: setattr(g, "prompt_id", "p" * 2000) or g, ["text: prompt_id of 2000 characters"]),
    "data_source": (lambda g: setattr(g, "data_source", "d" * 2000) or g, ["text: data_source of 2000 characters"]),
    "finish_reason": (lambda g: setattr(g.completions[1], "finish_reason", "f" * 2000) or g,
                      ["completions[1].finish_reason", "2000"]),
    "reward_detail": (lambda g: setattr(g.completions[1], "reward", dataclasses.replace(
        g.completions[1].reward, detail="x" * (validation.MAX_DETAIL + 1))) or g, ["completions[1].reward.detail of"]),
    "reward": (lambda g: _reward(g, 7e9), ["reward.score 7000000000", " (replay.max_abs_reward)"]),
    "timestamp": (lambda g: setattr(g, "created_at", 9.0) or setattr(g, "finished_at", 3.0) or g,
                  ["created_at 9.0", "finished_at 3.0"]),
    "prompt_token": (lambda g: setattr(g, "prompt_ids", _set(g.prompt_ids, 1, VOCAB + 5)) or g,
                     ["prompt_ids", str(VOCAB + 5), f"[0, {VOCAB})"]),
    "token": (lambda g: setattr(g.completions[1], "token_ids", _set(g.completions[1].token_ids, 0, VOCAB)) or g,
              ["completions[1]", str(VOCAB)]),
    "logprob": (lambda g: _logprob(g, 0.5), ["completions[1]", "max 0.5"]),
    "version": (lambda g: setattr(g.completions[1], "versions", _set(g.completions[1].versions, 0, 77)) or g,
                ["completions[1]", "77"]),
    "length": (lambda g: _sampling(g, max_tokens=3), ["a response of 6 tokens", "max_tokens 3"]),
}


@pytest.mark.parametrize("what", sorted(DETAILS))
def test_every_refusal_names_the_field_and_the_value_the_peer_sent(what):
    """An operator reads the refusal in the actor's log and the replay's counters: it says what to fix."""
    make, names = DETAILS[what]
    (verdict,) = core(max_sequence_tokens=None).ingest([make(good(0))])
    assert verdict.status == "error" and all(n in verdict.error for n in names), verdict.error


def test_without_a_vocabulary_a_negative_id_is_refused_against_the_int32_range():
    (verdict,) = core(vocab_size=None).ingest([_negative_token(good(0))])
    assert verdict.status == "error" and verdict.error.startswith("token_id: ") and f"[0, {2**31})" in verdict.error


def _negative_token(g):
    g.completions[1].token_ids = _set(g.completions[1].token_ids, 0, -4)
    return g
