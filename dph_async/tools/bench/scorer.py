"""Scorer throughput and latency: the local worker pool against the HTTP scorer service.

Each cell runs `concurrency` caller threads for `seconds`, each calling `score_many` with `batch`
requests at a time, as actor threads do, and records every call's wall time. Workloads:
- sql: the SQL fixture's gold answers (right) and a few wrong queries, BIRD and Spider comparison;
- math: boxed answers checked by math-verify (half right).
Both backends get the same number of worker processes; the service runs as `dph-async serve scorer`
in its own process, on loopback.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.client import ScorerClient
from dph_async.rewards.fixtures import build_sql_fixture, example_responses, fixture_rows
from dph_async.rewards.pool import RewardPool
from dph_async.rewards.scorer import Scorer
from dph_async.rewards.worker import ScoreRequest


@dataclass
class Cell:
    backend: str
    workload: str
    concurrency: int
    batch: int
    calls: int
    requests_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    statuses: dict[str, int] = field(default_factory=dict)


def sql_workload(fixture_dir: Path) -> list[ScoreRequest]:
    rows = fixture_rows(fixture_dir / "databases")
    answers = example_responses(rows)[: len(rows) + 2]  # the gold answers and two wrong ones
    return [ScoreRequest(a["data_source"], a["response"], a["reward_model"]["ground_truth"], a["extra_info"])
            for a in answers]


def math_workload(n: int = 4000) -> list[ScoreRequest]:
    """Distinct answers (math-verify caches parses of strings it has seen), odd k right, even k wrong."""
    out = []
    for k in range(1, n + 1):
        answer = f"\\frac{{{k}}}{{4}}" if k % 2 else f"{k / 4 + 1:g}"
        response = f"We simplify step by step... so \\boxed{{{answer}}}."
        out.append(ScoreRequest("math", response, str(k / 4), {}))
    return out


def run_cell(scorer: Scorer, requests: list[ScoreRequest], concurrency: int, batch: int,
             seconds: float) -> tuple[list[float], Counter, float]:
    """(call latencies in s, status counts, elapsed s) of `concurrency` threads calling for `seconds`."""
    latencies: list[float] = []
    statuses: Counter = Counter()
    lock = threading.Lock()
    stream = itertools.cycle(requests)
    stop = time.monotonic() + seconds

    def caller() -> None:
        while time.monotonic() < stop:
            with lock:
                chunk = [next(stream) for _ in range(batch)]
            start = time.perf_counter()
            results = scorer.score_many(chunk)
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                statuses.update(r.status for r in results)

    begin = time.monotonic()
    threads = [threading.Thread(target=caller) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies, statuses, time.monotonic() - begin


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def scorer_service(workers: int, timeout_s: float, db_root: Path) -> Iterator[str]:
    """A `dph-async serve scorer` process on a free loopback port; yields its URL. The service is started
    as an operator starts it, a process of its own: a command line run, not an import of the CLI."""
    port = _free_port()
    command = [sys.executable, "-m", "dph_async.cli.main", "serve", "scorer", "--port", str(port),
               f"rewards.workers={workers}", f"rewards.timeout_s={timeout_s}",
               f"rewards.sql.db_root={db_root}"]
    proc = subprocess.Popen(command, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the scorer service did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def run(workers: int, concurrency: list[int], batch: int, seconds: float, timeout_s: float,
        backends: list[str], workloads: list[str], log=print) -> list[Cell]:
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        fixture_dir = build_sql_fixture(Path(tmp)).parent
        db_root = fixture_dir / "databases"
        loads = {"sql": sql_workload(fixture_dir), "math": math_workload()}
        cfg = RewardConfig(workers=workers, timeout_s=timeout_s)
        cfg.sql.db_root = str(db_root)
        for backend in backends:
            with _backend(backend, cfg, db_root) as scorer:
                for name in workloads:
                    scorer.score_many(loads[name][:64])  # warm: workers started, gold results cached
                    shapes = [(c, 1) for c in concurrency] + ([(1, batch)] if batch > 1 else [])
                    for c, b in shapes:
                        latencies, statuses, elapsed = run_cell(scorer, loads[name], c, b, seconds)
                        ms = np.array(latencies) * 1e3
                        cell = Cell(backend, name, c, b, len(latencies), len(latencies) * b / elapsed,
                                    *(float(np.percentile(ms, q)) for q in (50, 95, 99)), dict(statuses))
                        log(f"{backend:5s} {name:5s} concurrency {c:3d} batch {b:3d}: "
                            f"{cell.requests_per_s:8.1f} req/s  p50 {cell.p50_ms:7.2f} ms  "
                            f"p95 {cell.p95_ms:7.2f} ms")
                        cells.append(cell)
    return cells


@contextmanager
def _backend(name: str, cfg: RewardConfig, db_root: Path) -> Iterator[Scorer]:
    if name == "pool":
        with RewardPool(cfg.workers, cfg.timeout_s, cfg.memory_limit_mb, config=cfg) as pool:
            pool.warm_up()
            yield pool
    else:
        with scorer_service(cfg.workers, cfg.timeout_s, db_root) as url, \
                ScorerClient([url], timeout_s=120, retries=0, batch_size=256) as client:
            yield client


def markdown(cells: list[Cell]) -> str:
    lines = ["| workload | backend | callers | batch | req/s | p50 ms | p95 ms | p99 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for c in sorted(cells, key=lambda c: (c.workload, c.batch, c.concurrency, c.backend)):
        lines.append(f"| {c.workload} | {c.backend} | {c.concurrency} | {c.batch} | {c.requests_per_s:.0f} | "
                     f"{c.p50_ms:.2f} | {c.p95_ms:.2f} | {c.p99_ms:.2f} |")
    return "\n".join(lines)
