"""Hostile model outputs: each scores 0 with a status, within its deadline, writes nothing, and leaves the
worker pool and the scorer service serving."""

import hashlib
import random
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.fixtures import build_sql_fixture
from dph_async.rewards.pool import RewardPool, ScoreRequest
from dph_async.rewards.service import make_app

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
