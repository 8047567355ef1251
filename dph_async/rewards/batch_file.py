"""Files of responses to score (for `dph-async score`), and a per-data_source summary of the results.

A row is a JSON object (one per line of a .jsonl file, or a row of a parquet file) with `data_source`,
`response`, `reward_model.ground_truth` (or `ground_truth`) and optionally `extra_info`: the verl
dataset row plus the response.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from dph_async.errors import UserError
from dph_async.rewards.result import RewardResult
from dph_async.rewards.worker import ScoreRequest


class BatchFileError(UserError):
    """A row of a responses file is missing something; the message names the file and row."""


def _request(row: Any, where: str) -> ScoreRequest:
    if not isinstance(row, dict):
        raise BatchFileError(f"{where}: a row must be a JSON object")
    missing = [k for k in ("data_source", "response") if not isinstance(row.get(k), str)]
    if missing:
        raise BatchFileError(f"{where}: missing or non-string {', '.join(missing)}")
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        truth = reward_model["ground_truth"]
    elif "ground_truth" in row:
        truth = row["ground_truth"]
    else:
        raise BatchFileError(f"{where}: no reward_model.ground_truth")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise BatchFileError(f"{where}: extra_info must be an object")
    return ScoreRequest(row["data_source"], row["response"], truth, extra)


def read_requests(path: Path) -> list[ScoreRequest]:
    if not path.is_file():
        raise BatchFileError(f"{path}: no such file")
    if path.suffix == ".parquet":
        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise BatchFileError(f"{path}: not a readable parquet file ({e})") from e
        return [_request(row, f"{path} row {i}") for i, row in enumerate(rows)]
    requests = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BatchFileError(f"{path} line {number}: not JSON ({e.msg})") from e
            requests.append(_request(row, f"{path} line {number}"))
    return requests


@dataclass
class SourceSummary:
    data_source: str
    n: int = 0
    mean_score: float = 0.0
    accuracy: float = 0.0
    format_ok: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    latency_p50_s: float = 0.0
    latency_p95_s: float = 0.0


def summarize(requests: list[ScoreRequest], results: list[RewardResult]) -> list[SourceSummary]:
    """One row per data_source, then "all"."""
    groups: dict[str, list[RewardResult]] = {}
    for req, res in zip(requests, results, strict=True):
        groups.setdefault(req.data_source, []).append(res)
    groups["all"] = list(results)
    out = []
    for source, rs in groups.items():
        if not rs:
            continue
        latency = np.array([r.latency_s for r in rs])
        out.append(SourceSummary(
            data_source=source,
            n=len(rs),
            mean_score=float(np.mean([r.score for r in rs])),
            accuracy=float(np.mean([r.correct for r in rs])),
            format_ok=float(np.mean([r.format_ok for r in rs])),
            statuses=dict(Counter(r.status for r in rs).most_common()),
            latency_p50_s=float(np.percentile(latency, 50)),
            latency_p95_s=float(np.percentile(latency, 95)),
        ))
    return out


def scorer_failures(results: list[RewardResult], most: int = 5) -> list[tuple[str, int]]:
    """The `most` commonest reasons the scorer itself failed (status error or verifier_error: a broken
    reward, plugin or ground truth), with how many results each: what a user fixes first."""
    return Counter(r.detail for r in results if r.scorer_failed).most_common(most)
