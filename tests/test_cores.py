"""Pinning a run's processes to cores (dph_async/app/cores.py): the plan, and every thread pinned."""

from __future__ import annotations

import os
import threading

import pytest

from dph_async.app.cores import CorePlan, host_cores, pin, plan_cores

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")


def test_each_actor_gets_its_cores_and_the_learner_the_rest():
    assert plan_cores({0, 1}, 1, 1) == CorePlan([[0]], [1])
    assert plan_cores([7, 3, 5, 1, 2, 4, 6, 0], 2, 2) == CorePlan([[0, 1], [2, 3]], [4, 5, 6, 7])
    assert plan_cores({4, 9, 2}, 2, 1) == CorePlan([[2], [4]], [9])


def test_no_plan_where_the_learner_would_be_left_no_core_or_no_actor_runs_here():
    assert plan_cores({0, 1}, 2, 1) is None
    assert plan_cores({0, 1, 2, 3}, 2, 2) is None
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

