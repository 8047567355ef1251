"""What a reward function may ask of the process it runs in, and what it tells it.

Reward functions keep the verl signature `fn(response, ground_truth, extra_info)`, so settings that
are not per sample (the SQL database root, the verifier endpoint) and the time left for this call come
from here. A pool worker sets both before each call; code calling a reward directly gets the defaults.

A reward also says what it is doing (`stage`): checking the reference (running the gold query,
parsing the reference answer) or the response, and whether the response had the expected format. A
pool worker passes that on to its parent as it happens, so a worker killed at the deadline is blamed
right: a reference that had to be killed is the dataset's `error`, not the response's `timeout`, and
a killed response keeps the format_ok it had earned.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

from dph_async.config.rewards import RewardConfig

Stage = Literal["reference", "response"]

_config = RewardConfig()
_deadline: float | None = None
_listener: Callable[[Stage, bool], None] | None = None


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


def on_stage(listener: Callable[[Stage, bool], None] | None) -> None:
    """Have `listener(stage, format_ok)` called at every `stage` report (a pool worker sets this)."""
    global _listener
    _listener = listener


def stage(now: Stage, format_ok: bool) -> None:
    """Report what the reward is doing from now on, and whether the response's format was right."""
    if _listener is not None:
        _listener(now, format_ok)
