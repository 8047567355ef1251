"""Hostile model outputs: each scores 0 with a status, within its deadline, writes nothing, and leaves the
worker pool and the scorer service serving."""

import hashlib
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from dph_async.config.rewards import RewardConfig
from dph_async.rewards import pool as pool_module
from dph_async.rewards.fixtures import build_sql_fixture
from dph_async.rewards.pool import RewardPool, ScoreRequest
from dph_async.rewards.service import make_app
from dph_async.rewards.service_http import MAX_CONNECTIONS

TIMEOUT_S = 2.0
# Killing an overrunning worker and starting its replacement comes on top of the deadline.
SLACK_S = 3.0
TRUTH = {"gold_sql": "SELECT name FROM students WHERE city = 'Oslo'", "db_id": "school"}
COUNTDOWN = {"target": 24, "numbers": [2, 99, 99]}
TEN_MB = 10 * 2**20


def unicode_garbage(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    # Every plane, lone surrogates, NULs, controls and bidi overrides.
    points = [rng.choice([rng.randrange(0x110000), rng.randrange(0xD800, 0xE000), 0, 0x202E, 0x7F])
              for _ in range(n)]
    return "".join(map(chr, points))


def sql(query: str) -> str:
    return f"```sql\n{query}\n```"


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return build_sql_fixture(tmp_path_factory.mktemp("hostile")).parent


@pytest.fixture(scope="module")
def cfg(fixture_dir):
    config = RewardConfig(workers=2, timeout_s=TIMEOUT_S, memory_limit_mb=1024)
    config.sql.db_root = str(fixture_dir / "databases")
    return config


@pytest.fixture(scope="module")
def pool(cfg):
    with RewardPool(cfg.workers, cfg.timeout_s, cfg.memory_limit_mb, config=cfg) as p:
        p.warm_up()
        yield p


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def check(pool: RewardPool, request: ScoreRequest, statuses: set[str], root: Path):
    before = _snapshot(root)
    start = time.monotonic()
    result = pool.score_many([request])[0]
    elapsed = time.monotonic() - start
    assert (result.score, result.correct) == (0.0, False), result
    assert result.status in statuses, result
    assert elapsed < TIMEOUT_S + SLACK_S
    assert _snapshot(root) == before  # no file created, no database changed
    good = ScoreRequest("bird", sql(TRUTH["gold_sql"]), TRUTH, {})
    assert pool.score_many([good])[0].correct  # the pool still serves
    return result


def evil_paths(root: Path) -> dict[str, str]:
    return {"evil": str(root / "evil.db"), "copy": str(root / "copy.db"), "pwned": str(root / "pwned")}


SQL_CASES = {
    "attach": ("ATTACH DATABASE '{evil}' AS e", {"rejected"}),
    "attach_memory": ("ATTACH ':memory:' AS m", {"rejected"}),
    "attach_after_select": ("SELECT 1; ATTACH DATABASE '{evil}' AS e", {"rejected"}),
    "recursive_cte": ("WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) "
                      "SELECT count(*) FROM r", {"timeout"}),
    "randomblob": ("SELECT length(randomblob(2000000000))", {"rejected"}),
    "zeroblob": ("SELECT zeroblob(1000000000)", {"rejected"}),
    "blob_accumulation": ("WITH RECURSIVE r(x) AS (SELECT randomblob(900000) UNION ALL SELECT x || x FROM r) "
                          "SELECT length(x) FROM r", {"rejected"}),
    "sort_bomb": ("WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 20000000) "
                  "SELECT i, randomblob(800) FROM r ORDER BY 2", {"rejected", "timeout"}),
    "group_concat_bomb": ("SELECT group_concat(a.name || b.name || c.name || d.name) FROM students a, "
                          "students b, students c, students d, students e", {"rejected", "ok"}),
    "multiple_statements": ("SELECT 1; DROP TABLE students", {"rejected"}),
    "pragma_wal": ("PRAGMA journal_mode=WAL", {"rejected"}),
    "pragma_writable_schema": ("PRAGMA writable_schema=ON", {"rejected"}),
    "pragma_query_only_off": ("PRAGMA query_only=OFF", {"rejected"}),
    "pragma_function": ("SELECT * FROM pragma_table_info('students')", {"rejected"}),
    "insert": ("INSERT INTO students VALUES (99, 'Mallory', 'Oslo', 1)", {"rejected"}),
    "drop": ("DROP TABLE students", {"rejected"}),
    "create_temp": ("CREATE TEMP TABLE t AS SELECT * FROM students", {"rejected"}),
    "vacuum_into": ("VACUUM INTO '{copy}'", {"rejected"}),
    "transaction": ("BEGIN IMMEDIATE", {"rejected"}),
    "load_extension": ("SELECT load_extension('{pwned}')", {"rejected"}),
    "comment_only": ("-- nothing here", {"exec_error"}),
    "nul_byte": ("SELECT name FROM students\x00; DROP TABLE students", {"exec_error", "rejected"}),
}


@pytest.mark.parametrize("case", sorted(SQL_CASES))
def test_hostile_sql(pool, fixture_dir, case):
    query, statuses = SQL_CASES[case]
    paths = evil_paths(fixture_dir)
    result = check(pool, ScoreRequest("bird", sql(query.format(**paths)), TRUTH, {}), statuses, fixture_dir)
    assert not any(Path(p).exists() for p in paths.values()), result


@pytest.mark.parametrize(("name", "response", "statuses"), [
    ("ten_megabytes", "```sql\nSELECT " + "1+" * (TEN_MB // 2) + "1\n```", {"rejected"}),
    ("long_query", sql("SELECT " + "1+" * 100_000 + "1"), {"rejected"}),
    ("unicode_garbage", unicode_garbage(5000), {"parse_error"}),
    ("unicode_in_block", sql(unicode_garbage(5000, seed=1)), {"exec_error", "rejected"}),
])
def test_hostile_sql_text(pool, fixture_dir, name, response, statuses):
    check(pool, ScoreRequest("spider", response, TRUTH, {}), statuses, fixture_dir)


@pytest.mark.parametrize(("answer", "statuses"), [
    ("2**99**99", {"rejected"}),
    ("9**9**9**9", {"rejected"}),
    ("2*99**98**97", {"rejected"}),
    ("__import__('os').system('touch {pwned}')", {"rejected"}),
    ("[x for x in range(10**10)]", {"rejected"}),
    ("(" * 5000 + "2" + ")" * 5000, {"rejected", "parse_error"}),
    ("99 * 99 " + "* 99 " * 150, {"ok"}),  # long but legal: numbers used too often
    ("1e308 * 1e308", {"rejected"}),
    (unicode_garbage(800), {"parse_error", "rejected"}),
])
def test_hostile_countdown(pool, fixture_dir, answer, statuses):
    response = f"<answer>{answer.format(**evil_paths(fixture_dir))}</answer>"
    check(pool, ScoreRequest("countdown", response, COUNTDOWN, {}), statuses, fixture_dir)
    assert not (fixture_dir / "pwned").exists()


@pytest.mark.parametrize(("name", "response", "statuses"), [
    # Comparing 9^(9^(9^9)) with 5 runs for minutes: the worker is killed at the deadline.
    ("power_tower", r"\boxed{9^{9^{9^{9}}}}", {"timeout"}),
    # Deep nesting costs the LaTeX parser about a second here, near the deadline: whether it finishes
    # (a wrong answer) or is killed depends on the machine's load; either way it is bounded and scores 0.
    ("nested_parentheses", r"\boxed{" + "(" * 100 + "1" + ")" * 100 + "}", {"timeout", "ok"}),
    ("huge_boxed", r"\boxed{" + "1+" * 5000 + "1}", {"rejected"}),
    ("ten_megabytes", "x" * TEN_MB + r"\boxed{5}", {"rejected"}),
    ("unicode_garbage", r"\boxed{" + unicode_garbage(500, seed=2).replace("}", "") + "}",
     {"parse_error", "ok"}),
])
def test_hostile_math(pool, fixture_dir, name, response, statuses):
    check(pool, ScoreRequest("math", response, "5", {}), statuses, fixture_dir)


def test_python_side_memory_bomb_hits_the_worker_memory_limit(fixture_dir, cfg):
    """Row caps lifted: a cross join fetched into Python memory ends in MemoryError, not in swapping."""
    big = cfg.model_copy(deep=True)
    big.sql.max_rows = 10**9
    query = ("SELECT a.name, b.city, c.name, d.city, e.name "
             "FROM students a, students b, students c, students d, students e, courses f")
    with RewardPool(1, 20.0, 300, config=big) as pool:
        start = time.monotonic()
        result = pool.score_many([ScoreRequest("bird", sql(query), TRUTH, {})])[0]
        assert result.status == "rejected" and "memory" in result.detail, result
        assert time.monotonic() - start < 20.0
        good = ScoreRequest("bird", sql(TRUTH["gold_sql"]), TRUTH, {})
        assert pool.score_many([good])[0].correct


def test_service_survives_a_hostile_batch(cfg, fixture_dir):
    paths = evil_paths(fixture_dir)
    hostile = [{"data_source": "bird", "response": sql(q.format(**paths)), "ground_truth": TRUTH}
               for q, _ in SQL_CASES.values() if "RECURSIVE" not in q]
    hostile += [
        {"data_source": "countdown", "response": "<answer>2**99**99</answer>", "ground_truth": COUNTDOWN},
        {"data_source": "math", "response": "y" * TEN_MB, "ground_truth": "5"},
        {"data_source": "math", "response": r"\boxed{9^{9^{9^{9}}}}", "ground_truth": "5"},
    ]
    with TestClient(make_app(cfg)) as client:
        reply = client.post("/v1/score", json={"requests": hostile, "budget_s": 10})
        assert reply.status_code == 200
        results = reply.json()["results"]
        assert len(results) == len(hostile) and all(r["score"] == 0.0 for r in results)
        assert client.get("/health").json()["status"] == "ok"
        good = {"data_source": "bird", "response": sql(TRUTH["gold_sql"]), "ground_truth": TRUTH}
        assert client.post("/v1/score", json={"requests": [good]}).json()["results"][0]["correct"]
    assert not any(Path(p).exists() for p in paths.values())


# --- Blame: who is at fault when a worker has to be killed ------------------------------------------

SLOW_REFERENCE = "(" * 60 + "1" + ")" * 60  # the LaTeX parser needs about 10 s for it


def test_a_reference_that_has_to_be_killed_is_the_datasets_error(pool):
    result = pool.score_many([ScoreRequest("math", r"\boxed{1}", SLOW_REFERENCE, {})])[0]
    assert result.status == "error" and result.scorer_failed and "reference" in result.detail, result
    assert result.format_ok  # the response had its boxed answer


def test_a_killed_response_keeps_the_format_it_had(pool):
    result = pool.score_many([ScoreRequest("math", r"\boxed{9^{9^{9^{9}}}}", "5", {})])[0]
    assert result.status == "timeout" and not result.scorer_failed, result
    assert result.format_ok, result


def test_a_deep_ground_truth_is_the_callers_error_not_the_responses(pool):
    """100k levels, as a Python value and as the JSON text DPH-RL's SQL rows carry: neither is the
    response's fault (not `rejected`), both are the scorer's input failing (`error`, masked)."""
    deep: object = 1
    for _ in range(100_000):
        deep = {"a": deep}
    text = '{"a":' * 100_000 + "1" + "}" * 100_000
    results = pool.score_many([ScoreRequest("bird", sql(TRUTH["gold_sql"]), text, {}),
                               ScoreRequest("countdown", "<answer>1 + 2</answer>", deep, {})])
    for result in results:
        assert result.status == "error" and result.scorer_failed and "deep" in result.detail, result
    good = ScoreRequest("countdown", "<answer>2 * 12</answer>", {"target": 24, "numbers": [2, 12]}, {})
    assert pool.score_many([good])[0].correct


@pytest.mark.slow
def test_the_batch_deadline_includes_worker_start_up(cfg, monkeypatch):
    """One worker and hanging requests: the kill of the first costs a worker start-up, which must come
    out of the batch's time, not be added to it. No request is given time past the batch's deadline,
    whenever it starts: what each run was given is recorded, and the times are set from this
    machine's start-up (S), so that the second request starts with less than a request's timeout
    left (a budget taken before the start-up, or the whole timeout, overruns it by seconds)."""
    runs: list[tuple[float, float]] = []  # (when a worker was handed a request, the time it was given)
    run = pool_module._Worker.run

    def recorded(worker, req, budget_s):
        runs.append((time.monotonic(), budget_s))
        return run(worker, req, budget_s)

    monkeypatch.setattr(pool_module._Worker, "run", recorded)
    started = time.monotonic()
    with RewardPool(1, 1.0, 1024, config=cfg) as probe:
        probe.warm_up()
    startup = time.monotonic() - started
    timeout = 3 * startup + 2  # more than is left to the second request
    with RewardPool(1, timeout, 1024, config=cfg) as one:
        one.warm_up()
        hang = ScoreRequest("math", r"\boxed{9^{9^{9^{9}}}}", "5", {})
        start = time.monotonic()
        deadline = start + timeout + 3 * startup + 1
        results = one.score_many([hang, hang, hang], deadline=deadline)
        assert len(runs) >= 2 and runs[0][1] == timeout and runs[1][1] < timeout, (runs, startup)
        # 0.1 s covers the few statements between taking the budget and handing it over.
        assert all(at + budget <= deadline + 0.1 for at, budget in runs), (runs, deadline)
        assert results[0].status == "timeout"
        assert all(r.status in ("timeout", "error") for r in results)
        # What never started tells nothing about the response: it is the scorer's failure.
        assert all(r.scorer_failed for r in results if "not started" in r.detail)


# --- The scorer service as a hostile peer's target ------------------------------------------------

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def served(fixture_dir, scorer_process):
    """The service in its own process (so its event loop is measured, not ours): (url, pid)."""
    with scorer_process("--header-timeout-s", str(HEADER_TIMEOUT_S), "--body-timeout-s", str(BODY_TIMEOUT_S),
                        "rewards.workers=1", f"rewards.sql.db_root={fixture_dir / 'databases'}") as server:
        yield server


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field} for {pid}")


def _post_in_thread(url: str, body: bytes) -> tuple[threading.Thread, list]:
    out: list = []

    def post() -> None:
        out.append(httpx.post(f"{url}/v1/score", content=body, timeout=120,
                              headers={"Content-Type": "application/json"}))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, out


def _health_latencies(url: str, thread: threading.Thread) -> list[float]:
    latencies = []
    with httpx.Client(timeout=30) as client:
        while thread.is_alive():
            start = time.monotonic()
            assert client.get(f"{url}/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    return latencies


@pytest.mark.slow
def test_a_body_of_millions_of_tiny_items_neither_stalls_the_service_nor_stays_in_its_memory(served):
    url, pid = served
    tiny = b'{"data_source":"countdown","response":"","ground_truth":0}'
    body = b'{"requests":[' + b",".join([tiny] * 1_000_000) + b"]}"  # 60 MB
    rss_before = _rss_mb(pid)
    start = time.monotonic()
    thread, reply = _post_in_thread(url, body)
    latencies = _health_latencies(url, thread)
    thread.join()
    served_in = time.monotonic() - start
    assert reply[0].status_code == 413 and "requests in one batch" in reply[0].json()["detail"]
    # Measured against the request itself, not a fixed time: a service that decodes the body on its
    # event loop answers /health only once it is through, after most of the request's time.
    assert len(latencies) >= 3 and max(latencies) < served_in / 3, (max(latencies), served_in)
    assert _rss_mb(pid) < rss_before + 150  # the service held the bytes, never a million objects


@pytest.mark.slow
def test_a_ground_truth_bomb_is_built_only_in_a_worker(served):
    url, pid = served
    bomb = b"[" + b",".join([b"{}"] * 6_000_000) + b"]"  # 12 MB of JSON, ~0.5 GB as Python objects
    item = b'{"data_source":"countdown","response":"<answer>1 + 2</answer>","ground_truth":' + bomb + b"}"
    reply = httpx.post(f"{url}/v1/score", content=b'{"requests":[' + item + b"]}", timeout=120)
    assert reply.status_code == 200
    (result,) = reply.json()["results"]
    assert result["status"] == "error", result  # the ground truth's fault: masked by the learner
    assert _rss_mb(pid, "VmHWM") < 300  # the service's peak: it never built the ground truth
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


@pytest.mark.slow
def test_a_100k_deep_ground_truth_is_refused_as_the_callers_fault(served):
    url, _ = served
    deep = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
    item = b'{"data_source":"countdown","response":"<answer>1 + 2</answer>","ground_truth":' + deep + b"}"
    reply = httpx.post(f"{url}/v1/score", content=b'{"requests":[' + item + b"]}", timeout=60)
    assert reply.status_code == 400 and "nested too deep" in reply.json()["detail"], reply.text[:300]


@pytest.mark.slow
def test_slow_clients_are_cut_off(served):
    """200 connections: half never finish their headers, half trickle their body. All are closed by the
    service within its header and body timeouts, and /health answers meanwhile."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    socks = []
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", port))
        if i % 2:
            s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        else:
            s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        s.setblocking(False)
        socks.append(s)
    closed: set[int] = set()
    start = time.monotonic()
    while len(closed) < len(socks) and time.monotonic() - start < HEADER_TIMEOUT_S + BODY_TIMEOUT_S + 5:
        health = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        # A service that waited on a slow client would answer only when that client's timeout cut it
        # off: the header timeout at the least.
        assert time.monotonic() - health < HEADER_TIMEOUT_S
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                if i % 2:
                    s.send(b" ")  # one byte now and then: a trickle
                if s.recv(65536) == b"":
                    closed.add(i)
            except BlockingIOError:
                pass
            except OSError:  # reset by the service
                closed.add(i)
        time.sleep(0.2)
    for s in socks:
        s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} slow connections still open"


def _wait_for(condition, what: str, timeout_s: float = 60.0):
    """Poll `condition()` until it returns something true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"still not {what} after {timeout_s:g} s"
        time.sleep(0.1)
    return value


def _queued_bytes(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["queued_bytes"]


@pytest.mark.slow
def test_clients_that_hang_up_mid_upload_give_their_reservation_back(served):
    """Each claims the largest body (64 MiB), sends i + 1 bytes and hangs up: what arrived is held (never
    the claim), and given back when the client goes."""
    url, _ = served
    port = int(url.rsplit(":", 1)[1])
    for i in range(6):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % (64 * 2**20) + b"[" * (i + 1))
            # A size of its own: what is held tells whose bytes they are, and that no earlier one stayed.
            _wait_for(lambda size=i + 1: _queued_bytes(url) == size, f"upload {i}'s bytes alone held")
    _wait_for(lambda: _queued_bytes(url) == 0, "queued_bytes back to 0")
    honest = httpx.post(f"{url}/v1/score", timeout=60, json={"requests": [
        {"data_source": "countdown", "response": "<answer>2 * (99 - 99) + 24</answer>", "ground_truth": COUNTDOWN}]})
    assert honest.status_code == 200, honest.text
    assert [r["status"] for r in honest.json()["results"]] == ["ok"]
    assert _queued_bytes(url) == 0


@pytest.mark.slow
def test_idle_connections_up_to_the_limit_leave_a_new_client_served(fixture_dir, scorer_process):
    """As many idle connections from 127.0.0.1 as the service holds open: a new client from the same
    address is still served (the connection that has waited longest for its headers is closed for it;
    a cap per address would leave it nothing, every local client being 127.0.0.1)."""
    with scorer_process("--header-timeout-s", "60", "rewards.workers=1") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS)]
        try:
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            closed = 0
            for s in idle:
                s.setblocking(False)
                try:
                    closed += s.recv(1) == b""
                except BlockingIOError:
                    pass
                except OSError:
                    closed += 1
            assert 1 <= closed < MAX_CONNECTIONS // 2, closed  # the oldest made room; the rest stay open
        finally:
            for s in idle:
                s.close()


# --- The learner never trains a scorer's failure as a true zero -------------------------------------

def test_scorer_failures_are_masked_by_the_learner_and_counted():
    """A group of 4: right (1), wrong (0), and two whose scorer died (error, 0). Trained on: the two
    scored completions, with advantages over their rewards alone, (r - mean) / (unbiased std + eps)."""
    import numpy as np

    from dph_async.learner.batching import prepare
    from dph_async.protocol import Batch, Completion, RolloutGroup, SamplingInfo
    from dph_async.rewards.result import RewardResult, failure

    rewards = [RewardResult(1.0, True), RewardResult(0.0, False), failure("error", "reward worker died"),
               failure("error", "scorer service unavailable")]
    comps = [Completion(np.full(3, 10 + i, np.int32), np.full(3, -0.5, np.float32), np.zeros(3, np.int32), r, "stop")
             for i, r in enumerate(rewards)]
    group = RolloutGroup(0, 0, "p0", "x", np.array([1, 2], np.int32), comps, SamplingInfo(1.0, 1.0, -1, 8), 0.0, 0.0)
    eps = 1e-6
    prepared = prepare(Batch(0, [group], [], {}), use_std=True, eps=eps, filter_zero_spread=False)
    assert prepared.scorer_failed == 2
    (unit,) = prepared.groups
    assert [int(s.response_ids[0]) for s in unit] == [10, 11]  # the failed ones' tokens are not trained
    mean, std = 0.5, float(np.std([1.0, 0.0], ddof=1))
    assert [s.advantage for s in unit] == pytest.approx([(1 - mean) / (std + eps), (0 - mean) / (std + eps)],
                                                        rel=1e-12)
