"""What a reward function may ask of the process it runs in: the reward config and its deadline.

Reward functions keep the verl signature `fn(response, ground_truth, extra_info)`, so settings that
are not per sample (the SQL database root, the verifier endpoint) and the time left for this call come
from here. A pool worker sets both before each call; code calling a reward directly gets the defaults.
"""

from __future__ import annotations

import time

from dph_async.config.rewards import RewardConfig

_config = RewardConfig()
_deadline: float | None = None


def configure(cfg: RewardConfig) -> None:
    """Set the reward config for this process."""
    global _config
    _config = cfg


def config() -> RewardConfig:
    return _config


def set_deadline(deadline: float | None) -> None:
    """Set the `time.monotonic()` instant by which the current call must finish (None: the config's)."""
    global _deadline
    _deadline = deadline


def deadline() -> float:
    """When the current call must be done, as a `time.monotonic()` instant."""
    return _deadline if _deadline is not None else time.monotonic() + _config.timeout_s


def time_left() -> float:
    return max(0.0, deadline() - time.monotonic())
