"""A tiny staleness sweep with the real processes (Ray, vLLM actors, DeepSpeed learner), as
docs/ablations.md describes it: a cell killed midway resumes from its checkpoint beside a new cell
of a grown grid; finished cells do not run again; the summary table, summary.json and the plots
hold the figures of the cells' own records; `--report-only` rewrites the summary and runs nothing;
a different base config in the same `--out` is refused, unless `--fresh`, which starts over (there a
divergence sweep, whose pi_0 is evaluated twice, on two draws of its samples).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.figure
import numpy as np
import pytest
from conftest import SMALL, copy_base, session_members

from dph_async.cli.main import main
from dph_async.runtime.evaluate import load_results

pytestmark = pytest.mark.slow

STEPS, POINTS = 6, 2  # checkpoints (and evaluations) at versions 3 and 6


def args(out: Path, etas: list[str], *extra: str, steps: int = STEPS, points: int = POINTS) -> list[str]:
    return ["ablate", "staleness", *SMALL, *extra, "--steps", str(steps), "--eval-points", str(points),
            "--corrections", "decoupled", "--seeds", "0", "--out", str(out), "--etas", *etas]


@pytest.fixture
def figures(monkeypatch) -> dict[str, matplotlib.figure.Figure]:
    """Every figure saved during the test, by file name (the real savefig still writes it)."""
    seen: dict[str, matplotlib.figure.Figure] = {}
    save = matplotlib.figure.Figure.savefig

    def keep(fig, path, *a, **kw):
        seen[Path(path).name] = fig
        return save(fig, path, *a, **kw)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    return seen


def kill_midway(out: Path, cell: str) -> None:
    """Run the sweep as a user would, and SIGKILL its whole process group once the cell has its first
    checkpoint (the run is then mid-cell: more steps and the evaluations are still to come)."""
    latest = out / "rl" / cell / "checkpoints" / "latest"
    proc = subprocess.Popen([sys.executable, "-m", "dph_async.cli.main", *args(out, ["1"])], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not latest.is_file():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 60
    while session_members(proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not session_members(proc.pid)
    assert not (out / "rl" / cell / "cell.json").exists(), "the kill came after the cell had finished"


def stamps(cell_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in cell_dir.glob("*.json*")}


def test_tiny_staleness_sweep_resumes_grows_and_reports(small_base, tmp_path, figures):
    out = tmp_path / "sweep"
    copy_base(small_base, out)  # the same base config: the sweep's warm start and pre-sampling are skipped
    first = out / "rl" / "eta1-decoupled-seed0"
    kill_midway(out, first.name)
    # The command again, its grid grown by one cell (one invocation: one actor process for both): the
    # stopped cell resumes, the new one runs from its start.
    assert main(args(out, ["0", "1"])) == 0
    assert json.loads((first / "cell.json").read_text())["resumed"] is True
    rows = [json.loads(x) for x in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["learner/version"] for r in rows] == [float(v) for v in range(1, STEPS + 1)]  # none twice
    second = out / "rl" / "eta0-decoupled-seed0"
    assert json.loads((second / "cell.json").read_text())["resumed"] is False
    # Once more: both cells finished, neither runs again.
    before = {c: stamps(c) for c in (first, second)}
    assert main(args(out, ["0", "1"])) == 0
    assert {c: stamps(c) for c in (first, second)} == before

    summary = json.loads((out / "summary.json").read_text())
    assert [g["name"] for g in summary["groups"]] == ["eta0-decoupled", "eta1-decoupled"]
    table = (out / "summary.md").read_text()
    assert "Resumed after an interruption" in table and "eta1-decoupled-seed0" in table.split("Resumed")[1]
    for cell_dir, eta in ((second, 0), (first, 1)):
        rows = [json.loads(x) for x in (cell_dir / "metrics.jsonl").read_text().splitlines()]
        # Pass@k along the run: the checkpoint at version 3 and the final model, besides the base.
        assert sorted(p.name for p in (cell_dir / "eval").glob("v*.json")) == ["v3.json", "v6.json"]
        cell = next(c for c in summary["cells"] if c["key"] == cell_dir.name)
        assert [e["version"] for e in cell["evals"]] == [0, 3, 6]
        final_eval = json.loads((cell_dir / "eval" / "v6.json").read_text())
        assert cell["evals"][-1]["splits"]["in_domain"]["pass_at_k"]["4"] == final_eval["in_domain"]["pass_at_k"]["4"]
        staleness = sum(r["staleness/mean"] for r in rows) / len(rows)
        replay = json.loads((cell_dir / "result.json").read_text())["replay"]
        assert cell["staleness_hist"] == {str(k): v for k, v in replay["staleness_hist"].items()}
        assert max(int(s) for s in cell["staleness_hist"]) <= eta
        group = next(g for g in summary["groups"] if g["name"] == f"eta{eta}-decoupled")
        assert group["metrics"]["staleness"]["mean"] == pytest.approx(staleness)
        last = rows[-(len(rows) // 5):]  # the mean over the last fifth of the steps
        assert group["metrics"]["reward"]["mean"] == pytest.approx(sum(r["reward/mean"] for r in last) / len(last))
        # The table's row for this eta holds the same figures.
        row = next(line for line in table.splitlines() if line.startswith(f"| {eta} | decoupled | 1 |"))
        cols = [c.strip() for c in row.strip("|").split("|")]
        assert cols[3] == f"{group['metrics']['reward']['mean']:.3f}"
        assert cols[4] == f"{100 * final_eval['in_domain']['greedy_accuracy']:.1f}"
        assert f"| {staleness:.2f} |" in row
    assert "## Against eta = 0" in table
    check_plots(figures, summary, out)

    # --report-only: the summary again from the finished cells, nothing run.
    (out / "summary.md").unlink()
    cells_before = {c: stamps(out / "rl" / c) for c in (first.name, second.name)}
    assert main([*args(out, ["0", "1"]), "--report-only"]) == 0
    assert (out / "summary.md").read_text() == table
    assert {c: stamps(out / "rl" / c) for c in cells_before} == cells_before


def check_plots(figures: dict, summary: dict, out: Path) -> None:
    """The sweep's figures show the data of summary.json: lines, bars and axes, not just pixels."""
    assert {"curves.png", "pass_at_k.png", "staleness.png", "summary.png"} <= set(figures)
    for name in ("curves.png", "pass_at_k.png", "staleness.png", "summary.png"):
        assert (out / "plots" / name).stat().st_size > 0
    cells = {c["group"]: c for c in summary["cells"]}
    groups = {g["name"]: g for g in summary["groups"]}
    # Pass@4 (solid) of each group at its evaluated versions, on the in-domain panel.
    ax = next(a for a in figures["pass_at_k.png"].axes if a.get_title() == "in_domain, correction=decoupled")
    solid = {line.get_label(): line for line in ax.get_lines() if line.get_linestyle() == "-"}
    assert set(solid) == {"eta=0", "eta=1"}
    for label, line in solid.items():
        cell = cells[f"eta{label[4:]}-decoupled"]
        np.testing.assert_allclose(line.get_ydata(), [100 * e["splits"]["in_domain"]["pass_at_k"]["4"]
                                                      for e in cell["evals"]])
        np.testing.assert_allclose(line.get_xdata(), [e["samples"] for e in cell["evals"]])
    # Staleness: each bar the share of the group's consumed groups at that staleness.
    (ax,) = figures["staleness.png"].axes
    heights = sorted(round(p.get_height(), 9) for p in ax.patches)
    want = sorted(round(n / sum(c["staleness_hist"].values()), 9) for c in cells.values()
                  for n in c["staleness_hist"].values())
    assert heights == want
    # Summary: the final reward per eta, one line per correction, with its group means.
    ax = next(a for a in figures["summary.png"].axes if a.get_title() == "final training reward")
    # errorbar() labels its container; the container's first line is the data line.
    (bars,) = [c for c in ax.containers if c.get_label() == "correction=decoupled"]
    line = bars.lines[0]
    assert list(line.get_xdata()) == [0, 1]
    want = [groups[f"eta{e}-decoupled"]["metrics"]["reward"]["mean"] for e in (0, 1)]
    np.testing.assert_allclose(np.asarray(line.get_ydata(), float), want)


