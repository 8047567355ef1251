"""Cores on the driver's host: each actor there gets cores of its own, the learner's processes the rest.

An actor's rollout loop is one thread, and on a small host it sets the pace (docs/benchmarks.md,
"Against a single-process trainer"). Left to the OS, it shares a core now and then with what the
learner's process runs beside its training (the replay's thread, the weight server, the sockets'
I/O threads), and moves between cores, losing what it had in their caches. Pinned
(`launcher.pin_cores`), the actor keeps a core and the learner's threads take turns on theirs, where
the learner waits for batches anyway. Within a pinned actor, the rollout loop then moves every thread
of its process it does not need onto the learner's cores (`offload_threads`): Ray's, the metrics
endpoint's and vLLM's idle gloo loops, which wake often and took the loop's core from it.

Only the driver's host is planned, and the driver pins the processes there itself: the learner runs
there, and an actor elsewhere has no learner to keep apart from. A run claims the cores it pins for
its duration (dph_async/runtime/cpu_claims.py): another invocation on the host plans over the cores left,
and where they are too few it says so and leaves its processes to the OS.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CorePlan:
    actors: list[list[int]]  # cores of the host's i-th actor
    learner: list[int]  # the learner's ranks, the replay and the weight server


def host_cores() -> set[int]:
    """The cores this process may run on (all of the host's, unless something narrowed them)."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def plan_cores(cores: Collection[int], actors: int, threads: int, learner: int = 1) -> CorePlan | None:
    """`threads` cores apiece for `actors` actors and `learner` cores for the learner, the lowest of
    `cores` first; None where no actor runs on the host or `cores` are too few (then the OS places
    every thread). Cores beyond those stay free for another invocation on the host (cpu_claims.py)."""
    ordered = sorted(cores)
    need = actors * threads
    if actors < 1 or learner < 1 or len(ordered) < need + learner:
        return None
    return CorePlan([ordered[i * threads:(i + 1) * threads] for i in range(actors)], ordered[need:need + learner])


def process_tree(pid: int) -> list[int]:
    """`pid` and every process it started, and they started, that still runs (from /proc; only `pid`
    where the kernel does not list a thread's children)."""
    tree, todo = [], [pid]
    while todo:
        tree.append(p := todo.pop())
        with contextlib.suppress(FileNotFoundError):  # the process has ended
            for tid in os.listdir(f"/proc/{p}/task"):
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in Path(f"/proc/{p}/task/{tid}/children").read_text().split())
    return tree


def pin(pid: int, cores: Collection[int]) -> None:
    """Every thread of process `pid` and of the processes it started, on this host, onto `cores` (a
    thread or process started later inherits its starter's). The learner's gates (dph_async/gate.py)
    start with its services, before the driver pins it, and forward the actors' traffic for the whole
    run: left out, they ran on the actor's core about half the time. From outside the process: a Ray
    actor busy in a long call (a learner rank following rank 0) answers no call of its own until that
    ends. Does nothing where the OS offers no affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:  # the process has ended
            continue
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(tid), set(cores))


# libzmq's I/O threads ("ZMQbg/IO/0", "ZMQbg/Reaper") carry the rollout loop's sends: they stay with it.
KEEP_WITH_CALLER = ("ZMQbg",)


def offload_threads(cores: Collection[int]) -> int:
    """Every thread of this process but the calling one and ZMQ's I/O threads onto `cores`; returns how
    many moved. An actor's rollout loop calls it at its start: the driver pins the actor's process
    whole, and cannot tell which of Ray's executor threads will run the loop. Within one run this
    gave the loop 2.3–2.4% more steps per second (docs/benchmarks.md). Threads the caller starts
    later stay with it; one that ends meanwhile is skipped."""
    if not hasattr(os, "sched_setaffinity"):
        return 0
    me, moved = threading.get_native_id(), 0
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            if tid == me or name.startswith(KEEP_WITH_CALLER):
                continue
            os.sched_setaffinity(tid, set(cores))
            moved += 1
        except (FileNotFoundError, ProcessLookupError):
            continue
    return moved
