"""SQL rewards on the locally built fixture: extraction, BIRD/Spider comparison, partial credit, errors."""

import json
import sqlite3
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from dph_async.cli.main import main
from dph_async.config.rewards import RewardConfig
from dph_async.rewards import context, sql
from dph_async.rewards.fixtures import build_sql_fixture, example_responses, fixture_rows
from dph_async.rewards.sql import extract_sql, resolve_db
from dph_async.rewards.sql_compare import bird_equal, gold_orders, partial_credit, spider_equal
from dph_async.rewards.worker import ScoreRequest, score_one

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "sql"
NAMES_IN_OSLO = {"gold_sql": "SELECT name FROM students WHERE city = 'Oslo'", "db_id": "school"}


@pytest.fixture(scope="module")
def fixture_dir(tmp_path_factory):
    return build_sql_fixture(tmp_path_factory.mktemp("sqlfix")).parent


@pytest.fixture(autouse=True)
def sql_config(fixture_dir):
    cfg = RewardConfig()
    cfg.sql.db_root = str(fixture_dir / "databases")
    context.configure(cfg)
    sql._sandbox = sql._gold_cache = None  # rebuilt from this config
    yield cfg
    context.configure(RewardConfig())
    sql._sandbox = sql._gold_cache = None


def score(source, response, truth, extra=None):
    return score_one(ScoreRequest(source, response, truth, extra or {}))


def block(query: str) -> str:
    return f"Here it is.\n```sql\n{query}\n```"


def test_every_gold_query_scores_correct(fixture_dir):
    rows = pq.read_table(fixture_dir / "sql_fixture.parquet").to_pylist()
    assert len(rows) == 24 and {r["data_source"] for r in rows} == {"bird", "spider"}
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert "CREATE TABLE" in row["prompt"][1]["content"]
        result = score(row["data_source"], block(truth["gold_sql"]), truth, row["extra_info"])
        assert (result.score, result.correct, result.status) == (1.0, True, "ok"), (truth, result)


def test_extraction_takes_the_last_closed_sql_block():
    text = ("```sql\nSELECT 1\n```\nthen\n```python\nx = 1\n```\n"
            "```SQL\nSELECT 2 >  = 1\n```\n```sql\nSELECT 3")
    assert extract_sql(text) == "SELECT 2 >= 1"  # unclosed last fence ignored, "> =" joined
    assert extract_sql("no code here") is None
    assert extract_sql("```\nSELECT 1\n```") is None  # an untagged block is not SQL


def test_missing_block_is_a_parse_error():
    result = score("bird", "SELECT name FROM students", NAMES_IN_OSLO)
    assert (result.score, result.format_ok, result.status) == (0.0, False, "parse_error")


def test_bird_compares_sets_of_rows():
    assert bird_equal([(1, "a"), (1, "a"), (2, "b")], [(2, "b"), (1, "a")])
    assert not bird_equal([("a", 1)], [(1, "a")])  # column order matters
    reordered = block("SELECT name FROM students WHERE city = 'Oslo' ORDER BY name DESC")
    assert score("bird", reordered, NAMES_IN_OSLO).correct


def test_spider_compares_bags_with_column_permutations_and_gold_order():
    assert spider_equal([("a", 1), ("b", 2)], [(1, "a"), (2, "b")], 2, 2, order_matters=False)
    assert not spider_equal([(1,), (1,), (2,)], [(1,), (2,), (2,)], 1, 1, order_matters=False)  # bags
    assert not spider_equal([(2,), (1,)], [(1,), (2,)], 1, 1, order_matters=True)
    assert spider_equal([(2,), (1,)], [(1,), (2,)], 1, 1, order_matters=False)
    assert spider_equal([], [], 1, 3, order_matters=False)
    assert gold_orders("select a from t ORDER\n  BY a") and not gold_orders("select border_by from t")
    truth = {"gold_sql": "SELECT name, year FROM students WHERE year = 4", "db_id": "school"}
    swapped = score("spider", block("SELECT year, name FROM students WHERE year = 4"), truth)
    assert swapped.correct
    assert not score("bird", block("SELECT year, name FROM students WHERE year = 4"), truth).correct


def test_spider_respects_order_when_the_gold_query_orders():
    truth = {"gold_sql": "SELECT name FROM students ORDER BY name", "db_id": "school"}
    assert score("spider", block("SELECT name FROM students ORDER BY name"), truth).correct
    assert not score("spider", block("SELECT name FROM students ORDER BY name DESC"), truth).correct
    assert score("bird", block("SELECT name FROM students ORDER BY name DESC"), truth).correct


