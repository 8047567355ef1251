"""Comparing a predicted query's result with the gold result.

- BIRD: the two results are equal as sets of rows (row order and duplicates ignored, column order kept).
- Spider (test-suite semantics): equal as bags of rows under some permutation of the predicted columns;
  as ordered lists when the gold query has ORDER BY.
- Partial credit (DPH-RL's scorer, for results that are not equal): k gold columns whose set of values
  equals the set of values of some predicted column give 0.8 * min(k^2 / (gold columns * predicted
  columns), 1).
"""

from __future__ import annotations

import itertools
import re
from collections import Counter

# Past this many column assignments looked at, the results count as different (bounds very wide results
# whose columns all hold the same values).
MAX_PERMUTATIONS = 10_000
PARTIAL_CREDIT_MAX = 0.8

_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


def gold_orders(gold_sql: str) -> bool:
    """Whether row order matters: the gold query has an ORDER BY (anywhere, as Spider's evaluation does)."""
    return _ORDER_BY.search(gold_sql) is not None


def bird_equal(pred: list[tuple], gold: list[tuple]) -> bool:
    return set(pred) == set(gold)


def spider_equal(pred: list[tuple], gold: list[tuple], pred_columns: int, gold_columns: int,
                 order_matters: bool) -> bool:
    if not pred and not gold:
        return True
    if len(pred) != len(gold) or pred_columns != gold_columns:
        return False
    # A gold column can only be matched by a predicted column holding the same multiset of values.
    gold_cols = [Counter(col) for col in zip(*gold, strict=True)]
    pred_cols = [Counter(col) for col in zip(*pred, strict=True)]
    # Each column's own position first, so the common case (same column order) is tried first.
    candidates = [sorted((j for j, p in enumerate(pred_cols) if p == g), key=lambda j, i=i: j != i)
                  for i, g in enumerate(gold_cols)]
    if any(not c for c in candidates):
        return False
    gold_bag = Counter(gold)
    for tried, perm in enumerate(itertools.product(*candidates)):
        if tried >= MAX_PERMUTATIONS:
            return False
        if len(set(perm)) < len(perm):  # two gold columns mapped to one predicted column
            continue
        permuted = [tuple(row[j] for j in perm) for row in pred]
        if permuted == gold if order_matters else Counter(permuted) == gold_bag:
            return True
    return False


def _column_sets(rows: list[tuple], columns: int) -> list[set]:
    return [set(col) for col in zip(*rows, strict=True)] if rows else [set() for _ in range(columns)]


def partial_credit(pred: list[tuple], gold: list[tuple], pred_columns: int, gold_columns: int) -> float:
    """DPH-RL's column-overlap credit in [0, 0.8] for a result that is not an exact match."""
    if pred_columns == 0 or gold_columns == 0:
        return 0.0
    pred_sets = _column_sets(pred, pred_columns)
    gold_sets = _column_sets(gold, gold_columns)
    k = sum(1 for g in gold_sets if any(g == p for p in pred_sets))
    return PARTIAL_CREDIT_MAX * min(k * k / (gold_columns * pred_columns), 1.0)
