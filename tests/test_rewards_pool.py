"""The local pool: order kept, usable from any thread, overrunning workers killed and replaced."""

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.fixtures import build_sql_fixture
from dph_async.rewards.pool import RewardPool, ScoreRequest
from dph_async.rewards.registry import UnknownDataSource
from dph_async.rewards.scorer import make_scorer
from dph_async.tasks.embedded import IN_DOMAIN

# math-verify runs for minutes comparing a tower of powers against a number.
HANGS = ScoreRequest("math", r"\boxed{9^{9^{9^{9}}}}", "5", {})
TRUTH = {"gold_sql": "SELECT name FROM students WHERE city = 'Oslo'", "db_id": "school"}


def good(i: int) -> ScoreRequest:
    return ScoreRequest("countdown", f"<answer>{i} + 1</answer>", {"target": i + 1, "numbers": [i, 1]}, {})


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    root = build_sql_fixture(tmp_path_factory.mktemp("poolfix")).parent / "databases"
    config = RewardConfig(workers=2, timeout_s=1.5, memory_limit_mb=1024)
    config.sql.db_root = str(root)
    return config


@pytest.fixture(scope="module")
def pool(cfg):
    with RewardPool(cfg.workers, cfg.timeout_s, cfg.memory_limit_mb, config=cfg) as p:
        yield p


def _worker_pids(pool: RewardPool) -> list[int]:
    # Test-only peek at the slots; takes every slot, so no call may be running.
    workers = [pool._slots.get() for _ in range(pool._workers)]
    for w in workers:
        pool._slots.put(w)
    return [w.proc.pid for w in workers if w is not None]


def test_order_is_kept_and_sources_mix(pool):
    sql = ScoreRequest("bird", "```sql\nSELECT name FROM students WHERE city = 'Oslo'\n```", TRUTH, {})
    requests = [good(i) for i in range(10)] + [sql]
    results = pool.score_many(requests)
    assert [r.correct for r in results] == [True] * 11
    assert all(r.latency_s > 0 for r in results)


def test_callable_from_several_non_main_threads(pool):
    out: dict[int, list] = {}

    def call(k: int) -> None:
        out[k] = pool.score_many([good(10 * k + i) for i in range(5)])

    threads = [threading.Thread(target=call, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.correct for k in range(3) for r in out[k])


def test_overrun_is_killed_replaced_and_reported_as_timeout(pool, cfg):
    before = pool.restarts
    start = time.monotonic()
    results = pool.score_many([HANGS, good(1), good(2)])
    elapsed = time.monotonic() - start
    assert results[0].status == "timeout" and results[0].score == 0.0 and "killed" in results[0].detail
    assert results[1].correct and results[2].correct
    assert elapsed < cfg.timeout_s + 3.0
    assert pool.restarts == before + 1
    assert pool.score_many([good(3)])[0].correct  # the replacement works


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_worker_that_dies_is_an_error_and_replaced(cfg):
    with RewardPool(1, 10.0, 1024, config=cfg) as pool:
        pool.warm_up()
        (pid,) = _worker_pids(pool)
        idle = _cpu_ticks(pid)
        result: list = []
        thread = threading.Thread(target=lambda: result.extend(pool.score_many([HANGS])))
        thread.start()
        deadline = time.monotonic() + 8
        while _cpu_ticks(pid) <= idle + 5 and time.monotonic() < deadline:  # wait until it is scoring
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        thread.join()
        assert result[0].status == "error" and "died" in result[0].detail and "-9" in result[0].detail
        assert [r.correct for r in pool.score_many([good(4), good(5)])] == [True, True]
        assert pool.restarts == 1


def test_a_worker_that_died_idle_is_replaced_silently(pool):
    pool.warm_up()
    pids = _worker_pids(pool)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not all(_dead(pid) for pid in pids):  # dead before the pool is asked again
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [r.correct for r in pool.score_many([good(6), good(7)])] == [True, True]


def test_unknown_source_raises_before_scoring(pool):
    with pytest.raises(UnknownDataSource, match="nonexistent_source"):
        pool.score_many([good(1), ScoreRequest("nonexistent_source", "x", None, {})])


def test_batch_deadline(pool):
    # Both workers up first: a test before this one (in a shuffled order) may have killed one, whose
    # replacement would otherwise still be starting when the two hanging requests need them.
    assert [r.correct for r in pool.score_many([good(1), good(2)])] == [True, True]
    start = time.monotonic()
    results = pool.score_many([HANGS, HANGS, good(6)], deadline=time.monotonic() + 0.5)
    assert time.monotonic() - start < 2.5
    # The two hanging ones were started and killed (the response's doing); the third never started:
    # nothing was learned about it, so it is the scorer's failure, which the learner masks.
    assert [r.status for r in results] == ["timeout", "timeout", "error"]
    assert results[2].scorer_failed and "not started" in results[2].detail


def test_factory_scores_inline_rewards_here_and_the_rest_in_a_pool_it_starts_and_stops(cfg):
    """The embedded task's reward is registered inline: scored in this process, no worker started. A
    countdown request starts the pool; closing the scorer stops its workers."""
    embedded = ScoreRequest(IN_DOMAIN, "2+7", {"digits": "25789", "target": 9, "op": "+"}, {})
    wrong = ScoreRequest(IN_DOMAIN, "2+8", {"digits": "25789", "target": 9, "op": "+"}, {})
    scorer = make_scorer(cfg)
    with scorer:
        assert [r.correct for r in scorer.score_many([embedded, wrong])] == [True, False]
        assert scorer._remote is None
        assert [r.correct for r in scorer.score_many([good(7), embedded, wrong, good(3)])] == [True, True, False, True]
        pool = scorer._remote
        assert isinstance(pool, RewardPool)
        workers = [w for w in (pool._slots.get() for _ in range(pool._workers)) if w is not None]
        for w in workers:
            pool._slots.put(w)
        for _ in range(pool._workers - len(workers)):
            pool._slots.put(None)
    assert workers and all(w.proc.poll() is not None for w in workers)
    # inline=false: the same reward goes through the pool, with the same verdicts.
    with make_scorer(cfg.model_copy(update={"inline": False})) as remote:
        assert [r.correct for r in remote.score_many([embedded, wrong])] == [True, False]
        assert isinstance(remote._remote, RewardPool)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score_many([good(8)])

