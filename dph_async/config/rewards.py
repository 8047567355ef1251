"""Reward scoring configuration: worker pool, deadlines, optional scorer services and LLM verifier."""

from pydantic import Field

from dph_async.config.base import Section


class RewardConfig(Section):
    # Worker processes per actor that score completions; each call has a deadline and can be killed.
    workers: int = Field(1, ge=1)
    timeout_s: float = Field(10.0, gt=0)
    memory_limit_mb: int = Field(1024, ge=64)
    # HTTP scorer services (`dph-async serve scorer`); empty means the local worker pool.
    scorer_urls: list[str] = Field(default_factory=list)
