"""What actors score with: the local worker pool, or scorer services when `rewards.scorer_urls` is set."""

from __future__ import annotations

from typing import Protocol

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.client import ScorerClient
from dph_async.rewards.pool import RewardPool
from dph_async.rewards.result import RewardResult
from dph_async.rewards.worker import ScoreRequest


class Scorer(Protocol):
    def score_many(self, requests: list[ScoreRequest]) -> list[RewardResult]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Scorer: ...

    def __exit__(self, *exc: object) -> None: ...


def make_scorer(cfg: RewardConfig) -> Scorer:
    if cfg.scorer_urls:
        return ScorerClient(cfg.scorer_urls, timeout_s=cfg.client_timeout_s, retries=cfg.client_retries,
                            batch_size=cfg.client_batch_size)
    return RewardPool(cfg.workers, cfg.timeout_s, cfg.memory_limit_mb, config=cfg)
