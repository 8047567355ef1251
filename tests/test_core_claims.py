"""Cores claimed across invocations on one host (dph_async/app/core_claims.py): two claimants get
disjoint cores, a third finds too few and sees who holds them, a released or killed claimant's cores
are free again, a pid taken by a new process does not keep a claim, and a claim waits for the lock."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dph_async.app.core_claims import Claim, _locked, claim_cores, live_claims, release_cores, start_time
from dph_async.app.cores import CorePlan, plan_cores

ROOT = Path(__file__).resolve().parents[1]
HOST = [0, 1, 2, 3]  # the cores planned over: the claims never pin anything themselves


def _one_actor(directory: Path, cores: list[int] = HOST):
    """A run of one actor and one learner core, as the launcher plans it."""
    return claim_cores(cores, lambda free: plan_cores(free, 1, 1, 1), _used, directory)


def _used(plan: CorePlan) -> list[int]:
    return [c for cores in plan.actors for c in cores] + plan.learner


def test_two_claimants_get_disjoint_cores_and_a_third_sees_who_holds_them(tmp_path):
    first, second = _one_actor(tmp_path), _one_actor(tmp_path)
    assert first.plan == CorePlan([[0]], [1]) and second.plan == CorePlan([[2]], [3])
    assert first.others == [] and second.others == [first.claim]
    third = _one_actor(tmp_path)
    assert third.plan is None and third.claim is None
    assert third.others == [first.claim, second.claim] or third.others == [second.claim, first.claim]
    assert f"pid {os.getpid()}" in first.claim.describe() and "[0, 1]" in first.claim.describe()
    release_cores(first.claim, tmp_path)
    again = _one_actor(tmp_path)
    assert again.plan == CorePlan([[0]], [1]) and again.others == [second.claim]
    release_cores(again.claim, tmp_path)
    release_cores(again.claim, tmp_path)  # twice: nothing left to give back, no error
    release_cores(second.claim, tmp_path)
    assert live_claims(tmp_path) == []


CHILD = """
import json, sys, time
from dph_async.app.core_claims import claim_cores
from dph_async.app.cores import plan_cores
taken = claim_cores([0, 1, 2, 3], lambda free: plan_cores(free, 1, 1, 1),
                    lambda p: p.actors[0] + p.learner, __import__("pathlib").Path(sys.argv[1]))
print(json.dumps(taken.plan.actors[0] + taken.plan.learner), flush=True)
time.sleep(600)
"""


def test_a_killed_claimants_cores_are_free_for_the_next(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(child.stdout.readline()) == [0, 1]
        mine = _one_actor(tmp_path)
        assert mine.plan == CorePlan([[2]], [3]) and [c.pid for c in mine.others] == [child.pid]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
    # No clean exit: the claim's process has ended, so the next look drops it.
    after = _one_actor(tmp_path)
    assert after.plan == CorePlan([[0]], [1]) and after.others == [mine.claim]
    assert {c.pid for c in live_claims(tmp_path)} == {os.getpid()}


def test_a_claim_whose_pid_another_process_took_is_stale(tmp_path):
    me = os.getpid()
    (tmp_path / "claim-old.json").write_text(json.dumps(
        {"id": "old", "pid": me, "started": start_time(me) - 1, "cores": HOST, "command": "ended long ago"}))
    (tmp_path / "claim-junk.json").write_text("{not json")
    taken = _one_actor(tmp_path)
    assert taken.plan == CorePlan([[0]], [1]) and taken.others == []
    assert sorted(p.name for p in tmp_path.glob("claim-*.json")) == [f"claim-{taken.claim.id}.json"]


def test_a_claim_waits_for_the_lock(tmp_path):
    """While another claimant holds the lock (between reading the claims and writing its own), a
    claim neither reads nor writes: it goes on once the lock is free."""
    with _locked(tmp_path):
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                                 text=True)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(3)  # blocked on the lock (a broken lock lets it claim and sleep: still running)
            assert not list(tmp_path.glob("claim-*.json"))
            # Written now, under the lock: the child must see it once it has the lock.
            held = Claim("held", os.getpid(), start_time(os.getpid()), [0, 1], "this test")
            (tmp_path / "claim-held.json").write_text(json.dumps(held.__dict__))
        except BaseException:
            child.kill()
            raise
    try:
        assert json.loads(child.stdout.readline()) == [2, 3]
    finally:
        child.kill()
        child.wait(60)
