"""A fault injector for the chaos test: one actor also sends poisoned copies of its groups.

Off unless the environment says otherwise (the product never sets it): with DPH_TEST_POISON_EVERY=k,
actor 0 follows every k-th group it sends with a poisoned copy under a position no real prompt has
(the group's seq + POISON_SEQ), cycling through what a hostile peer or a buggy reward function can
produce. The replay must refuse each one, count it by reason, and train on the rest untouched.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

import msgspec
import numpy as np

from dph_async.protocol import RolloutGroup

ENV = "DPH_TEST_POISON_EVERY"
POISON_SEQ = 1 << 48  # far above any position an actor reaches, so a copy never takes a real one's id
POISONS = ("huge_token_id", "nan_reward", "future_version")


def _copy(group: RolloutGroup, kind: str, seq: int) -> RolloutGroup:
    comps = list(group.completions)
    c = comps[0]
    if kind == "huge_token_id":
        comps[0] = msgspec.structs.replace(c, token_ids=np.full_like(c.token_ids, 2**31 - 1))
    elif kind == "nan_reward":
        comps[0] = msgspec.structs.replace(c, reward=replace(c.reward, score=math.nan))
    else:
        comps[0] = msgspec.structs.replace(c, versions=np.full_like(c.versions, 10**9))
    return msgspec.structs.replace(group, seq=seq, completions=comps)


class Faults:
    def __init__(self, every: int) -> None:
        self.every = every
        self.sent = 0

    @classmethod
    def from_env(cls, actor_id: int) -> Faults | None:
        every = int(os.environ.get(ENV, "0") or 0)
        return cls(every) if every > 0 and actor_id == 0 else None

    def copies(self, group: RolloutGroup) -> list[RolloutGroup]:
        """The poisoned copies to send after `group` (none for most groups)."""
        self.sent += 1
        if self.sent % self.every:
            return []
        kind = POISONS[(self.sent // self.every - 1) % len(POISONS)]
        return [_copy(group, kind, group.seq + POISON_SEQ)]