def test_a_different_base_config_is_refused_unless_fresh(small_base, tmp_path, capsys):
    out = tmp_path / "sweep"
    copy_base(small_base, out)
    (out / "config.yaml").write_text("seed: 7\n")  # what a sweep with another base config left there
    (out / "rl" / "eta9-decoupled-seed0").mkdir(parents=True)  # and one of its cells
    assert main(args(out, ["0"])) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "holds a sweep with another base config" in err and "--fresh" in err
    assert (out / "rl" / "eta9-decoupled-seed0").is_dir() and (out / "base_model").is_dir()  # nothing touched

    # --fresh starts over: the old cells go, and the shared base is made again from this config. The
    # sweep that starts over is a divergence sweep of one cell, whose evaluation of pi_0 also draws
    # its samples a second time (base_redraw, the per-band table's pi_0 row).
    old_base = (out / "base_model" / "config.json").stat().st_mtime_ns
    # (A base of 10 warm-start steps: what is checked is that it is made again, not what it knows.)
    assert main(["ablate", "divergence", *SMALL, "warmstart.steps=10", "--modes", "grpo", "--steps", "2",
                 "--eval-points", "1", "--seeds", "0", "--out", str(out), "--fresh"]) == 0
    assert sorted(p.name for p in (out / "rl").iterdir()) == ["grpo-seed0"]
    assert (out / "base_model" / "config.json").stat().st_mtime_ns != old_base
    assert (out / "config.yaml").read_text() != "seed: 7\n"
    base, redraw = (load_results(out / "eval" / f"{name}.json") for name in ("base", "base_redraw"))
    for split in base:  # pi_0 both times: the same greedy answer on every prompt, and all its samples
        assert [(r.prompt_id, r.greedy) for r in base[split].per_prompt] == \
            [(r.prompt_id, r.greedy) for r in redraw[split].per_prompt]
        assert redraw[split].samples == base[split].samples > 0
    assert "pi_0's row is a second draw of its samples" in " ".join((out / "summary.md").read_text().split())
