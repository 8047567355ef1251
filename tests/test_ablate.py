"""A tiny staleness sweep with the real processes (Ray, vLLM actors, DeepSpeed learner): it runs to
completion, a second invocation with a grown grid runs only the new cell, and the summary table,
summary.json and plots hold the figures of the cells' own records.
"""

from __future__ import annotations

import json

import matplotlib.image
import pytest

from dph_async.app.cli import main

pytestmark = pytest.mark.slow

TINY = ["warmstart.steps=20", "task.num_train=40", "task.num_test=16", "eval.max_prompts=8", "eval.k_max=4",
        "learner.groups_per_step=4", "sampling.n=4", "sampling.max_tokens=8", "actors.max_inflight_prompts=4",
        "learner.loss.objective=grpo"]


def sweep(out, etas: list[str]) -> int:
    return main(["ablate", "staleness", *TINY, "--steps", "2", "--eval-points", "2", "--corrections", "decoupled",
                 "--seeds", "0", "--out", str(out), "--etas", *etas])


def test_tiny_staleness_sweep_runs_resumes_and_reports(tmp_path):
    out = tmp_path / "sweep"
    assert sweep(out, ["1"]) == 0
    first = out / "rl" / "eta1-decoupled-seed0"
    record = (first / "cell.json").read_text()
    stamps = {f: (first / f).stat().st_mtime_ns for f in ("cell.json", "result.json", "metrics.jsonl")}

    # The grid grows by one cell: only that one runs, the finished one is left as it was.
    assert sweep(out, ["0", "1"]) == 0
    assert {f: (first / f).stat().st_mtime_ns for f in stamps} == stamps
    assert (first / "cell.json").read_text() == record
    second = out / "rl" / "eta0-decoupled-seed0"
    assert (second / "cell.json").is_file()

    summary = json.loads((out / "summary.json").read_text())
    assert [g["name"] for g in summary["groups"]] == ["eta0-decoupled", "eta1-decoupled"]
    table = (out / "summary.md").read_text()
    for cell_dir, eta in ((second, 0), (first, 1)):
        rows = [json.loads(x) for x in (cell_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["learner/version"] for r in rows] == [1.0, 2.0]
        # Pass@k along the run: the checkpoint at version 1 and the final model, besides the base.
        assert sorted(p.name for p in (cell_dir / "eval").glob("v*.json")) == ["v1.json", "v2.json"]
        cell = next(c for c in summary["cells"] if c["key"] == cell_dir.name)
        assert [e["version"] for e in cell["evals"]] == [0, 1, 2]
        final_eval = json.loads((cell_dir / "eval" / "v2.json").read_text())
        assert cell["evals"][-1]["splits"]["in_domain"]["pass_at_k"]["4"] == final_eval["in_domain"]["pass_at_k"]["4"]
        staleness = sum(r["staleness/mean"] for r in rows) / len(rows)
        replay = json.loads((cell_dir / "result.json").read_text())["replay"]
        assert cell["staleness_hist"] == {str(k): v for k, v in replay["staleness_hist"].items()}
        assert max(int(s) for s in cell["staleness_hist"]) <= eta
        group = next(g for g in summary["groups"] if g["name"] == f"eta{eta}-decoupled")
        assert group["metrics"]["staleness"]["mean"] == pytest.approx(staleness)
        assert group["metrics"]["reward"]["mean"] == pytest.approx(rows[-1]["reward/mean"])  # last fifth of 2 steps
        # The table's row for this eta holds the same figures.
        row = next(line for line in table.splitlines() if line.startswith(f"| {eta} | decoupled | 1 |"))
        cols = [c.strip() for c in row.strip("|").split("|")]
        assert cols[3] == f"{rows[-1]['reward/mean']:.3f}"
        assert cols[4] == f"{100 * final_eval['in_domain']['greedy_accuracy']:.1f}"
        assert f"| {staleness:.2f} |" in row
    for name in ("curves", "pass_at_k", "staleness", "summary"):
        image = matplotlib.image.imread(out / "plots" / f"{name}.png")
        assert image.shape[0] > 100 and image.shape[1] > 100
    assert "## Against eta = 0" in table
