"""Transport benchmark: the rollout wire protocol against bare ZeroMQ, pickle and memcpy.

`synthetic_group` makes rollout groups of realistic shape; the data-plane tests use it too.
"""

from __future__ import annotations

import numpy as np

from dph_async.protocol import Completion, RolloutGroup, SamplingInfo
from dph_async.rewards.result import RewardResult


def synthetic_group(
    actor_id: int,
    seq: int,
    n: int = 8,
    tokens: int = 16,
    version: int = 0,
    prompt_tokens: int = 32,
    rng: np.random.Generator | None = None,
) -> RolloutGroup:
    """A rollout group of realistic shape: n completions of `tokens` tokens (token ids, behaviour
    log-probs and per-token versions, all `version`), rewards alternating correct/wrong."""
    rng = rng or np.random.default_rng(seq)
    completions = [
        Completion(
            token_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
            logprobs=-rng.exponential(1.0, tokens).astype(np.float32),
            versions=np.full(tokens, version, dtype=np.int32),
            reward=RewardResult(float(i % 2), bool(i % 2)),
            finish_reason="stop",
        )
        for i in range(n)
    ]
    return RolloutGroup(
        actor_id=actor_id,
        seq=seq,
        prompt_id=f"prompt-{actor_id}-{seq}",
        data_source="synthetic",
        prompt_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
        completions=completions,
        sampling=SamplingInfo(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=tokens),
        created_at=0.0,
        finished_at=0.0,
    )
