"""The scorer service's JSON bodies, one schema for both ends (msgspec).

POST /v1/score   {"requests": [{"data_source", "response", "ground_truth", "extra_info"}, ...],
                  "budget_s": 30.0}
            ->   {"results": [{"score", "correct", "format_ok", "status", "latency_s", "detail"}, ...]}
`budget_s` (optional) is how long the caller will wait: the service answers within it, marking what it
could not score in time.

`ground_truth` and `extra_info` stay encoded (`msgspec.Raw`) on the service's side: they are skipped
over, not built, and decoded only in the reward worker that scores the request (`JsonText`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from dph_async.rewards.result import RewardResult
from dph_async.rewards.worker import ScoreRequest

# The environment variable holding the shared token the service requires and the client sends.
TOKEN_ENV = "DPH_SCORER_TOKEN"


class ScoreItem(msgspec.Struct, forbid_unknown_fields=True):
    data_source: str
    response: str
    # Factories, not values: msgspec writes a field's default into the JSON schema (the scorer's
    # /openapi.json), and a Raw value has no JSON form there.
    ground_truth: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"null"))
    extra_info: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"{}"))

    @classmethod
    def from_request(cls, req: ScoreRequest) -> ScoreItem:
        return cls(req.data_source, req.response, msgspec.Raw(msgspec.json.encode(req.ground_truth)),
                   msgspec.Raw(msgspec.json.encode(req.extra_info or {})))


class ScoreBatch(msgspec.Struct, forbid_unknown_fields=True):
    requests: list[ScoreItem]
    budget_s: Annotated[float, msgspec.Meta(gt=0)] | None = None


class ScoreReply(msgspec.Struct):
    results: list[RewardResult]