def test_partial_credit_formula_and_switch(sql_config):
    # One gold column; the prediction has it plus another: k=1 -> 0.8 * 1 / (1 * 2).
    assert partial_credit([("a", 1), ("b", 2)], [("a",), ("b",)], 2, 1) == pytest.approx(0.4)
    assert partial_credit([("a", "x"), ("b", "y")], [("a", "x"), ("c", "y")], 2, 2) == pytest.approx(0.2)
    assert partial_credit([("z",)], [("a",)], 1, 1) == 0.0
    extra = block("SELECT name, city FROM students WHERE city = 'Oslo'")
    result = score("bird", extra, NAMES_IN_OSLO)
    assert (result.score, result.correct, result.status) == (pytest.approx(0.4), False, "ok")
    sql_config.sql.partial_credit = False
    assert score("bird", extra, NAMES_IN_OSLO).score == 0.0


def test_ground_truth_forms(fixture_dir):
    query = block(NAMES_IN_OSLO["gold_sql"])
    assert score("sql", query, json.dumps(NAMES_IN_OSLO)).correct  # DPH-RL stores it as JSON text
    assert score("sql", query, NAMES_IN_OSLO["gold_sql"], {"db_id": "school"}).correct
    assert score("sql", query, {**NAMES_IN_OSLO, "db_id": "school.sqlite"}).correct  # DPH-RL's id form
    assert score("sql", query, {**NAMES_IN_OSLO, "db_id": "school/school.sqlite"}).correct
    bad = score("sql", query, {"gold_sql": "SELECT 1"})
    assert bad.status == "error" and "db_id" in bad.detail


def test_database_lookup_stays_inside_the_root(fixture_dir):
    root = str(fixture_dir / "databases")
    assert resolve_db(root, "shop").name == "shop.sqlite"
    assert resolve_db(root, "../databases/shop/shop.sqlite").name == "shop.sqlite"  # still inside
    for db_id in ("../sql_fixture.parquet", "../../../../etc/passwd", "/etc/passwd", "nope"):
        with pytest.raises(ValueError, match="not found"):
            resolve_db(root, db_id)
    with pytest.raises(ValueError, match="db_root"):
        resolve_db(None, "shop")


def test_failures_are_statuses_not_exceptions(sql_config):
    result = score("bird", block("SELECT nme FROM students"), NAMES_IN_OSLO)
    assert (result.status, result.format_ok, result.score) == ("exec_error", True, 0.0)
    gold_broken = score("bird", block("SELECT 1"), {"gold_sql": "SELECT * FROM nowhere", "db_id": "school"})
    assert gold_broken.status == "error" and "gold query failed" in gold_broken.detail
    missing_db = score("bird", block("SELECT 1"), {"gold_sql": "SELECT 1", "db_id": "atlantis"})
    assert missing_db.status == "error"
    sql_config.sql.db_root = None
    assert score("bird", block("SELECT 1"), NAMES_IN_OSLO).status == "error"


def test_gold_results_are_cached():
    query = block(NAMES_IN_OSLO["gold_sql"])
    assert score("bird", query, NAMES_IN_OSLO).correct
    _, cache = sql._state()
    path = resolve_db(context.config().sql.db_root, "school")
    cached = cache.get((path, NAMES_IN_OSLO["gold_sql"]))
    assert cached is not None and sorted(cached.rows) == [("Ben",), ("Hana",)]


def test_shipped_example_matches_the_generator(fixture_dir):
    shipped = pq.read_table(EXAMPLES / "sql_fixture.parquet").to_pylist()
    assert shipped == fixture_rows(fixture_dir / "databases")
    lines = (EXAMPLES / "responses.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == example_responses(shipped)
    for db_id in ("school", "shop", "flights"):
        shipped_db, generated_db = (d / "databases" / db_id / f"{db_id}.sqlite" for d in (EXAMPLES, fixture_dir))
        assert _contents(shipped_db) == _contents(generated_db)


def _contents(path: Path) -> dict[str, list]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: conn.execute(f"SELECT * FROM {t}").fetchall() for t in tables}
    finally:
        conn.close()


def test_score_command_on_the_shipped_example(tmp_path, capsys):
    out = tmp_path / "results.jsonl"
    code = main(["score", str(EXAMPLES / "responses.jsonl"), f"rewards.sql.db_root={EXAMPLES / 'databases'}",
                 "rewards.timeout_s=1", "--out", str(out)])
    assert code == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 31 and sum(r["correct"] for r in results) == 24
    statuses = {r["status"] for r in results[24:]}
    assert statuses == {"ok", "parse_error", "rejected", "timeout"}
    assert "accuracy" in capsys.readouterr().out


def test_score_command_names_bad_rows(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"data_source": "bird", "response": "x", "reward_model": {"ground_truth": {}}}\n{oops\n')
    assert main(["score", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err
    bad.write_text('{"data_source": "nope_ds", "response": "x", "ground_truth": 1}\n')
    assert main(["score", str(bad)]) == 2
    assert "nope_ds" in capsys.readouterr().err
