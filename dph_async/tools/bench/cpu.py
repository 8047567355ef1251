"""CPU-seconds of an RL run's processes, by component, sampled from /proc while it runs.

On a machine where actors and learner share cores, wall-clock phases alone cannot say whether the
async run was starved of CPU: its step can be no shorter than the CPU work of a step over the cores.
A thread samples every process below this one (Ray's raylet spawns the workers under the driver)
and files each under the Ray actor it descends from, by process title: Ray names a worker process
`ray::LearnerProcess...` or `ray::ActorProcess...`; children (reward workers) inherit their parent's
component. Everything else below the driver (Ray's own services, the driver) is "ray". The machine's
total busy time comes from /proc/stat, so CPU used by other people's jobs shows as "outside".

A process that exits between two samples loses at most one interval of CPU time.

The same samples keep each process's peak resident set (VmHWM, which the kernel keeps per process):
`peaks` files it under the process's component, so memory per process comes from the same run. The
peaks of processes already running when the sampler starts (kept from an earlier run) are reset
first, so that they are this run's.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dph_async.tools.bench.timeline import marked_between

TICK = os.sysconf("SC_CLK_TCK")
# Every learner rank counts as the learner: t is the CPU of a step, whichever rank spends it.
COMPONENTS = {"ray::LearnerProcess": "learner", "ray::LearnerRank": "learner", "ray::ActorProcess": "actors"}


@dataclass
class CpuSample:
    t: float
    by_component: dict[str, float]  # cumulative CPU-seconds since the sampler started
    machine: float  # cumulative busy CPU-seconds of the whole machine since the sampler started


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU-seconds) of a live process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK


def _title(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
    except OSError:
        return ""


def _peak_rss(pid: int) -> int | None:
    """The peak resident set of a live process in bytes (VmHWM); None once it has ended."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None  # a kernel thread: no memory of its own


def _reset_peak_rss(pid: int) -> None:
    """Start process `pid`'s VmHWM again from its current resident set (a kernel feature since 4.0;
    nothing where it is refused)."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/clear_refs").write_text("5")


def _machine_busy() -> float:
    """Busy CPU-seconds of the machine since boot: all of /proc/stat's cpu line but idle and iowait."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (sum(values) - values[3] - values[4]) / TICK


@dataclass
class ProcessTreeCPU:
    """Samples CPU use below `root` (default: this process) every `interval` seconds, in a thread."""

    root: int = field(default_factory=os.getpid)
    interval: float = 0.25
    samples: list[CpuSample] = field(default_factory=list)
    # pid -> (component, peak resident bytes) of every process seen below root
    peaks: dict[int, tuple[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._component: dict[int, str] = {}
        self._last: dict[int, tuple[str, float]] = {}  # pid -> (component, CPU-seconds) last seen
        self._base: dict[int, float] = {}  # pid -> CPU-seconds when first seen (0 if born after start)
        self._machine0 = _machine_busy()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def _classify(self, pid: int, parents: dict[int, int]) -> str | None:
        """The component of pid if it lies below root, else None. Only Ray actors and their children
        are remembered: a Ray worker starts as `ray::IDLE` and takes its actor's title later."""
        chain = []
        p = pid
        while p in parents and p not in self._component and p != self.root:
            chain.append(p)
            p = parents[p]
        if p != self.root and p not in self._component:
            return None
        found = self._component.get(p, "ray")
        for q in reversed(chain):  # from the top: the nearest Ray actor above decides
            title = _title(q)
            found = next((c for prefix, c in COMPONENTS.items() if title.startswith(prefix)), found)
            if found != "ray":
                self._component[q] = found
        return found

    def sample(self) -> CpuSample:
        stats = {}
        for entry in os.scandir("/proc"):
            if entry.name.isdigit() and (st := _stat(int(entry.name))) is not None:
                stats[int(entry.name)] = st
        parents = {pid: ppid for pid, (ppid, _) in stats.items()}
        first = not self.samples
        for pid, (_, cpu) in stats.items():
            if (component := self._classify(pid, parents)) is not None:
                if pid not in self._last:
                    self._base[pid] = cpu if first else 0.0
                    if first:
                        _reset_peak_rss(pid)
                self._last[pid] = (component, cpu)
                if (peak := _peak_rss(pid)) is not None:
                    self.peaks[pid] = (component, max(peak, self.peaks.get(pid, (component, 0))[1]))
        totals: dict[str, float] = {}
        for pid, (component, cpu) in self._last.items():
            totals[component] = totals.get(component, 0.0) + cpu - self._base[pid]
        s = CpuSample(time.time(), totals, _machine_busy() - self._machine0)
        self.samples.append(s)
        return s

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> ProcessTreeCPU:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


@dataclass
class Memory:
    """The peak resident sets of one component's processes, MiB (each process's own peak; their sum
    bounds what they held at once from above)."""

    largest_mb: float
    sum_mb: float
    processes: int


def memory_of(peaks: dict[int, tuple[str, int]]) -> dict[str, Memory]:
    """Per component, from ProcessTreeCPU.peaks."""
    out = {}
    for component in sorted({c for c, _ in peaks.values()}):
        sizes = [b for c, b in peaks.values() if c == component]
        out[component] = Memory(max(sizes) / 2**20, sum(sizes) / 2**20, len(sizes))
    return out


def cpu_between(samples: list[CpuSample], start: float, end: float) -> dict[str, float]:
    """CPU-seconds of each component (and "machine", "outside") in [start, end], interpolated."""
    components = sorted({k for s in samples for k in s.by_component})
    keys = [*components, "machine"]
    marks = [(s.t, *(s.by_component.get(k, 0.0) for k in components), s.machine) for s in samples]
    out = {k: max(0.0, v) for k, v in zip(keys, marked_between(marks, start, end), strict=True)}
    ours = sum(v for k, v in out.items() if k != "machine")
    out["outside"] = max(0.0, out.get("machine", 0.0) - ours)
    return out
