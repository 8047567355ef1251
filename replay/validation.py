"""What a rollout group must hold before the replay accepts it: everything the learner trusts.

The protocol's decoder has already checked types, shapes and lengths (dph_async/protocol.py). This
checks values against the run: a group that passes is safe for every step behind the replay. A
group that fails is refused before it is logged, with a reason (`Refusal.reason`, one of REASONS,
counted as `rejected:invalid_<reason>`) and a detail naming the field:

    token_id   a prompt or response token id outside [0, vocab_size)
    logprob    a behaviour log-prob that is NaN, infinite or > 0 (beyond float rounding)
    version    a token version < 0, or newer than the learner's version plus the allowed lead
    reward     a reward that is NaN, infinite, or larger in size than the bound
    sampling   a temperature, top-p, top-k or max_tokens no sampler uses
    length     an empty prompt, a response longer than its max_tokens, or prompt + response past
               the model's context (MAX_SEQUENCE_TOKENS when the replay is not told it)
    timestamp  a creation or finish time that is not a finite time since the epoch, or out of order
    text       a name (prompt_id, data_source, finish_reason) or reward detail longer than its bound

Every number and length is bounded above as well as below: what passes is stored as int64 and
int32 Arrow columns (replay/records.py) and summed by the learner, so nothing a peer sends may
reach their limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import Completion, RolloutGroup

REASONS = ("token_id", "logprob", "version", "reward", "sampling", "length", "timestamp", "text")
# Below this many tokens a group's completions are checked joined: numpy's per-call cost dominates.
SMALL_GROUP_TOKENS = 1 << 14
MAX_TEMPERATURE = 100.0
MAX_INT32 = (1 << 31) - 1  # top_k, max_tokens: what vLLM takes
# Prompt + response without a configured context (replay.max_sequence_tokens): beyond any model's.
MAX_SEQUENCE_TOKENS = 1 << 24
MAX_NAME = 1024  # characters of prompt_id, data_source, finish_reason
MAX_DETAIL = 1 << 16  # characters of a reward's detail


@dataclass(frozen=True)
class Refusal:
    reason: str
    detail: str


def _token_problem(ids: np.ndarray, bounds: ReplayConfig) -> str | None:
    if not ids.size:
        return None
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or (bounds.vocab_size is not None and hi >= bounds.vocab_size):
        return f"token ids span [{lo}, {hi}]; the vocabulary is [0, {bounds.vocab_size or 2**31})"
    return None


def _arrays_problem(token_ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, bounds: ReplayConfig,
                    version: int) -> Refusal | None:
    if (problem := _token_problem(token_ids, bounds)) is not None:
        return Refusal("token_id", problem)
    lo, hi = logprobs.min(), logprobs.max()
    if not (lo > -np.inf and hi <= bounds.logprob_tolerance):  # NaN fails both comparisons
        return Refusal("logprob", f"logprobs must be finite and <= 0 (min {lo}, max {hi})")
    newest = version + bounds.max_version_lead
    if versions.min() < 0 or versions.max() > newest:
        return Refusal("version", f"versions span [{versions.min()}, {versions.max()}]; the learner is at "
                                  f"{version} and actors may be at most {bounds.max_version_lead} ahead")
    return None


def _too_long(name: str, text: str, limit: int) -> Refusal | None:
    return Refusal("text", f"{name} of {len(text)} characters exceeds {limit}") if len(text) > limit else None


def _completion_problem(c: Completion, bounds: ReplayConfig) -> Refusal | None:
    """What is wrong with a completion's scalars (its arrays are checked joined, or by _arrays_problem)."""
    score = c.reward.score
    if not (math.isfinite(score) and abs(score) <= bounds.max_abs_reward):
        return Refusal("reward", f"reward.score {score} is not a finite number within +-{bounds.max_abs_reward:g} "
                                 "(replay.max_abs_reward)")
    return _too_long("finish_reason", c.finish_reason, MAX_NAME) or _too_long("reward.detail", c.reward.detail,
                                                                                MAX_DETAIL)


def _group_problem(group: RolloutGroup, bounds: ReplayConfig) -> Refusal | None:
    s = group.sampling
    if not (0.0 < s.temperature <= MAX_TEMPERATURE and 0.0 < s.top_p <= 1.0 and -1 <= s.top_k <= MAX_INT32
            and 1 <= s.max_tokens <= MAX_INT32):
        return Refusal("sampling", f"temperature {s.temperature} (0, {MAX_TEMPERATURE}], top_p {s.top_p} (0, 1], "
                                   f"top_k {s.top_k} [-1, {MAX_INT32}], max_tokens {s.max_tokens} [1, {MAX_INT32}]: "
                                   "not all hold")
    if refusal := _too_long("prompt_id", group.prompt_id, MAX_NAME) or _too_long("data_source", group.data_source,
                                                                                 MAX_NAME):
        return refusal
    created, finished = group.created_at, group.finished_at
    if not (math.isfinite(created) and math.isfinite(finished) and 0.0 <= created <= finished):
        return Refusal("timestamp", f"created_at {created}, finished_at {finished}: need 0 <= created <= finished")
    if (problem := _token_problem(group.prompt_ids, bounds)) is not None:
        return Refusal("token_id", f"prompt_ids: {problem}")
    prompt, longest = len(group.prompt_ids), max(len(c.token_ids) for c in group.completions)
    context = bounds.max_sequence_tokens or MAX_SEQUENCE_TOKENS
    if prompt == 0 or longest > s.max_tokens or prompt + longest > context:
        return Refusal("length", f"a response of {longest} tokens after a prompt of {prompt}; need a prompt, "
                                 f"max_tokens {s.max_tokens}, context {context}")
    return None


def problem(group: RolloutGroup, bounds: ReplayConfig, version: int) -> Refusal | None:
    """Why the learner at `version` must not see this well-formed group, or None."""
    if (refusal := _group_problem(group, bounds)) is not None:
        return refusal
    comps = group.completions
    for i, c in enumerate(comps):
        if (refusal := _completion_problem(c, bounds)) is not None:
            return Refusal(refusal.reason, f"completions[{i}].{refusal.detail}")
    if len(comps) > 1 and group.num_tokens <= SMALL_GROUP_TOKENS:
        joined = (np.concatenate([getattr(c, f) for c in comps]) for f in ("token_ids", "logprobs", "versions"))
        if _arrays_problem(*joined, bounds, version) is None:
            return None
    for i, c in enumerate(comps):  # which completion: only once something is wrong, or for large groups
        if (refusal := _arrays_problem(c.token_ids, c.logprobs, c.versions, bounds, version)) is not None:
            return Refusal(refusal.reason, f"completions[{i}].{refusal.detail}")
    return None
