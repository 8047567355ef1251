"""`dph-async bench`: the same RL work (steps x groups per step, same base model) in sync and in async
mode, in one invocation, measured from the runs' own records.

Per run, over its steady-state window (`timeline.steady_window`: start-up and the first `skip` steps
left out): seconds per learner step, samples and tokens per second, the learner's generation and
training phases (g, t), busy/wait shares of every process, per-component tokens/s, weight-sync time
and bytes, rollout and weight transport rates, and CPU-seconds per component (`cpu.ProcessTreeCPU`).

The comparison: speedup = sync step time / async step time, against the ideal (g + t) / max(g, t)
with g and t measured in the sync run, where the two phases do not overlap and so do not compete.
When actors and learner share the cores, an async step also cannot be shorter than the CPU work of a
step over the cores; `ideal_cpu_bound` adds that floor (docs/benchmarks.md discusses both).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dph_async.config import RunConfig, dump_config
from dph_async.paths import RunPaths
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import StageTimer, prepare, train_mode, validate
from dph_async.run_stats import read_result
from dph_async.runtime.cluster import ray_cluster
from dph_async.tools import scaling
from dph_async.tools.bench.cpu import CpuSample, ProcessTreeCPU, cpu_between, memory_of
from dph_async.tools.bench.figures import RunFigures, WeightSync
from dph_async.tools.bench.timeline import (
    Timeline,
    Window,
    all_waiting,
    busy_seconds,
    fractions,
    ideal_speedup,
    learner_phases,
    marked_between,
    steady_window,
    weight_delays,
)

# Applied before the user's overrides: a throughput benchmark of the RL loop, not a training run.
# Checkpoints would add the same pause to both modes; their cost is its own span in the timeline.
BENCH_DEFAULTS = ("learner.steps=100", "learner.checkpoint_every=0", "logging.wandb_mode=disabled")
MEMORY_FILE = "memory.json"  # a run's peak resident sets by component (cpu.Memory), beside cpu.json


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def measure(name: str, cfg: RunConfig, rl_dir: Path, skip: int, cpu: list[CpuSample] | None) -> RunFigures:
    """Figures of a finished run of `cfg` in rl_dir (result.json, timeline.json, metrics.jsonl)."""
    result = read_result(rl_dir)
    tl = Timeline.load(rl_dir / "timeline.json")
    win: Window = steady_window(tl.learner, skip)
    rows = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    in_win = [r for r in rows if r["learner/version"] > skip]
    phases = learner_phases(tl.learner, win)
    actors, lrn = result.actors, result.learner
    publishes = sum(1 for s in tl.learner if s.what == "publish")
    loads = sum(a.weight_loads for a in actors)
    load_s = sum(a.weight_load_seconds for a in actors)
    load_bytes = sum(a.weight_bytes for a in actors)
    occ = result.replay.occupancy
    group_bytes = occ.bytes / occ.groups if occ.groups else 0.0
    cores = per_step = None
    if cpu:
        used = cpu_between(cpu, win.start, win.end)
        cores = {k: v / win.seconds for k, v in used.items()}
        per_step = sum(v for k, v in used.items() if k not in ("machine", "outside")) / win.steps
    last = rows[-max(1, len(rows) // 5):]
    # time/wall is when the step ended, not a phase.
    phase_keys = sorted({k for r in in_win for k in r if k.startswith("time/") and k != "time/wall"})
    actor_spans: dict[str, float] = {}
    for spans in tl.actors:
        for kind, secs in busy_seconds(spans, win.start, win.end).items():
            actor_spans[kind] = actor_spans.get(kind, 0.0) + secs / win.steps
    return RunFigures(
        name=name,
        mode=cfg.mode,
        actors=len(actors),
        eta=cfg.replay.max_staleness,
        inflight_prompts=cfg.actors.max_inflight_prompts,
        groups_per_step=cfg.learner.groups_per_step,
        ranks=cfg.learner.ranks,
        steps=win.steps,
        window_s=win.seconds,
        step_s=win.seconds / win.steps,
        samples_per_s=sum(r["batch/fresh_samples"] for r in in_win) / win.seconds,
        tokens_per_s=sum(r["batch/fresh_tokens"] for r in in_win) / win.seconds,
        generate_s=phases.generate,
        train_s=phases.train,
        learner_busy=fractions(tl.learner, win),
        actors_busy=[fractions(a, win) for a in tl.actors],
        all_waiting=all_waiting(tl.learner, tl.actors, win),
        actor_tokens_per_s=_mean([a.tokens_generated / a.generate_seconds for a in actors if a.generate_seconds > 0]),
        learner_tokens_per_s=statistics.median(r["learner/tokens_per_s"] for r in in_win),
        weights=WeightSync(
            publishes=publishes,
            publish_s=lrn.publish_seconds / max(publishes, 1),
            publish_bytes=lrn.publish_bytes // max(publishes, 1),
            loads=loads,
            load_s=load_s / max(loads, 1),
            load_bytes=load_bytes // max(loads, 1),
            load_gb_per_s=load_bytes / load_s / 1e9 if load_s > 0 else 0.0,
            delay_s=statistics.median(delays) if (delays := weight_delays(tl.learner, tl.actors, win)) else 0.0,
        ),
        rollout_mb_per_s=result.replay.accepted * group_bytes / result.wall_seconds / 1e6,
        staleness_hist=result.replay.staleness_hist,
        reward_last=_mean([r["reward/mean"] for r in last]),
        cpu_cores=cores,
        cpu_s_per_step=per_step,
        learner_phase_s={k.removeprefix("time/"): _mean([r.get(k, 0.0) for r in in_win]) for k in phase_keys},
        actor_span_s=actor_spans,
        actor_cpu_s=[dict(zip(("thread", "engine", "forward"),
                              (v / win.steps for v in marked_between(a.cpu_marks, win.start, win.end)),
                              strict=True)) for a in actors if a.cpu_marks],
    )


@dataclass
class Comparison:
    """Async against sync at the same work."""

    generate_s: float  # g, from the sync run
    train_s: float  # t, from the sync run
    speedup: float  # sync step time / async step time
    ideal: float  # (g + t) / max(g, t)
    of_ideal: float
    cores: int
    cpu_floor_s: float | None  # the sync run's CPU-seconds per step / cores
    ideal_cpu_bound: float | None  # (g + t) / max(g, t, cpu_floor_s)
    of_ideal_cpu_bound: float | None


def compare(sync: RunFigures, async_: RunFigures, cores: int) -> Comparison:
    g, t = sync.generate_s, sync.train_s
    speedup = sync.step_s / async_.step_s
    ideal = ideal_speedup(g, t)
    floor = sync.cpu_s_per_step / cores if sync.cpu_s_per_step is not None else None
    bound = ideal_speedup(g, t, floor) if floor is not None else None
    return Comparison(g, t, speedup, ideal, speedup / ideal, cores, floor, bound,
                      speedup / bound if bound else None)


def median_comparison(pairs: list[Comparison]) -> Comparison:
    """Every figure's median over the repeats (each repeat compared within itself)."""
    def med(values: list) -> float | None:
        return None if any(v is None for v in values) else statistics.median(values)

    return Comparison(*(med([getattr(p, f.name) for p in pairs]) for f in fields(Comparison)))


