"""Cores claimed across invocations on one host (dph_async/runtime/cpu_claims.py): two claimants get
disjoint cores, a third finds too few and sees who holds them, a released or killed claimant's cores
are free again, a pid taken by a new process does not keep a claim, and a claim waits for the lock;
and at the edges: a claim file of exactly the size limit and one byte more, a process name holding
parentheses and spaces, the directory from DPH_CORES_DIR or the user's default."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dph_async.runtime.cpu_claims import (
    MAX_CLAIM_BYTES,
    Claim,
    _command,
    _locked,
    claim_cores,
    claims_dir,
    live_claims,
    release_cores,
    start_time,
)
from dph_async.runtime.cpu_cores import CorePlan, plan_cores

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
from dph_async.runtime.cpu_claims import claim_cores
from dph_async.runtime.cpu_cores import plan_cores
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


def test_a_claim_file_records_the_claimant_and_the_cores_it_uses_sorted(tmp_path):
    directory = tmp_path / "new" / "claims"  # made on first use, private to this user
    taken = claim_cores([5, 3, 1, 0], lambda free: free, lambda plan: [plan[2], plan[0]], directory)
    assert taken.plan == [0, 1, 3, 5] and taken.others == []
    files = sorted(p.name for p in directory.iterdir())
    assert files == [".lock", f"claim-{taken.claim.id}.json"]  # the temporary file renamed, none left
    on_disk = json.loads((directory / files[1]).read_text())
    me = os.getpid()
    assert on_disk == {"id": taken.claim.id, "pid": me, "started": start_time(me), "cores": [0, 3],
                       "command": _command(me)}
    # the interpreter as this process was started: a relative path (make test's .venv/bin/python) resolves here
    assert os.path.realpath(_command(me).split()[0]) == os.path.realpath(sys.executable) and start_time(me) > 0
    assert directory.stat().st_mode & 0o777 == 0o700
    nothing = claim_cores([0, 1], lambda free: None, lambda plan: plan, directory)
    assert (nothing.plan, nothing.claim, nothing.others) == (None, None, [taken.claim])
    release_cores(None, directory)  # nothing claimed: nothing to give back
    assert live_claims(directory) == [taken.claim]


def test_the_claims_directory_is_dph_cores_dir_else_the_users_own(tmp_path, monkeypatch):
    monkeypatch.setenv("DPH_CORES_DIR", str(tmp_path / "here"))
    assert claims_dir() == tmp_path / "here"
    taken = _one_actor(None)  # the directory of the environment
    assert [p.name for p in (tmp_path / "here").glob("claim-*.json")] == [f"claim-{taken.claim.id}.json"]
    release_cores(taken.claim)
    assert list((tmp_path / "here").glob("claim-*.json")) == []
    monkeypatch.delenv("DPH_CORES_DIR")
    assert claims_dir() == Path(tempfile.gettempdir()) / f"dph-async-cores-{os.getuid()}"


def test_a_claim_file_of_exactly_the_size_limit_is_read_and_one_byte_more_is_not(tmp_path, caplog):
    me = os.getpid()
    claim = {"id": "big", "pid": me, "started": start_time(me), "cores": [0], "command": "x"}
    text = json.dumps(claim)
    (tmp_path / "claim-big.json").write_text(text + " " * (MAX_CLAIM_BYTES - len(text)))
    assert [c.id for c in live_claims(tmp_path)] == ["big"] and not caplog.records
    (tmp_path / "claim-big.json").write_text(text + " " * (MAX_CLAIM_BYTES + 1 - len(text)))
    with caplog.at_level(logging.WARNING, logger="dph_async.runtime.cpu_claims"):
        assert live_claims(tmp_path) == []
    assert caplog.messages == [f"core claims: {tmp_path / 'claim-big.json'} is not a claim; removed"]
    assert not (tmp_path / "claim-big.json").exists()


@pytest.mark.parametrize("broken", [{"cores": "0,1"}, {"pid": "me"}, {"cores": [None]}, {"started": None}])
def test_a_claim_with_a_field_of_the_wrong_kind_is_no_claim(tmp_path, broken):
    me = os.getpid()
    claim = {"id": "x", "pid": me, "started": start_time(me), "cores": [0], "command": "y"}
    (tmp_path / "claim-x.json").write_text(json.dumps(claim | broken))
    assert live_claims(tmp_path) == [] and not (tmp_path / "claim-x.json").exists()


NAMED = """
import sys, time
open("/proc/self/comm", "w").write(sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


def test_start_time_reads_a_process_whose_name_holds_parentheses_and_spaces():
    """The start time is the 22nd field of /proc/PID/stat, counted after the name's closing
    parenthesis: in seconds since boot it is when the process started."""
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    spawned = time.time()
    child = subprocess.Popen([sys.executable, "-c", NAMED, "a) b (c) d"], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        assert Path(f"/proc/{child.pid}/comm").read_text() == "a) b (c) d\n"
        started = boot + start_time(child.pid) / os.sysconf("SC_CLK_TCK")
        assert spawned - 2 <= started <= time.time() + 1
        assert _command(child.pid).startswith(f"{sys.executable} -c ") and _command(child.pid).endswith(" a) b (c) d")
    finally:
        child.kill()
        child.wait(60)
    assert start_time(child.pid) is None and _command(child.pid) == "?"


SLEEPER = "import time; print('ready', flush=True); time.sleep(600)"


@pytest.mark.parametrize(("arg", "shown"), [(b"x" * 300, None), (b"caf\xe9", "caf\ufffd")])
def test_a_command_is_cut_to_200_characters_and_bytes_that_are_no_utf8_replaced(arg, shown):
    child = subprocess.Popen([sys.executable.encode(), b"-c", SLEEPER.encode(), arg], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n"
        command = _command(child.pid)
        full = f"{sys.executable} -c {SLEEPER} {shown or arg.decode()}"
        assert command == full[:200] and command.startswith(f"{sys.executable} -c ")
    finally:
        child.kill()
        child.wait(60)
