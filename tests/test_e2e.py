"""The real system at a small size: Ray, vLLM actors in their own processes, the replay service, the
DeepSpeed learner, ZeroMQ between them. Async and sync runs, resume against an uninterrupted run, an
actor killed mid-run, and Ctrl-C in the middle of `dph-async run`: it exits with 130 within seconds,
leaving no process of its session (Ray's services, the learner, the vLLM actors) and no new
shared-memory file.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dph_async.app.launcher import RLResult, ray_cluster, run_rl
from dph_async.app.pipeline import StageTimer, prepare, validate
from dph_async.app.specs import RunSpec
from dph_async.config import RunConfig, load_config
from dph_async.paths import RunPaths

pytestmark = pytest.mark.slow

SMALL = [
    "warmstart.steps=60", "task.num_train=64", "task.num_test=16", "learner.groups_per_step=4",
    "sampling.n=4", "sampling.max_tokens=10", "eval.k_max=4", "eval.max_prompts=8", "actors.max_inflight_prompts=4",
    "logging.wandb_mode=disabled", "learner.checkpoint_every=0",
    # A barely warm-started pi_0 rarely solves a prompt k times out of k: keep any prompt it solved
    # once, so the DPH objective has a reference pool to train on.
    "presample.min_correct=1",
]


def small_config(tmp: Path, *overrides: str) -> RunConfig:
    return validate(load_config("default", [*SMALL, f"output_dir={tmp}", *overrides]), [])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A warm-started tiny base model and the pre-sampled pools, shared by the tests of this module."""
    root = tmp_path_factory.mktemp("e2e")
    cfg = small_config(root)
    with ray_cluster(cfg):
        yield root, prepare(cfg, RunPaths(root), StageTimer(), need_presample=True)


def consumed(rl_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (rl_dir / "consumed.jsonl").read_text().splitlines()]


def group_ids(rl_dir: Path) -> list[tuple[int, int]]:
    """Every consumed group id, step by step (sorted within a step: arrival order is not data)."""
    return [gid for step in consumed(rl_dir) for gid in sorted((a, s) for a, s, *_ in step["groups"])]


def train(prepared, name: str, *overrides: str, mode: str = "js_low_var", **kwargs) -> tuple[RLResult, Path]:
    root, prep = prepared
    spec = RunSpec.parse(mode)
    cfg = spec.apply(small_config(root, *overrides))
    rl_dir = root / name
    return run_rl(cfg, name, rl_dir, prep.base, prep.prompts_for(spec), prep.pool_for(spec), **kwargs), rl_dir


def test_async_respects_staleness_and_trains(prepared):
    eta = 1
    result, rl_dir = train(prepared, "async", "learner.steps=5", f"replay.max_staleness={eta}")
    assert len(result.metrics) == 5
    assert all(math.isfinite(m["loss/total"]) for m in result.metrics)
    assert all(m["batch/reference_samples"] > 0 for m in result.metrics)  # the DPH term had samples
    steps = consumed(rl_dir)
    assert [s["version"] for s in steps] == list(range(5))
    for step in steps:
        assert len(step["groups"]) == 4
        for _, _, oldest, _ in step["groups"]:
            assert 0 <= step["version"] - oldest <= eta
    ids = group_ids(rl_dir)
    assert len(ids) == len(set(ids)), "a group was used twice"
    # Both actors loaded new weights, and tokens made with them reached the learner.
    assert all(a["weight_loads"] >= 1 for a in result.actors)
    assert max(newest for s in steps for *_, newest in s["groups"]) >= 1
    assert (rl_dir / "final_model" / "config.json").is_file()


def test_sync_actor_logprobs_follow_the_learner(prepared):
    result, rl_dir = train(prepared, "sync", "learner.steps=4", "mode=sync", "replay.max_staleness=0")
    for step in consumed(rl_dir):
        # Every group of step v was generated entirely by the weights of version v ...
        assert all(oldest == newest == step["version"] for _, _, oldest, newest in step["groups"])
    for m in result.metrics:
        # ... and the actors' behaviour log-probs are the learner's own at that version: the new
        # weights reached the engines (a stale engine would show a KL far above float noise).
        assert m["staleness/max"] == 0
        assert abs(m["policy/mismatch_kl_k1"]) < 1e-3 and m["policy/mismatch_kl_k3"] < 1e-3


def test_resume_matches_uninterrupted_run(prepared):
    common = ["mode=sync", "actors.num_actors=1", "learner.checkpoint_every=2"]
    full, full_dir = train(prepared, "full", "learner.steps=4", *common)
    # Stopped after step 3 (the last checkpoint is at version 2) ...
    _, part_dir = train(prepared, "part", "learner.steps=3", *common)
    tag = (part_dir / "checkpoints" / "latest").read_text().strip()
    assert tag == "v2"
    # ... and resumed from it: step 3 is redone with the same data, then step 4.
    resumed, _ = train(prepared, "part", "learner.steps=4", *common, resume_tag=tag)
    assert resumed.metrics[-1]["learner/version"] == full.metrics[-1]["learner/version"] == 4
    ids = group_ids(part_dir)
    assert ids == group_ids(full_dir)
    assert len(ids) == len(set(ids)) == 4 * 4


def test_killed_actor_is_restarted_and_run_completes(prepared):
    pids: dict[str, int] = {}
    killed: list[int] = []

    def kill_once(metrics: dict[str, float]) -> None:
        if metrics["learner/version"] >= 1 and not killed:
            killed.append(pids["actor0"])
            os.kill(pids["actor0"], signal.SIGKILL)

    # One actor, and admission lets it work on one batch ahead at most (eta = 0): the steps after
    # the kill can only be taken if the killed actor comes back. With a larger eta the actor could
    # have produced every remaining batch before the kill, and the run would end without noticing.
    result, rl_dir = train(prepared, "chaos", "learner.steps=8", "replay.max_staleness=0", "actors.num_actors=1",
                           on_started=pids.update, on_metrics=kill_once)
    assert killed and result.actor_restarts >= 1
    assert result.metrics[-1]["learner/version"] == 8
    ids = group_ids(rl_dir)
    assert len(ids) == len(set(ids)) == 8 * 4


def session_members(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,sess=,args="], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.split()[1] == str(sid)]


def test_ctrl_c_during_rl_stops_everything(tmp_path: Path):
    shm_before = set(os.listdir("/dev/shm"))
    with (tmp_path / "run.log").open("w") as log:  # the child keeps its own copy of the descriptor
        # A session of its own, like a terminal's foreground job; SIGINT handled by default even where
        # the test runner was started with it ignored (background jobs of a non-interactive shell).
        proc = subprocess.Popen(
            [sys.executable, "-m", "dph_async.app.cli", "run", "--output", str(tmp_path / "out"),
             *SMALL, "learner.steps=100000", "learner.checkpoint_every=10"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.time() + 600
        while not list((tmp_path / "out").glob("rl/*/logs/actor*.log")):
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.time() < deadline, "RL did not start"
            time.sleep(1)
        time.sleep(10)  # the actors and the learner are working
        assert proc.poll() is None
        members = session_members(proc.pid)
        assert len(members) > 3, members  # the check below sees the run's processes
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left: list[str] = []
    for _ in range(20):  # processes being reaped take a moment to leave the table
        left = session_members(proc.pid)
        if not left:
            break
        time.sleep(0.5)
    assert not left, left
    assert set(os.listdir("/dev/shm")) - shm_before == set()
    assert "interrupted" in (tmp_path / "run.log").read_text()
