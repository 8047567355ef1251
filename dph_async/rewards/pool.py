"""A pool of killable reward worker processes.

    with RewardPool(workers=2, timeout_s=10, memory_limit_mb=1024, config=cfg) as pool:
        results = pool.score_many([ScoreRequest("bird", text, gt, {})])

Each request runs in a worker process under a deadline; a worker that overruns is killed (SIGKILL) and
replaced, and its request comes back with status "timeout". A thread per worker drives the workers, so
`score_many` may be called from any thread, several at once; requests queue in arrival order.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot kill one stuck worker without breaking the
whole pool, and a thread-based timeout only stops waiting while the hung call keeps its worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Literal

import dph_async
from dph_async.config.rewards import RewardConfig
from dph_async.rewards.registry import get_reward_fn
from dph_async.rewards.result import RewardResult, failure
from dph_async.rewards.worker import ScoreRequest

__all__ = ["RewardPool", "ScoreRequest"]

# A new worker must report ready within this long (interpreter start and imports on a busy machine).
STARTUP_TIMEOUT_S = 120.0
# Extra time a worker gets to send its result before being treated as overrunning.
KILL_GRACE_S = 0.05
# The worker must find this package even when the caller runs from a source tree that is not installed.
_PACKAGE_PARENT = str(Path(dph_async.__file__).resolve().parent.parent)


class _Worker:
    """One worker process and the parent's end of its socket."""

    def __init__(self, cfg: RewardConfig, memory_limit_mb: int) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        with ours, theirs:
            fd = theirs.fileno()
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "dph_async.rewards.worker", str(fd), str(memory_limit_mb)],
                    pass_fds=(fd,), env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            except OSError as e:  # out of processes or file descriptors
                raise RuntimeError(f"reward worker could not be started: {e}") from e
            self.conn = Connection(os.dup(ours.fileno()))
        try:
            self.conn.send_bytes(cfg.model_dump_json().encode())
            ready = self.conn.poll(STARTUP_TIMEOUT_S) and self._recv_bytes() == b"ready"
        except OSError:
            ready = False
        if not ready:
            self.kill()
            raise RuntimeError(f"reward worker did not start (exit code {self.proc.poll()})")

    def _recv_bytes(self) -> bytes | None:
        try:
            return self.conn.recv_bytes()
        except (EOFError, OSError):
            return None

    def run(self, req: ScoreRequest, budget_s: float) -> RewardResult | Literal["overran", "died"]:
        """Score `req`, or say why not: "overran" (past `budget_s`) or "died"; either way, replace it."""
        start = time.monotonic()
        try:
            self.conn.send((budget_s, req))
        except (BrokenPipeError, OSError):
            return "died"
        if not self.conn.poll(budget_s + KILL_GRACE_S):
            return "overran"
        raw = self._recv_bytes()
        if raw is None:
            return "died"
        try:
            result = RewardResult(**json.loads(raw))
        except (ValueError, TypeError):
            return "died"
        return replace(result, latency_s=time.monotonic() - start)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.conn.close()

    def stop(self) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            self.conn.send(None)
        try:
            self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


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
        self._slots: queue.SimpleQueue[_Worker | None] = queue.SimpleQueue()
        for _ in range(workers):
            self._slots.put(None)  # started on first use, so constructing a pool is cheap
        self._workers = workers
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="reward-pool")
        self._closed = False
        self._lock = threading.Lock()
        self.restarts = 0  # workers replaced after a timeout or a crash

    def warm_up(self) -> None:
        """Start every worker now rather than on first use (a service does this before serving)."""
        slots = [self._slots.get() for _ in range(self._workers)]
        for worker in self._threads.map(self._started, slots):
            self._slots.put(worker)

    def _started(self, worker: _Worker | None) -> _Worker | None:
        if worker is not None:
            return worker
        try:
            return _Worker(self._cfg, self.memory_limit_mb)
        except RuntimeError:
            return None  # tried again on first use, where the failure becomes a status

    def score_many(self, requests: list[ScoreRequest], deadline: float | None = None) -> list[RewardResult]:
        """Score requests in order. Raises UnknownDataSource before running anything if a source is unknown.

        `deadline` (a `time.monotonic()` instant) bounds the whole batch: requests not started by then
        come back as "timeout", and running ones are killed at it.
        """
        for source in {r.data_source for r in requests}:
            get_reward_fn(source)
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        futures = [self._threads.submit(self._score, r, deadline) for r in requests]
        return [f.result() for f in futures]

    def _score(self, req: ScoreRequest, deadline: float | None) -> RewardResult:
        budget = self.timeout_s if deadline is None else min(self.timeout_s, deadline - time.monotonic())
        if budget <= 0:
            return failure("timeout", "not started before the batch deadline")
        worker = self._slots.get()
        try:
            if worker is not None and worker.proc.poll() is not None:  # died while idle (OOM killer...)
                self._discard(worker)
                worker = None
            if worker is None:
                worker = _Worker(self._cfg, self.memory_limit_mb)
            result = worker.run(req, budget)
            if isinstance(result, RewardResult):
                return result
            if result == "died":
                with contextlib.suppress(subprocess.TimeoutExpired):  # let it exit, to report its code
                    worker.proc.wait(timeout=1.0)
            exitcode = worker.proc.poll()
            self._discard(worker)
            worker = None
            if result == "died":
                return failure("error", f"reward worker died while scoring (exit code {exitcode})")
            return replace(failure("timeout", f"scoring took longer than {budget:.3g} s; worker killed"),
                           latency_s=budget)
        except RuntimeError as e:
            return failure("error", str(e))
        finally:
            self._slots.put(worker)

    def _discard(self, worker: _Worker) -> None:
        worker.kill()
        with self._lock:
            self.restarts += 1

    def close(self) -> None:
        """Stop the workers (waiting for calls in progress)."""
        if self._closed:
            return
        self._closed = True
        self._threads.shutdown(wait=True)
        for _ in range(self._workers):
            worker = self._slots.get()
            if worker is not None:
                worker.stop()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
