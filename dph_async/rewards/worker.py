"""The reward worker process: resource limits, then a loop scoring one request at a time.

A worker is a `Child` (dph_async/rewards/child.py): a fresh interpreter in its own process group with
a capped address space and no right to write a file. Rewards run model-written SQL and feed
model-written math to parsers that can hang; the worker is the unit the parent kills when a call
overruns.

Messages to the parent, JSON: {"stage": "reference" | "response", "format_ok": bool} while scoring
(what the reward reported through `context.stage`, so that a kill is blamed right), then
{"result": {RewardResult fields}}.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from dph_async.config.rewards import RewardConfig
from dph_async.rewards import context
from dph_async.rewards.child import limit_resources
from dph_async.rewards.plugins import PluginError, load_plugins
from dph_async.rewards.registry import UnknownDataSource, get_reward_fn, load_builtins
from dph_async.rewards.result import RewardResult, checked, failure, origin

# The worker's own deadline comes a little before the parent's kill, so that a query which merely
# runs long (a recursive CTE) ends cleanly with status "timeout" instead of costing a new process.
SOFT_DEADLINE_SHARE = 0.9


class JsonText(bytes):
    """A JSON value not decoded yet. The scorer service leaves each request's ground_truth and
    extra_info encoded, so only the worker, under its memory limit, builds them: a nested bomb costs
    a worker, never the service."""


@dataclass
class ScoreRequest:
    """One response to score; `ground_truth` and `extra_info` are the dataset row's fields."""

    data_source: str
    response: str
    ground_truth: Any
    extra_info: dict | JsonText


def _decoded(value: Any, what: str) -> Any:
    if not isinstance(value, JsonText):
        return value
    try:
        return json.loads(value)
    except RecursionError:
        raise ValueError(f"{what} is nested too deep") from None
    except MemoryError:
        raise ValueError(f"{what} is too large to decode within the worker's memory limit") from None


def score_one(req: ScoreRequest) -> RewardResult:
    """Score one request in this process, turning every failure into a status."""
    start = time.perf_counter()
    limit = context.config().max_response_chars
    try:
        ground_truth = _decoded(req.ground_truth, "ground_truth")
        extra_info = _decoded(req.extra_info, "extra_info") or {}
        if not isinstance(extra_info, dict):
            raise ValueError(f"extra_info must be an object, got {type(extra_info).__name__}")
    except ValueError as e:  # the caller's data, not the response: no information about it
        return replace(failure("error", str(e)), latency_s=time.perf_counter() - start)
    if not isinstance(req.response, str):
        result = failure("error", f"response must be a string, got {type(req.response).__name__}")
    elif len(req.response) > limit:
        result = failure("rejected", f"response has {len(req.response)} characters; the limit is {limit}")
    else:
        result = _call(req.data_source, req.response, ground_truth, extra_info)
    return replace(result, latency_s=time.perf_counter() - start)


def _call(data_source: str, response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    """The reward for `data_source` applied, its failures turned into statuses and its result checked."""
    try:
        fn = get_reward_fn(data_source)
    except UnknownDataSource as e:
        return failure("error", f"{type(e).__name__}: {e}"[:500])
    try:
        return checked(fn(response, ground_truth, extra_info), fn)
    except MemoryError:
        return failure("rejected", "memory limit reached while scoring")
    except RecursionError:
        return failure("rejected", "nesting too deep to score")
    except SystemExit as e:  # a reward must not end the process that scores (an actor, when inline)
        return failure("error", f"{origin(fn)} raised SystemExit({e.code!r}); a reward function must return a "
                                "RewardResult, never exit")
    except Exception as e:
        return failure("error", f"{origin(fn)} raised {_described(e)}"[:500])


def _described(e: Exception) -> str:
    """`Type: message`; the message of the reward's own exception class may itself raise."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:
        return f"{type(e).__name__} (whose message could not be read)"


def serve(conn: Connection, memory_limit_mb: int) -> None:
    """Take the reward config, then serve (budget_s, ScoreRequest) messages until the pipe closes.

    Requests arrive pickled from the parent (trusted); results go back as JSON, so the parent never
    unpickles anything produced while handling model output.
    """
    cfg = RewardConfig.model_validate_json(conn.recv_bytes())
    context.configure(cfg)
    load_builtins()
    try:
        load_plugins(cfg.plugins, probe=False)  # the process that started this worker probed them
    except PluginError as e:
        conn.send_bytes(f"error: {e}".encode())  # the parent puts it in its RuntimeError
        return
    limit_resources(memory_limit_mb)
    context.on_stage(lambda stage, format_ok: conn.send_bytes(
        json.dumps({"stage": stage, "format_ok": format_ok}).encode()))
    conn.send_bytes(b"ready")
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        budget_s, req = message
        context.set_deadline(time.monotonic() + SOFT_DEADLINE_SHARE * budget_s)
        conn.send_bytes(json.dumps({"result": asdict(score_one(req))}).encode())


if __name__ == "__main__":
    # python -m dph_async.rewards.worker <socket fd> <memory limit MB>
    # Run the package's copy of this module, not __main__'s, so pickled classes are the same ones.
    from dph_async.rewards.worker import serve as _serve

    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
