"""Text-to-SQL rewards (DPH-RL's training task): run the gold and the predicted query, compare results.

Registered data_sources: "sql" (DPH-RL's name; comparison from the sample or `rewards.sql.compare`),
"bird" (set comparison by default) and "spider" (bag comparison with column permutations).

ground_truth: {"gold_sql": str, "db_id": str, "cmp_method": "bird" | "spider" (optional)}, as a dict
or as its JSON text (DPH-RL's format); or the gold SQL as a plain string with `db_id` (and optionally
`cmp_method`) in extra_info.

The prediction is the last ```sql fenced block of the response. Score 1 (correct) on an exact match;
otherwise DPH-RL's partial credit (at most 0.8, switchable off) or 0.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dph_async.rewards import context
from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult, failure
from dph_async.rewards.sql_compare import bird_equal, gold_orders, partial_credit, spider_equal
from dph_async.rewards.sql_sandbox import QueryOutcome, SqlLimits, SqlSandbox

CompareMode = Literal["bird", "spider"]
# Gold results with more rows are recomputed each time rather than held in memory.
CACHE_MAX_ROWS = 10_000
# Tokenizers sometimes split comparison operators ("> ="), which sqlite rejects; DPH-RL's scorer joins
# them back, and so do we, so that rewards match its training.
_SPLIT_OPERATOR = re.compile(r"([<>!])\s+=")


@dataclass(frozen=True)
class SqlGroundTruth:
    gold_sql: str
    db_id: str
    compare: CompareMode | None


def extract_sql(response: str) -> str | None:
    """The last ```sql fenced block, or None. Linear time: no regex backtracking over long responses."""
    parts = response.split("```")
    # Fenced contents are the odd parts; with an even number of parts the last fence is unclosed.
    last_closed = len(parts) - 1 if len(parts) % 2 == 1 else len(parts) - 2
    for i in range(last_closed - 1, 0, -2):
        block = parts[i]
        head, newline, body = block.partition("\n")
        if newline and head.strip().lower() == "sql":
            return _SPLIT_OPERATOR.sub(r"\1=", body.strip())
    return None


def parse_ground_truth(ground_truth: Any, extra_info: dict) -> SqlGroundTruth:
    if isinstance(ground_truth, str) and ground_truth.lstrip().startswith("{"):
        try:
            ground_truth = json.loads(ground_truth)
        except RecursionError:  # the dataset's row, not the response: an error, never "rejected"
            raise ValueError("SQL ground_truth JSON is nested too deep") from None
    if isinstance(ground_truth, dict):
        fields = ground_truth
        gold = fields.get("gold_sql")
    else:
        fields = extra_info
        gold = ground_truth
    db_id, compare = fields.get("db_id"), fields.get("cmp_method")
    if not isinstance(gold, str) or not gold.strip():
        raise ValueError("SQL ground_truth needs a gold query (ground_truth.gold_sql or a string)")
    if not isinstance(db_id, str) or not db_id:
        raise ValueError("SQL ground_truth needs a db_id (ground_truth.db_id or extra_info.db_id)")
    if compare not in (None, "bird", "spider"):
        raise ValueError(f"cmp_method must be 'bird' or 'spider', got {compare!r}")
    return SqlGroundTruth(gold, db_id, compare)


def resolve_db(root: str | None, db_id: str) -> Path:
    """The sqlite file for a db_id under `root`, in the BIRD/Spider layout `root/<db>/<db>.sqlite`.

    "x" -> root/x/x.sqlite (or root/x.sqlite); "x.sqlite" -> root/x/x.sqlite (DPH-RL); an id with a
    "/" is a path relative to root. The file must lie inside root.
    """
    if root is None:
        raise ValueError("rewards.sql.db_root is not set: it names the directory holding the databases")
    base = Path(root).resolve()
    if "/" in db_id:
        options = [base / db_id]
    elif db_id.endswith(".sqlite"):
        options = [base / db_id[: -len(".sqlite")] / db_id, base / db_id]
    else:
        options = [base / db_id / f"{db_id}.sqlite", base / f"{db_id}.sqlite"]
    for path in options:
        path = path.resolve()
        if path.is_relative_to(base) and path.is_file():
            return path
    raise ValueError(f"database {db_id!r} not found under {root}")


class _GoldCache:
    """Gold query results per (database, query), least recently used dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[tuple[Path, str], QueryOutcome] = OrderedDict()

    def get(self, key: tuple[Path, str]) -> QueryOutcome | None:
        outcome = self._items.get(key)
        if outcome is not None:
            self._items.move_to_end(key)
        return outcome

    def put(self, key: tuple[Path, str], outcome: QueryOutcome) -> None:
        if self.size == 0 or outcome.status != "ok" or len(outcome.rows) > CACHE_MAX_ROWS:
            return
        self._items[key] = outcome
        if len(self._items) > self.size:
            self._items.popitem(last=False)


_sandbox: SqlSandbox | None = None
_gold_cache: _GoldCache | None = None


def _state() -> tuple[SqlSandbox, _GoldCache]:
    """This process's sandbox and gold cache, made from the reward config on first use."""
    global _sandbox, _gold_cache
    if _sandbox is None or _gold_cache is None:
        cfg = context.config().sql
        limits = SqlLimits(cfg.max_rows, cfg.max_value_bytes, cfg.max_sql_chars, cfg.heap_limit_mb)
        _sandbox = SqlSandbox(limits)
        _gold_cache = _GoldCache(cfg.gold_cache_size)
    return _sandbox, _gold_cache


def score_sql(response: str, ground_truth: Any, extra_info: dict,
              default_compare: CompareMode | None) -> RewardResult:
    cfg = context.config().sql
    gt = parse_ground_truth(ground_truth, extra_info)
    path = resolve_db(cfg.db_root, gt.db_id)
    sql = extract_sql(response)
    if sql is None:
        return failure("parse_error", "no ```sql block in the response")
    sandbox, cache = _state()
    deadline = context.deadline()
    gold = cache.get((path, gt.gold_sql))
    if gold is None:
        context.stage("reference", format_ok=True)
        gold = sandbox.run(path, gt.gold_sql, deadline)
        cache.put((path, gt.gold_sql), gold)
    if gold.status != "ok":
        # Not the response's fault: the dataset's gold query does not run here.
        return failure("error", f"gold query failed ({gold.status}): {gold.detail}", format_ok=True)
    context.stage("response", format_ok=True)
    pred = sandbox.run(path, sql, deadline)
    if pred.status != "ok":
        return failure(pred.status, pred.detail, format_ok=True)
    compare = gt.compare or default_compare or cfg.compare
    if compare == "bird":
        exact = bird_equal(pred.rows, gold.rows)
    else:
        exact = spider_equal(pred.rows, gold.rows, pred.columns, gold.columns, gold_orders(gt.gold_sql))
    if exact:
        return RewardResult(score=1.0, correct=True)
    credit = partial_credit(pred.rows, gold.rows, pred.columns, gold.columns) if cfg.partial_credit else 0.0
    return RewardResult(score=credit, correct=False, detail=f"results differ ({compare})")


@register("sql")
def sql_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    return score_sql(response, ground_truth, extra_info, None)


@register("bird")
def bird_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    return score_sql(response, ground_truth, extra_info, "bird")


@register("spider")
def spider_reward(response: str, ground_truth: Any, extra_info: dict) -> RewardResult:
    return score_sql(response, ground_truth, extra_info, "spider")
