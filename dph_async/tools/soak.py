"""A soak: the default workload trained continuously for N minutes, its resources sampled throughout.

    result = run_soak(cfg, minutes=60, interval_s=60, warmup_s=600, out=Path("runs/soak"))

The RL run is the ordinary one (Ray, learner with the replay, actors), with `learner.steps` out of
reach: actors cycle through their prompts (a new shuffle per epoch) until the soak stops the learner.
Every `interval_s` the sampler reads each process's /metrics (RSS, open fds, threads, CPU time; learner
and actor token counters) and the run directory (write-ahead log bytes, checkpoints), and lists the /dev/shm
files the processes have mapped or open. After `warmup_s` (start-up, caches, the allocator settling)
the checks are:

    RSS          every process within ±5 % of its first sample after warm-up
    fds, shm     never more than the first sample after warm-up plus a little (+8 fds, +2 files)
    WAL          never more than replay.wal_compact_mb + 2 * replay.wal_segment_mb
    checkpoints  never more than learner.keep_checkpoints + learner.keep_versions + 1
    intervals    every process sampled at both ends of every interval, none restarted
    progress     learner steps/s of every interval at least half the median: a stall that keeps the
                 processes busy (polling) lowers it beyond any swing of the machine's speed
    pace         the processes' CPU-seconds per second of every interval (how busy the system keeps
                 the machine) within ±10 % of the median interval: a stall lowers it
    work         each process's CPU-seconds per learner step over the other processes', over every span
                 of 5 consecutive intervals (a third of them in a short soak), within ±10 % of the
                 same ratio over the first third of the intervals (judged for processes with 5 % of
                 the CPU-seconds or more): a process that comes to do more per step, for good or
                 in two minutes of every five, raises it; a minute's swing of the machine hardly
                 moves a five-minute span
    gate restarts  none during the whole soak (only a peer exhausting a gate's memory ends one)

The services' gate processes (dph_async/gate.py) are sampled from /proc as processes of their own
("replay gate", "weights gate"), and judged as the others.

Learner steps/s are judged against a floor only (progress), not within ±10 %: steps/s = pace /
CPU-seconds per step, and a slower machine raises every process's CPU-seconds per step at once (a
60-minute soak on a 2-core guest saw steps/s 12% under and 14% over its median while the actor
stayed 98% busy to within 0.6%, docs/benchmarks.md). A system that slows itself either waits
(pace), does more per step in some process (work) or stops stepping (progress); what cannot be told
from a slower machine is every process doing more per step in the same proportion by less than half.
The pace band is around the median of the judged intervals, so a lasting change of pace over the
second half shows at about half its size; work is judged against the first third, so a change of
work shows at its full size.

Results: <out>/soak/soak.json (every sample, the checks, the machine's load), soak.md, soak.png.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dph_async.config import RunConfig
from dph_async.paths import RunPaths, checkpoint_dir, endpoints_dir
from dph_async.pipeline.plot_colours import colour_map, pyplot
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import StageTimer, prepare, validate
from dph_async.runtime.cluster import ray_cluster
from dph_async.runtime.endpoints import find_endpoints, scrape
from dph_async.runtime.launcher import run_rl

RSS_TOLERANCE = 0.05
PACE_TOLERANCE = 0.10
PROGRESS_FLOOR = 0.5  # no interval under half the median's learner steps/s: a stall that keeps the CPUs busy
WORK_TOLERANCE = 0.10
# Work is judged over spans of this many consecutive intervals (a process's CPU-seconds over the
# others' in the span) against the same ratio over the first third of the judged intervals: a change
# that lasts or recurs for minutes shows at its full size, while one interval's swing of the machine
# (a quiet soak on 2026-11-29: +11% for a minute, +3 to +11% for five, back after; docs/benchmarks.md,
# Soak) is diluted fivefold. A span is at most a third of the judged intervals.
WORK_WINDOW = 5
WORK_JUDGED_FROM = 0.05  # share of the CPU-seconds: below it a process's per-interval CPU is a few clock ticks
FD_SLACK = 8
SHM_SLACK = 2


@dataclass
class ProcessSample:
    rss_bytes: float
    open_fds: float
    threads: float
    cpu_seconds: float = 0.0  # cumulative, user + system


@dataclass
class Sample:
    t: float  # seconds since the soak began
    processes: dict[str, ProcessSample]
    shm_files: int
    wal_bytes: int
    checkpoints: int
    checkpoint_bytes: int
    learner_version: float
    learner_tokens: float  # fresh tokens trained on, cumulative
    actor_tokens: float  # tokens generated by all actors, cumulative
    load: tuple[float, float, float] = (0.0, 0.0, 0.0)
    gate_restarts: float = 0.0  # of both services' gates, cumulative


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class SoakResult:
    samples: list[Sample]
    checks: list[Check]
    meta: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)


# --- sampling ------------------------------------------------------------------------------------

def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def shm_files(pids: list[int]) -> set[str]:
    """/dev/shm files mapped or held open by these processes (others' files on a shared host do not count)."""
    found: set[str] = set()
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith("/dev/shm/"):
                    found.add(path.removesuffix(" (deleted)"))
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    found.add(target.removesuffix(" (deleted)"))
        except OSError:
            continue  # the process ended or restarted
    return found


def gate_processes(pid: int) -> dict[str, ProcessSample]:
    """The gate processes a service process started (dph_async/gate.py), named by the service whose
    endpoints they bind ("replay gate": two, "weights gate": one), read from /proc: they have no
    /metrics of their own."""
    found, children = {}, set()
    tick = os.sysconf("SC_CLK_TCK")
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return found
    for task in tasks:
        with contextlib.suppress(OSError):  # a thread that ended meanwhile (the gates are not its children)
            children.update(int(c) for c in (task / "children").read_text().split())
    for child in sorted(children):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            if b"dph_async.gate" not in argv:
                continue
            routes = len(json.loads(argv[argv.index(b"dph_async.gate") + 1])["routes"])
            status = dict(line.split(":", 1) for line in Path(f"/proc/{child}/status").read_text().splitlines())
            stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            found["replay gate" if routes == 2 else "weights gate"] = ProcessSample(
                float(status["VmRSS"].split()[0]) * 1024, float(len(os.listdir(f"/proc/{child}/fd"))),
                float(status["Threads"]), (int(stat[11]) + int(stat[12])) / tick)
        except (OSError, ValueError, KeyError, IndexError):
            continue  # ended meanwhile, or not ours to read
    return found


def take_sample(t: float, rl_dir: Path, cfg: RunConfig) -> Sample:
    """One sample of every announced process and of the run directory."""
    readings = [scrape(ep) for ep in find_endpoints([str(rl_dir)])] if endpoints_dir(rl_dir).is_dir() else []
    processes, pids = {}, set()
    learner_version = learner_tokens = actor_tokens = gate_restarts = 0.0
    for r in readings:
        pid = r.health.get("pid")
        if not r.up or not isinstance(pid, int) or pid <= 0:  # a pid is read from /proc: a number only
            continue
        pids.add(pid)
        if r.endpoint.name != "replay":  # the replay shares the learner's process
            processes[r.endpoint.name] = ProcessSample(
                r.value("process_resident_memory_bytes", 0.0), r.value("process_open_fds", 0.0),
                r.value("process_threads", 0.0), r.value("process_cpu_seconds_total", 0.0))
            processes.update(gate_processes(pid))
        gate_restarts += sum(r.value(f"dph_{s}_gate_restarts_total", 0.0) for s in ("replay", "weights"))
        learner_version = max(learner_version, r.value("dph_learner_version", 0.0))
        learner_tokens += r.value("dph_learner_fresh_tokens_total", 0.0)
        actor_tokens += r.value("dph_actor_tokens_generated_total", 0.0)
    ckpt = checkpoint_dir(rl_dir)
    count = len([d for d in ckpt.glob("v*") if d.is_dir()]) if ckpt.is_dir() else 0
    wal = rl_dir / cfg.replay.wal_dir if cfg.replay.wal_dir else rl_dir / "__none__"
    return Sample(t, processes, len(shm_files(sorted(pids))), dir_bytes(wal), count, dir_bytes(ckpt),
                  learner_version, learner_tokens, actor_tokens, os.getloadavg(), gate_restarts)


# --- the verdict ---------------------------------------------------------------------------------

def throughputs(samples: list[Sample], what: str = "learner_version") -> list[tuple[float, float]]:
    """(t, rate per second) of a cumulative sample field over each interval between samples: learner
    steps (each a fixed number of groups; the default) or learner_tokens (which also move with the
    policy's response lengths)."""
    return [(b.t, (getattr(b, what) - getattr(a, what)) / (b.t - a.t))
            for a, b in itertools.pairwise(samples) if b.t > a.t]


def cpu_per_step(samples: list[Sample], name: str) -> list[tuple[float, float]]:
    """(t, CPU-seconds of process `name` per learner step) over each interval between samples. Every
    step is the same work, so this moves only if the work costs more (the system) or the same work
    takes more CPU time (the machine: a shared host, its clock); read with every process at once."""
    return [(b.t, (b.processes[name].cpu_seconds - a.processes[name].cpu_seconds)
             / (b.learner_version - a.learner_version))
            for a, b in itertools.pairwise(samples)
            if name in a.processes and name in b.processes and b.learner_version > a.learner_version
            and 0 < a.processes[name].cpu_seconds <= b.processes[name].cpu_seconds]  # 0: not sampled; less: restarted


@dataclass
class Interval:
    t: float  # its end, seconds since the soak began
    seconds: float
    steps: float  # learner steps
    cpu: dict[str, float]  # CPU-seconds of each process


def intervals(samples: list[Sample]) -> tuple[list[Interval], list[str]]:
    """The intervals between samples in which every process seen in any sample was sampled at both
    ends without restarting (its CPU counter did not go back), with or without learner steps; and a
    line for each interval left out, naming the process and why."""
    names = sorted({n for s in samples for n in s.processes})
    out, left_out = [], []
    for a, b in itertools.pairwise(samples):
        missing = [n for n in names if n not in a.processes or n not in b.processes]
        restarted = [n for n in names if n not in missing
                     and not 0 < a.processes[n].cpu_seconds <= b.processes[n].cpu_seconds]
        if missing or restarted or b.t <= a.t or b.learner_version < a.learner_version:
            why = "; ".join([*(f"{n} not sampled" for n in missing), *(f"{n} restarted" for n in restarted)])
            left_out.append(f"{a.t:.0f}-{b.t:.0f} s: {why or 'time or version went back'}")
            continue
        out.append(Interval(b.t, b.t - a.t, b.learner_version - a.learner_version,
                            {n: b.processes[n].cpu_seconds - a.processes[n].cpu_seconds for n in names}))
    return out, left_out


def _worst(deviations: list[float]) -> float:
    """The deviation farthest from 0, with its sign (a slower interval reads -20%, not +20%)."""
    return max(deviations, key=abs)


def _ratio(pairs: list[tuple[float, float]]) -> float:
    """A process's CPU-seconds over the others' in these intervals ((own, others) each)."""
    return sum(c for c, _ in pairs) / sum(o for _, o in pairs)


def _windows(values: list, n: int) -> list[list]:
    """Every run of n consecutive values (all of them when there are fewer)."""
    return [values[i:i + n] for i in range(max(1, len(values) - n + 1))]


def _off_median(values: list[float]) -> tuple[float, float]:
    """(median, the worst relative deviation from it); inf when the median is not positive."""
    median = statistics.median(values)
    return median, _worst([v / median - 1 for v in values]) if median > 0 else float("inf")


def _spread(values: list[float]) -> str:
    worst = _off_median(values)[1]
    return f"{min(values):.3f}-{max(values):.3f} (worst {worst:+.1%} of the median)"


def evaluate(samples: list[Sample], warmup_s: float, cfg: RunConfig) -> list[Check]:
    """The pass/fail checks on the samples taken after `warmup_s` (see the module docstring)."""
    after = [s for s in samples if s.t >= warmup_s]
    if len(after) < 2:
        return [Check("samples", False, f"{len(after)} samples after the {warmup_s:.0f} s warm-up; need 2 or more")]
    first = after[0]
    checks = [Check("processes", bool(first.processes),
                    f"sampled: {', '.join(sorted(first.processes)) or 'none answered on /metrics'}")]
    for name, p0 in first.processes.items():
        series = [s.processes[name] for s in after if name in s.processes]
        rss = [p.rss_bytes for p in series]
        worst = _worst([x / p0.rss_bytes - 1 for x in rss])
        checks.append(Check(f"rss {name}", abs(worst) <= RSS_TOLERANCE,
                            f"{p0.rss_bytes / 2**20:.0f} MB after warm-up, {min(rss) / 2**20:.0f}-"
                            f"{max(rss) / 2**20:.0f} MB, worst {worst:+.1%} (limit ±{RSS_TOLERANCE:.0%})"))
        fds = max(p.open_fds for p in series)
        checks.append(Check(f"fds {name}", fds <= p0.open_fds + FD_SLACK,
                            f"{p0.open_fds:.0f} after warm-up, at most {fds:.0f} (limit +{FD_SLACK})"))
    shm = max(s.shm_files for s in after)
    checks.append(Check("shm files", shm <= first.shm_files + SHM_SLACK,
                        f"{first.shm_files} after warm-up, at most {shm} (limit +{SHM_SLACK})"))
    wal_limit = int((cfg.replay.wal_compact_mb + 2 * cfg.replay.wal_segment_mb) * 2**20)
    wal = max(s.wal_bytes for s in samples)
    checks.append(Check("wal bytes", wal <= wal_limit,
                        f"at most {wal / 2**20:.1f} MB (limit {wal_limit / 2**20:.0f} MB)"))
    lc = cfg.learner
    ckpt_limit = lc.keep_checkpoints + len(lc.keep_versions) + 1 if lc.keep_checkpoints else None
    ckpts = max(s.checkpoints for s in samples)
    checks.append(Check("checkpoints", ckpt_limit is None or ckpts <= ckpt_limit,
                        f"at most {ckpts} on disk, {max(s.checkpoint_bytes for s in samples) / 2**20:.1f} MB "
                        f"(limit {ckpt_limit if ckpt_limit is not None else 'none: keep_checkpoints=0'})"))
    # The most any sample saw: a last sample whose scrape failed reads 0 and must not hide a restart.
    restarts = max(s.gate_restarts for s in samples) - samples[0].gate_restarts
    checks.append(Check("gate restarts", restarts == 0,
                        f"{restarts:.0f} gate processes started again during the soak (honest peers never end one)"))
    judged, left_out = intervals(after)
    checks.append(Check("intervals", not left_out and bool(judged),
                        f"{len(judged)} judged after the warm-up" + (f"; left out: {', '.join(left_out)}"
                                                                      if left_out else "")))
    if not judged:
        return checks
    rates = [i.steps / i.seconds for i in judged]
    median = statistics.median(rates)
    slowest = min(rates) / median - 1 if median > 0 else -1.0
    checks.append(Check("progress", slowest >= -PROGRESS_FLOOR,
                        f"learner steps/s {_spread(rates)}; the slowest interval at least {1 - PROGRESS_FLOOR:.0%} "
                        f"of the median (a wider fall than this machine's own swings, ±14% in an hour)"))
    median, worst = _off_median([sum(i.cpu.values()) / i.seconds for i in judged])
    names = list(judged[0].cpu)  # every interval has every process (intervals())
    stepped = [i for i in judged if i.steps]
    cpu = "; ".join(f"{n} {_spread([i.cpu[n] / i.steps for i in stepped])}" for n in names) if stepped else ""
    checks.append(Check("pace", abs(worst) <= PACE_TOLERANCE,
                        f"the processes busy {median:.2f} CPUs (median of {len(judged)} intervals), worst "
                        f"{worst:+.1%} (limit ±{PACE_TOLERANCE:.0%}); CPU-s per step, not judged (the machine's "
                        f"speed moves them): {cpu or 'no steps'}"))
    total = sum(sum(i.cpu.values()) for i in judged)
    for name in names if len(names) > 1 else []:  # one process has no others to be judged against
        share = sum(i.cpu[name] for i in judged) / total if total > 0 else 0.0
        own = [(i.cpu[name], others) for i in judged if (others := sum(i.cpu.values()) - i.cpu[name]) > 0]
        if share < WORK_JUDGED_FROM or not own:
            continue
        n = max(1, min(WORK_WINDOW, len(own) // 3))
        reference = _ratio(own[:max(1, len(own) // 3)])
        if reference <= 0:  # idle in the first third, busy since: a change of work, whatever its size
            worst = single = float("inf")
        else:
            worst = _worst([_ratio(w) / reference - 1 for w in _windows(own, n)])
            single = _worst([c / o / reference - 1 for c, o in own])
        checks.append(Check(f"work {name}", abs(worst) <= WORK_TOLERANCE,
                            f"{share:.0%} of the CPU-seconds; per step {reference:.2f}× the other processes' in "
                            f"the first third, worst {worst:+.1%} over {n} interval{'s' * (n > 1)} (limit "
                            f"±{WORK_TOLERANCE:.0%}; one interval: {single:+.1%})"))
    return checks


# --- report --------------------------------------------------------------------------------------

def markdown(result: SoakResult) -> str:
    m = result.meta
    lines = [f"# Soak: {m.get('minutes', '?')} minutes, {'PASS' if result.passed else 'FAIL'}", "",
             f"Config: `{m.get('config', '')}`; warm-up {m.get('warmup_s', 0):.0f} s; sampled every "
             f"{m.get('interval_s', 0):.0f} s; load average at the end {m.get('load_end', '')}.", "",
             "| check | verdict | detail |", "|---|---|---|"]
    lines += [f"| {c.name} | {'ok' if c.ok else 'FAIL'} | {c.detail} |" for c in result.checks]
    names = sorted({n for s in result.samples for n in s.processes})
    lines += ["", "| t (s) | " + " | ".join(f"{n} RSS MB / fds / threads / CPU-s per step" for n in names)
              + " | shm | WAL MB | ckpts | version | steps/s | learner tok/s | load 1 min |",
              "|---" * (len(names) + 8) + "|"]
    steps = dict(throughputs(result.samples))
    tokens = dict(throughputs(result.samples, "learner_tokens"))
    cpu = {n: dict(cpu_per_step(result.samples, n)) for n in names}
    for s in result.samples:
        cells = [f"{p.rss_bytes / 2**20:.0f} / {p.open_fds:.0f} / {p.threads:.0f} / "
                 + (f"{cpu[n][s.t]:.3f}" if s.t in cpu[n] else "-") if (p := s.processes.get(n)) else ""
                 for n in names]
        rates = f"{steps[s.t]:.2f} | {tokens[s.t]:.0f}" if s.t in steps else " | "
        lines.append(f"| {s.t:.0f} | " + " | ".join(cells) + f" | {s.shm_files} | {s.wal_bytes / 2**20:.1f} | "
                     f"{s.checkpoints} | {s.learner_version:.0f} | {rates} | {s.load[0]:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: SoakResult, path: Path) -> None:
    plt = pyplot()
    samples = result.samples
    t = [s.t / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    names = sorted({n for s in samples for n in s.processes})
    disk = {"WAL MB": "wal_bytes", "checkpoints MB": "checkpoint_bytes", "/dev/shm files": "shm_files"}
    colours = colour_map([*names, *disk])  # one colour per series in every panel; the steps/s line is black
    for name in names:
        pts = [(s.t / 60, s.processes[name]) for s in samples if name in s.processes]
        axes[0, 0].plot([x for x, _ in pts], [p.rss_bytes / 2**20 for _, p in pts], label=name, color=colours[name])
        axes[0, 1].plot([x for x, _ in pts], [p.open_fds for _, p in pts], label=name, color=colours[name])
    axes[0, 0].set(title="RSS (MB)", xlabel="minutes")
    axes[0, 1].set(title="open file descriptors", xlabel="minutes")
    if any(s.processes for s in samples):
        axes[0, 0].legend(fontsize=7)
    rates = throughputs(samples)
    axes[1, 0].plot([x / 60 for x, _ in rates], [r for _, r in rates], marker="o", color="black")
    axes[1, 0].set(title="learner steps/s (per interval); CPU-s per step (dashed)", xlabel="minutes")
    cpu_axis = axes[1, 0].twinx()
    for name in names:
        pts = cpu_per_step(samples, name)
        cpu_axis.plot([x / 60 for x, _ in pts], [c for _, c in pts], linestyle="--", color=colours[name], label=name)
    cpu_axis.legend(fontsize=7)
    for label, attr in disk.items():
        scale = 2**20 if label.endswith("MB") else 1
        axes[1, 1].plot(t, [getattr(s, attr) / scale for s in samples], label=label, color=colours[label])
    axes[1, 1].set(title="disk and shared memory", xlabel="minutes")
    axes[1, 1].legend(fontsize=7)
    warm = result.meta.get("warmup_s", 0) / 60
    for ax in axes.flat:
        ax.axvline(warm, color="grey", linestyle=":", linewidth=1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: SoakResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    data = {"passed": result.passed, "meta": result.meta, "checks": [asdict(c) for c in result.checks],
            "samples": [asdict(s) for s in result.samples]}
    (out / "soak.json").write_text(json.dumps(data, indent=1))
    (out / "soak.md").write_text(markdown(result))
    plot(result, out / "soak.png")


# --- the run -------------------------------------------------------------------------------------

class Sampler:
    """Samples every `interval_s` from the first learner step on, and sets `stop` after `minutes`."""

    def __init__(self, rl_dir: Path, cfg: RunConfig, minutes: float, interval_s: float,
                 on_sample=None) -> None:
        self.rl_dir, self.cfg, self.minutes, self.interval_s = rl_dir, cfg, minutes, interval_s
        self.samples: list[Sample] = []
        self.stop = threading.Event()  # tells the RL run to end
        self.started = threading.Event()  # set at the first learner step
        self._halt = threading.Event()  # the RL run ended first
        self._on_sample = on_sample
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def first_step(self, metrics: dict[str, float]) -> None:
        """on_metrics hook of the RL run: the soak's clock starts at the first learner step."""
        self.started.set()

    def _run(self) -> None:
        self.started.wait()
        t0 = time.monotonic()
        end = t0 + self.minutes * 60
        while not self._halt.is_set():
            now = time.monotonic()
            sample = take_sample(now - t0, self.rl_dir, self.cfg)
            self.samples.append(sample)
            if self._on_sample is not None:
                self._on_sample(sample)
            if now >= end - 0.5:
                break
            self._halt.wait(max(0.0, min(self.interval_s, end - time.monotonic())))
        self.stop.set()

    def join(self) -> None:
        self._halt.set()
        self.started.set()
        self._thread.join(timeout=60)


def run_soak(cfg: RunConfig, minutes: float, interval_s: float, warmup_s: float, on_sample=None) -> SoakResult:
    """Prepare (cached in cfg.output_dir), then RL until `minutes` after its first step; sample; judge."""
    spec = RunSpec.of(cfg)
    cfg = validate(cfg, [spec])
    paths = RunPaths(Path(cfg.output_dir))
    paths.root.mkdir(parents=True, exist_ok=True)
    rl_dir = paths.root / "soak" / "rl"
    if rl_dir.exists():
        shutil.rmtree(rl_dir)  # every soak starts its RL afresh (the prepared base model is reused)
    mcfg = spec.apply(cfg)
    sampler = Sampler(rl_dir, mcfg, minutes, interval_s, on_sample)
    started = time.time()
    with ray_cluster(cfg):
        prepared = prepare(cfg, paths, StageTimer(), spec.needs_presampling)
        sampler.start()
        try:
            rl = run_rl(mcfg, f"soak {minutes:g} min", rl_dir, prepared.base, prepared.prompts_for(spec),
                        prepared.pool_for(spec), on_metrics=sampler.first_step, stop=sampler.stop,
                        keep_metrics=False)
        finally:
            sampler.join()
    meta = {"minutes": minutes, "interval_s": interval_s, "warmup_s": warmup_s, "run": spec.name,
            "config": cfg.output_dir, "wall_seconds": time.time() - started, "steps": rl.learner.steps,
            "actor_restarts": rl.actor_restarts, "cpus": os.cpu_count(),
            "load_end": " ".join(f"{x:.2f}" for x in os.getloadavg())}
    return SoakResult(sampler.samples, evaluate(sampler.samples, warmup_s, mcfg), meta)
