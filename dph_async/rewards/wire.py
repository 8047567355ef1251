"""The scorer service's JSON bodies, validated on both ends.

POST /v1/score   {"requests": [{"data_source", "response", "ground_truth", "extra_info"}, ...],
                  "budget_s": 30.0}
            ->   {"results": [{"score", "correct", "format_ok", "status", "latency_s", "detail"}, ...]}
`budget_s` (optional) is how long the caller will wait: the service answers within it, marking what it
could not score in time as "timeout".
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from dph_async.rewards.result import RewardResult
from dph_async.rewards.worker import ScoreRequest

# The environment variable holding the shared token the service requires and the client sends.
TOKEN_ENV = "DPH_SCORER_TOKEN"


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_source: str
    response: str
    ground_truth: Any = None
    extra_info: dict[str, Any] = Field(default_factory=dict)

    def to_request(self) -> ScoreRequest:
        return ScoreRequest(self.data_source, self.response, self.ground_truth, self.extra_info)

    @classmethod
    def from_request(cls, req: ScoreRequest) -> ScoreItem:
        return cls(data_source=req.data_source, response=req.response, ground_truth=req.ground_truth,
                   extra_info=req.extra_info or {})


class ScoreBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    requests: list[ScoreItem]
    budget_s: float | None = Field(None, gt=0)


class ScoreReply(BaseModel):
    results: list[RewardResult]
