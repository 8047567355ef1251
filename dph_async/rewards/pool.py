"""A pool of killable reward worker processes.

    with RewardPool(workers=2, timeout_s=10, memory_limit_mb=1024, config=cfg) as pool:
        results = pool.score_many([ScoreRequest("bird", text, gt, {})])

Each request runs in a worker process under a deadline; a worker that overruns is killed (SIGKILL) and
a replacement is started in the background, and its request comes back with status "timeout" — or
"error" when the worker was still checking the reference (the gold query, the reference answer): that
is the dataset's fault, not the response's. A thread per worker drives the workers, so `score_many`
may be called from any thread, several at once; requests queue in arrival order.

Deadlines include start-up: a request's time runs from when it is taken up, and waiting for a worker
(starting, or being replaced) counts. A request that cannot start before its deadline is an "error":
nothing was learned about the response.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot kill one stuck worker without breaking the
whole pool, and a thread-based timeout only stops waiting while the hung call keeps its worker.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.child import Child
from dph_async.rewards.context import Stage
from dph_async.rewards.plugins import load_plugins
from dph_async.rewards.registry import get_reward_fn
from dph_async.rewards.result import RewardResult, failure
from dph_async.rewards.worker import ScoreRequest

__all__ = ["RewardPool", "ScoreRequest"]

# A new worker must report ready within this long (interpreter start and imports on a busy machine).
STARTUP_TIMEOUT_S = 120.0
# Extra time a worker gets to send its result before being treated as overrunning.
KILL_GRACE_S = 0.05
WORKER_MODULE = "dph_async.rewards.worker"


@dataclass
class _Overran:
    """The worker passed its budget; what it had reported by then."""

    stage: Stage
    format_ok: bool


@dataclass
class _Died:
    exitcode: int | None


class _Worker:
    """One worker process."""

    def __init__(self, cfg: RewardConfig, memory_limit_mb: int, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        child = Child(WORKER_MODULE, memory_limit_mb, cfg.model_dump_json().encode(), startup_timeout_s)
        self.proc, self.conn, self._child = child.proc, child.conn, child

    def run(self, req: ScoreRequest, budget_s: float) -> RewardResult | _Overran | _Died:
        """Score `req`, or say why not: it overran `budget_s` or died (either way, replace it)."""
        start = time.monotonic()
        end = start + budget_s + KILL_GRACE_S
        try:
            self.conn.send((budget_s, req))
        except (BrokenPipeError, OSError):
            return self._died()
        except RecursionError:  # pickling a value nested past Python's recursion limit; nothing was sent
            return failure("error", "ground_truth or extra_info is nested too deep to send to a worker")
        stage: Stage = "response"
        format_ok = False
        while True:
            if not self.conn.poll(max(0.0, end - time.monotonic())):
                return _Overran(stage, format_ok)
            raw = self._child.recv()
            try:
                message = json.loads(raw) if raw is not None else None
                if "result" in message:
                    result = RewardResult(**message["result"])
                    return replace(result, latency_s=time.monotonic() - start)
                stage = "reference" if message["stage"] == "reference" else "response"
                format_ok = bool(message["format_ok"])
            except (ValueError, TypeError, KeyError):
                return self._died()

    def _died(self) -> _Died:
        with contextlib.suppress(subprocess.TimeoutExpired):  # let it exit, to report its code
            self.proc.wait(timeout=1.0)
        return _Died(self.proc.poll())

    def kill(self) -> None:
        self._child.kill()

    def stop(self) -> None:
        self._child.stop()


def _blame(outcome: _Overran | _Died, budget: float) -> RewardResult:
    """The result of a call whose worker had to be killed or died."""
    if isinstance(outcome, _Died):
        return failure("error", f"reward worker died while scoring (exit code {outcome.exitcode})")
    if outcome.stage == "reference":
        return replace(failure("error", f"checking the reference (gold query or reference answer) took longer "
                                        f"than {budget:.3g} s; worker killed", format_ok=outcome.format_ok),
                       latency_s=budget)
    return replace(failure("timeout", f"scoring took longer than {budget:.3g} s; worker killed",
                           format_ok=outcome.format_ok), latency_s=budget)


class RewardPool:
    """`workers` killable processes scoring requests, each call bounded by `timeout_s`."""

    def __init__(self, workers: int, timeout_s: float, memory_limit_mb: int,
                 config: RewardConfig | None = None) -> None:
        if workers < 1 or timeout_s <= 0 or memory_limit_mb < 64:
            raise ValueError("need workers >= 1, timeout_s > 0 and memory_limit_mb >= 64")
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self._cfg = config or RewardConfig(workers=workers, timeout_s=timeout_s,
                                           memory_limit_mb=memory_limit_mb)
        # Here too, not only in the workers: score_many looks data sources up before scoring.
        load_plugins(self._cfg.plugins)
        # A slot holds a ready worker, or None: not started (on first use). A slot whose worker was
        # killed is away while its replacement starts in the background.
        self._slots: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._slots.put(None)
        self._workers = workers
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-pool")
        self._starter = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-pool-start")
        self._closed = False
        self._lock = threading.Lock()
        self.restarts = 0  # workers replaced after a timeout or a crash

    def warm_up(self) -> None:
        """Start every worker now rather than on first use (a service does this before serving)."""
        slots = [self._slots.get() for _ in range(self._workers)]
        for worker in self._starter.map(self._started, slots):
            self._slots.put(worker)

    def _started(self, worker: _Worker | None) -> _Worker | None:
        if worker is not None:
            return worker
        try:
            return _Worker(self._cfg, self.memory_limit_mb)
        except RuntimeError:
            return None  # tried again on first use, where the failure becomes a status

    def _replace(self) -> None:
        """Start a replacement for a discarded worker and return it to its slot (None if it failed)."""
        self._slots.put(None if self._closed else self._started(None))

    def score_many(self, requests: list[ScoreRequest], deadline: float | None = None) -> list[RewardResult]:
        """Score requests in order. Raises UnknownDataSource before running anything if a source is unknown.

        `deadline` (a `time.monotonic()` instant) bounds the whole batch: requests not started by then
        come back as "error" (nothing was learned about them), and running ones are killed at it.
        """
        for source in {r.data_source for r in requests}:
            get_reward_fn(source)
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        futures = [self._threads.submit(self._score, r, deadline) for r in requests]
        return [f.result() for f in futures]

    def _score(self, req: ScoreRequest, deadline: float | None) -> RewardResult:
        def left() -> float:
            return float("inf") if deadline is None else deadline - time.monotonic()

        not_started = failure("error", "not started before the batch deadline (the scorer was busy)")
        try:
            worker = self._slots.get(timeout=None if deadline is None else max(0.0, left()))
        except queue.Empty:
            return not_started
        replacing = False
        try:
            if worker is not None and worker.proc.poll() is not None:  # died while idle (OOM killer...)
                self._discard(worker)
                worker = None
            if left() <= 0:
                return not_started
            if worker is None:
                try:
                    worker = _Worker(self._cfg, self.memory_limit_mb, min(STARTUP_TIMEOUT_S, left()))
                except RuntimeError as e:
                    return not_started if left() <= 0 else failure("error", str(e))
            budget = min(self.timeout_s, left())  # measured now: start-up came out of the deadline
            if budget <= 0:
                return not_started
            outcome = worker.run(req, budget)
            if isinstance(outcome, RewardResult):
                return outcome
            self._discard(worker)
            self._starter.submit(self._replace)  # the slot comes back when its replacement is ready
            replacing = True
            return _blame(outcome, budget)
        finally:
            if not replacing:
                self._slots.put(worker)

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self.restarts += 1

    def close(self) -> None:
        """Stop the workers (waiting for calls in progress and replacements starting)."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        self._starter.shutdown(wait=True)
        for _ in range(self._workers):
            worker = self._slots.get()
            if worker is not None:
                worker.stop()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
