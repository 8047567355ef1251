"""Ctrl-C in the middle of RL: `dph-async run` exits with 130 within seconds, leaving no process of its
session (Ray's services, the learner, the vLLM actors) and no new shared-memory file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SMALL = [
    "warmstart.steps=60", "task.num_train=64", "task.num_test=16", "learner.groups_per_step=4",
    "sampling.n=4", "sampling.max_tokens=10", "eval.k_max=4", "eval.max_prompts=8",
    "actors.max_inflight_prompts=4", "logging.wandb_mode=disabled", "learner.steps=100000",
]


def session_members(sid: int) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,sess=,args="], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.split()[1] == str(sid)]


def test_ctrl_c_during_rl_stops_everything(tmp_path: Path):
    shm_before = set(os.listdir("/dev/shm"))
    log = (tmp_path / "run.log").open("w")
    # A session of its own, like a terminal's foreground job; SIGINT handled by default even where
    # the test runner was started with it ignored (background jobs of a non-interactive shell).
    proc = subprocess.Popen(
        [sys.executable, "-m", "dph_async.cli", "run", "--output", str(tmp_path / "out"),
         *SMALL],
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
