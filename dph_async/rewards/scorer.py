"""What actors score with: inline-safe rewards in this process, the rest in the local worker pool or at
scorer services when `rewards.scorer_urls` is set (started on first use)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from dph_async.config.rewards import RewardConfig
from dph_async.rewards import context
from dph_async.rewards.client import ScorerClient
from dph_async.rewards.plugins import load_plugins
from dph_async.rewards.pool import RewardPool
from dph_async.rewards.registry import is_inline
from dph_async.rewards.result import RewardResult
from dph_async.rewards.worker import ScoreRequest, score_one


class Scorer(Protocol):
    def score_many(self, requests: list[ScoreRequest]) -> list[RewardResult]: ...

    def close(self) -> None: ...

    def __enter__(self) -> Scorer: ...

    def __exit__(self, *exc: object) -> None: ...


class RoutingScorer:
    """Scores requests whose reward is registered inline here, and sends the others to a remote scorer
    (worker pool or services) made on first need: a run whose rewards are all inline starts no worker."""

    def __init__(self, cfg: RewardConfig, make_remote: Callable[[], Scorer]) -> None:
        self.cfg, self._make_remote = cfg, make_remote
        self._remote: Scorer | None = None
        if cfg.inline:
            context.configure(cfg)

    def score_many(self, requests: list[ScoreRequest]) -> list[RewardResult]:
        inline = [self.cfg.inline and is_inline(r.data_source) for r in requests]
        remote = [r for r, here in zip(requests, inline, strict=True) if not here]
        if remote and self._remote is None:
            self._remote = self._make_remote()
        remote_results = iter(self._remote.score_many(remote) if remote else [])
        return [score_one(r) if here else next(remote_results) for r, here in zip(requests, inline, strict=True)]

    def close(self) -> None:
        if self._remote is not None:
            self._remote.close()
            self._remote = None

    def __enter__(self) -> RoutingScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_scorer(cfg: RewardConfig) -> Scorer:
    # The plugins' rewards must be known here too: the router asks which are inline.
    load_plugins(cfg.plugins)
    if cfg.scorer_urls:
        def remote() -> Scorer:
            return ScorerClient(cfg.scorer_urls, timeout_s=cfg.client_timeout_s, retries=cfg.client_retries,
                                batch_size=cfg.client_batch_size)
    else:
        def remote() -> Scorer:
            return RewardPool(cfg.workers, cfg.timeout_s, cfg.memory_limit_mb, config=cfg)
    return RoutingScorer(cfg, remote)
