"""The reward worker process: resource limits, then a loop scoring one request at a time.

A worker is a fresh interpreter (`python -m dph_async.rewards.worker`), not a fork: it inherits none
of the caller's threads (vLLM, torch) and never re-imports the caller's main module, as
multiprocessing's spawn and forkserver children do. It runs in its own process group, so a Ctrl-C
meant for the caller does not reach it; the caller stops it by closing the pipe.

Rewards run model-written SQL and feed model-written math to parsers that can hang; the worker is the
unit the parent kills when a call overruns. It also caps its own address space (so a memory bomb ends
in MemoryError, not in the machine swapping) and the size of any file it could write (0 bytes).
"""

from __future__ import annotations

import json
import resource
import signal
import sys
import time
from dataclasses import asdict, dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

from dph_async.config.rewards import RewardConfig
from dph_async.rewards import context
from dph_async.rewards.registry import get_reward_fn, load_builtins
from dph_async.rewards.result import RewardResult, failure

# The worker's own deadline comes a little before the parent's kill, so that a query which merely
# runs long (a recursive CTE) ends cleanly with status "timeout" instead of costing a new process.
SOFT_DEADLINE_SHARE = 0.9


@dataclass
class ScoreRequest:
    """One response to score; `ground_truth` and `extra_info` are the dataset row's fields."""

    data_source: str
    response: str
    ground_truth: Any
    extra_info: dict


def score_one(req: ScoreRequest) -> RewardResult:
    """Score one request in this process, turning every failure into a status."""
    start = time.perf_counter()
    limit = context.config().max_response_chars
    if not isinstance(req.response, str):
        result = failure("error", f"response must be a string, got {type(req.response).__name__}")
    elif len(req.response) > limit:
        result = failure("rejected", f"response has {len(req.response)} characters; the limit is {limit}")
    else:
        try:
            result = get_reward_fn(req.data_source)(req.response, req.ground_truth, req.extra_info or {})
        except MemoryError:
            result = failure("rejected", "memory limit reached while scoring")
        except RecursionError:
            result = failure("rejected", "nesting too deep to score")
        except Exception as e:
            result = failure("error", f"{type(e).__name__}: {e}"[:500])
    return replace(result, latency_s=time.perf_counter() - start)


def _limit_resources(memory_limit_mb: int) -> None:
    cap = memory_limit_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # A write past RLIMIT_FSIZE should fail with an error, not kill the worker with SIGXFSZ.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.dont_write_bytecode = True


def serve(conn: Connection, memory_limit_mb: int) -> None:
    """Take the reward config, then serve (budget_s, ScoreRequest) messages until the pipe closes.

    Requests arrive pickled from the parent (trusted); results go back as JSON, so the parent never
    unpickles anything produced while handling model output.
    """
    context.configure(RewardConfig.model_validate_json(conn.recv_bytes()))
    load_builtins()
    _limit_resources(memory_limit_mb)
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
        conn.send_bytes(json.dumps(asdict(score_one(req))).encode())


if __name__ == "__main__":
    # python -m dph_async.rewards.worker <socket fd> <memory limit MB>
    serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
