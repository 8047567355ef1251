"""`dph-async rerun` of a real asynchronous run (Ray, two vLLM actors, the replay, the DeepSpeed
learner) at the small size, with replay.max_staleness=auto steering eta as it goes.

What that proves:
- the learner recorded every step, and the command re-trains it in a process of its own, without any
  of the run's other processes, bit for bit: every metric but the clock's (the controller's
  decisions included) and the weights at every checkpoint and at the final model;
- with another DPH coefficient the same batches train a counterfactual learner: other weights, the
  same data (rewards, batch sizes), a report of both side by side;
- the controller's decisions reached the replay (its groups kept within the bound it set) and were
  written to the metrics and the timeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, copy_base, small_config

from dph_async.paths import RunPaths
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import StageTimer, prepare, train_mode
from dph_async.runtime.cluster import ray_cluster

pytestmark = pytest.mark.slow

STEPS = 8
RUN = [f"learner.steps={STEPS}", "actors.num_actors=2", "learner.checkpoint_every=3", "learner.keep_checkpoints=0",
       "replay.max_staleness=auto", "replay.staleness_window=2", "replay.staleness_max=3",
       "replay.staleness_target_ess=0.5"]


@pytest.fixture(scope="module")
def rl_dir(small_base, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rerun-run")
    copy_base(small_base, root)
    cfg = small_config(root, *RUN)
    spec = RunSpec.parse("js_low_var")
    paths = RunPaths(root)
    with ray_cluster(cfg):
        prepared = prepare(cfg, paths, StageTimer(), need_presample=True)
        train_mode(cfg, paths, prepared, spec, paths.rl(spec.slug), StageTimer())
    return paths.rl(spec.slug)


def rerun(rl_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dph_async.cli.main", "rerun", str(rl_dir), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_run_steered_eta_and_told_the_replay(rl_dir):
    rows = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS and all("staleness/eta" in r for r in rows)
    decided = [r for r in rows if "staleness/signal" in r]
    assert [int(r["learner/version"]) for r in decided] == [2, 4, 6, 8]
    # Each batch kept within the bound in force when it was served (the one decided before it).
    bound = 1
    for r in rows:
        assert r["staleness/max"] <= bound
        bound = int(r["staleness/eta"])
    timeline = json.loads((rl_dir / "timeline.json").read_text())
    changes = [(eta, signal, wait) for _, eta, signal, wait in timeline["staleness"]]
    assert changes == [(int(r["staleness/eta"]), r["staleness/signal"], r["staleness/wait"]) for r in decided
                       if r["staleness/change"]]


def test_a_rerun_of_an_async_run_is_the_run_bit_for_bit(rl_dir, tmp_path):
    out = tmp_path / "same"
    proc = rerun(rl_dir, "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["bitwise"] and not report["counterfactual"], report["verdict"]
    assert [s["version"] for s in report["steps"]] == list(range(1, STEPS + 1))
    assert [w["what"] for w in report["weights"]] == ["checkpoint v3", "checkpoint v6", "final model"]
    assert "bitwise the run" in proc.stderr


def test_a_counterfactual_coefficient_trains_other_weights_on_the_same_batches(rl_dir, tmp_path):
    out = tmp_path / "coeff"
    proc = rerun(rl_dir, "learner.loss.coeff=1.0", "-o", str(out), "--diagnose", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["counterfactual"] and not report["bitwise"]
    assert all(not w["equal"] and w["distance"] > 0 for w in report["weights"])
    for s in report["steps"]:
        assert not {"reward/mean", "batch/fresh_tokens", "batch/reference_samples"} & set(s["differing"])
    assert any("loss/total" in s["differing"] for s in report["steps"])
    assert (out / "final_model" / "config.json").is_file()
    diag = json.loads((out / "diagnose_v4.json").read_text())
    assert diag["version"] == 4 and diag["parts"] and diag["top_tokens"]
