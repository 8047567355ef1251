"""Pinning a run's processes to cores (dph_async/runtime/cpu_cores.py): the plan, every thread pinned, and an
actor's other threads moved off its rollout loop's cores."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from dph_async.runtime.cpu_cores import CorePlan, host_cores, offload_threads, pin, plan_cores, process_tree

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")


def test_each_actor_gets_its_cores_and_the_learner_its_own_the_rest_left_free():
    assert plan_cores({0, 1}, 1, 1) == CorePlan([[0]], [1])
    assert plan_cores([7, 3, 5, 1, 2, 4, 6, 0], 2, 2) == CorePlan([[0, 1], [2, 3]], [4])
    assert plan_cores([7, 3, 5, 1, 2, 4, 6, 0], 2, 2, learner=3) == CorePlan([[0, 1], [2, 3]], [4, 5, 6])
    assert plan_cores({4, 9, 2}, 2, 1) == CorePlan([[2], [4]], [9])


def test_no_plan_where_the_cores_are_too_few_or_no_actor_runs_here():
    assert plan_cores({0, 1}, 2, 1) is None
    assert plan_cores({0, 1, 2, 3}, 2, 2) is None
    assert plan_cores({0, 1, 2}, 1, 1, learner=3) is None
    assert plan_cores({0}, 1, 1) is None
    assert plan_cores({0, 1}, 0, 1) is None


def _affinities() -> dict[int, set[int]]:
    return {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}


def test_every_thread_of_a_process_is_pinned_and_later_ones_inherit():
    before = host_cores()
    core = max(before)
    started, release = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def waiting() -> None:
        started.set()
        release.wait(30)

    earlier = threading.Thread(target=waiting)
    earlier.start()
    started.wait(30)
    try:
        pin(os.getpid(), [core])
        assert all(cores == {core} for cores in _affinities().values()), _affinities()
        later = threading.Thread(target=lambda: seen.update(later=os.sched_getaffinity(0)))
        later.start()
        later.join()
        assert seen["later"] == {core}
        pin(os.getpid(), before)
        assert all(cores == before for cores in _affinities().values()), _affinities()
    finally:
        pin(os.getpid(), before)
        release.set()
        earlier.join()


def test_the_processes_a_pinned_process_started_are_pinned_with_it():
    """A child and a grandchild started before the pin (as the learner's gates are) follow it, and
    come back with it."""
    before = host_cores()
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while len(tree := process_tree(child.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree[0] == child.pid and len(tree) == 2, tree
        pin(child.pid, [max(before)])
        assert all(os.sched_getaffinity(p) == {max(before)} for p in tree)
        pin(child.pid, before)
        assert all(os.sched_getaffinity(p) == before for p in tree)
    finally:
        for p in process_tree(child.pid)[::-1]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        child.wait()


def _names() -> dict[int, str]:
    return {int(t): Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")}


@pytest.mark.skipif(len(host_cores()) < 2, reason="needs two cores to tell the threads apart")
def test_offload_moves_every_other_thread_but_zmqs_and_the_callers():
    before = host_cores()
    home, spare = {min(before)}, {max(before)}
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)  # starts libzmq's I/O threads
    started, release = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: (started.set(), release.wait(30)))
    other.start()
    started.wait(30)
    try:
        pin(os.getpid(), home)
        zmq_threads = {t for t, name in _names().items() if name.startswith("ZMQbg")}
        assert zmq_threads, _names()
        moved = offload_threads(spare)
        now = _affinities()
        me = threading.get_native_id()
        assert now[me] == home and all(now[t] == home for t in zmq_threads), (now, _names())
        others = set(now) - zmq_threads - {me}
        assert other.native_id in others and all(now[t] == spare for t in others), (now, _names())
        assert moved == len(others)
    finally:
        pin(os.getpid(), before)
        release.set()
        other.join()
        sock.close(0)
        ctx.term()