@dataclass
class BenchResult:
    date: str
    machine: dict
    config: dict
    skip: int
    runs: dict[str, RunFigures]
    comparison: Comparison  # medians over the repeats
    pairs: list[Comparison]  # each repeat's sync against its async
    scaling: dict | None = None
    stage_seconds: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def pair_names(repeats: int) -> list[tuple[str, str]]:
    """(sync run, async run) names of each repeat: sync/async, then sync-2/async-2, ..."""
    return [(f"sync{s}", f"async{s}") for s in ("", *(f"-{r}" for r in range(2, repeats + 1)))]


def plan(cfg: RunConfig, actor_counts: list[int], repeats: int = 1) -> dict[str, RunConfig]:
    """The runs of a benchmark in the order they run: sync and async at the configured actors, repeated
    with the order alternating (so a drift in others' load on the machine falls on both modes), then
    async at the other actor counts."""
    n = cfg.actors.num_actors
    order = [(name, name.split("-")[0], n) for i, pair in enumerate(pair_names(repeats))
             for name in (pair if i % 2 == 0 else pair[::-1])]
    runs = {}
    for name, mode, actors in [*order, *((f"async-{k}actors", "async", k) for k in actor_counts if k != n)]:
        c = cfg.model_copy(deep=True)
        c.mode, c.actors.num_actors = mode, actors
        # Each batch split over the actors, as synchronous GRPO does. Tickets go to whoever asks
        # first, so without this cap the first actor to ask would take a whole batch (docs/scaling.md).
        even = -(-c.learner.groups_per_step // actors)
        c.actors.max_inflight_prompts = min(c.actors.max_inflight_prompts, even)
        runs[name] = validate(c, [])
    return runs


def _run_one(cfg: RunConfig, paths: RunPaths, prepared, spec: RunSpec, name: str, timer) -> list[CpuSample] | None:
    """Train one benchmark run (skipped if finished) and return its CPU samples (None if not recorded)."""
    rl_dir = paths.rl(name)
    cpu_file = rl_dir / "cpu.json"
    if (rl_dir / "result.json").is_file():
        return [CpuSample(**s) for s in json.loads(cpu_file.read_text())] if cpu_file.is_file() else None
    if rl_dir.exists():
        shutil.rmtree(rl_dir)  # a half-finished run would time only its resumed part: start it over
    with ProcessTreeCPU() as sampler:
        train_mode(cfg, paths, prepared, spec, rl_dir, timer, name=name)
    cpu_file.write_text(json.dumps([asdict(s) for s in sampler.samples]))
    (rl_dir / MEMORY_FILE).write_text(json.dumps({k: asdict(m) for k, m in memory_of(sampler.peaks).items()}))
    return sampler.samples


def run_bench(cfg: RunConfig, out: Path, actor_counts: list[int], skip: int, machine: dict,
              repeats: int = 1) -> BenchResult:
    """Run (or resume: finished runs are kept) the benchmark in `out`; write bench.json."""
    spec = RunSpec.of(cfg)
    runs = plan(cfg, actor_counts, repeats)
    paths = RunPaths(out)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(dump_config(cfg))
    timer = StageTimer()
    figures: dict[str, RunFigures] = {}
    with ray_cluster(cfg, prestart=True):
        prepared = prepare(cfg, paths, timer, spec.needs_presampling)
        for name, rcfg in runs.items():
            cpu = _run_one(rcfg, paths, prepared, spec, name, timer)
            figures[name] = measure(name, rcfg, paths.rl(name), skip, cpu)
    cores = len(os.sched_getaffinity(0))
    pairs = [compare(figures[s], figures[a], cores) for s, a in pair_names(repeats)]
    result = BenchResult(
        date=time.strftime("%Y-%m-%d %H:%M %Z"),
        machine={**machine, "load_avg_end": os.getloadavg()},
        config=cfg.model_dump(mode="json"),
        skip=skip,
        runs=figures,
        comparison=median_comparison(pairs),
        pairs=pairs,
        scaling=scaling_model(figures, cores),
        stage_seconds=timer.seconds,
    )
    (out / "bench.json").write_text(result.to_json())
    return result


def scaling_model(figures: dict[str, RunFigures], cores: int) -> dict | None:
    """The scaling model fitted on the sync run that others' jobs disturbed least, checked against
    every run, and its projections."""
    syncs = [f for f in figures.values() if f.mode == "sync" and f.cpu_cores is not None]
    if not syncs:
        return None
    calibration = min(syncs, key=lambda f: f.cpu_cores.get("outside", 0.0))
    costs = scaling.Costs.from_sync(calibration)
    eta, groups = figures["async"].eta, calibration.groups_per_step
    return {
        "calibration": calibration.name,
        "costs": asdict(costs),
        "check": [asdict(r) for r in scaling.check(costs, list(figures.values()), cores)],
        # Batches split evenly over the actors, at the async run's eta.
        "projection_here": scaling.projection(costs, list(range(1, 9)), [1], cores, eta, groups),
        "projection_dedicated": scaling.projection(costs, [1, 2, 4, 8, 16, 32], [1, 2, 4, 8], None, eta, groups),
    }
