"""A throughput model of the actor-learner pipeline from measured per-component costs.

Costs, measured in one benchmark run (`Costs.from_sync`: the sync run, whose phases do not overlap):

    B   samples per learner step (groups_per_step x sampling.n)
    a   actor CPU-seconds per sample: generation, scoring (the reward worker's CPU included), weight
        loads, sending. Actors are single-threaded, so one actor with a core to itself needs a B / N
        wall seconds for its share of a step.
    t   learner CPU-seconds per step: training, publishing, the replay and weight-server threads
    d   the sync run's generation phase minus the actors' work in it: new weights on their way,
        tickets being granted, the slowest actor finishing (a sync-only cost: async hides it)
    r   cores busy with everything else (Ray's services, the driver)

CPU-seconds, not wall seconds: they do not grow when other processes take the cores, so costs
measured on a busy machine still hold. Projected seconds per learner step with N actors, R learner
ranks, and C cores shared by all (C = None: every process has its own device, as on a cluster):

    async:  max(a B / N,  t(R),  (a B + t) / (C - r))
    sync:   d + max(a B / N,  a B / (C - r)) + t(R)

An async step is as long as the slowest of generation, training and the CPU work of a step spread
over the cores; a sync step is generation then training. t(R) = t / R + 2 (R - 1) / R x G /
`allreduce_gb_s`: training split over R data-parallel ranks plus a ring all-reduce of the G gradient
bytes (the size of the published weights). The learner here runs one rank, so R > 1 is a projection.

The async formula is a roofline: it assumes no process ever waits for another when there is work.
What the pipeline loses to coordination shows in the benchmark as `all waiting` (the share of time
in which the learner and every actor were idle together). docs/scaling.md has the check against
runs with 1, 2 and 3 actors and what the model leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

from dph_async.bench.pipeline import RunFigures


@dataclass(frozen=True)
class Costs:
    samples_per_step: float  # B
    actor_cpu_s_per_sample: float  # a
    learner_cpu_s_per_step: float  # t
    sync_latency_s: float  # d
    other_cores: float  # r
    grad_bytes: int  # G

    @classmethod
    def from_sync(cls, sync: RunFigures) -> Costs:
        if sync.cpu_cores is None:
            raise ValueError(f"run {sync.name!r} has no CPU samples; the model needs them")
        b = sync.samples_per_s * sync.step_s
        a = sync.cpu_cores.get("actors", 0.0) * sync.step_s / b
        return cls(
            samples_per_step=b,
            actor_cpu_s_per_sample=a,
            learner_cpu_s_per_step=sync.cpu_cores.get("learner", 0.0) * sync.step_s,
            sync_latency_s=max(0.0, sync.generate_s - a * b / sync.actors),
            other_cores=sync.cpu_cores.get("ray", 0.0),
            grad_bytes=sync.weights.publish_bytes,
        )


def learner_step_s(c: Costs, ranks: int, allreduce_gb_s: float) -> float:
    """t(R): training split over R ranks plus a ring all-reduce of the gradients."""
    return c.learner_cpu_s_per_step / ranks + 2 * (ranks - 1) / ranks * c.grad_bytes / (allreduce_gb_s * 1e9)


def step_s(c: Costs, mode: str, actors: int, ranks: int = 1, cores: float | None = None,
           allreduce_gb_s: float = 1.0) -> float:
    """Projected seconds per learner step (see the module docstring)."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    work = c.actor_cpu_s_per_sample * c.samples_per_step  # actor CPU-seconds per step
    train = learner_step_s(c, ranks, allreduce_gb_s)
    free = None if cores is None else max(cores - c.other_cores, 1e-9)
    if mode == "sync":
        return c.sync_latency_s + max(work / actors, work / free if free else 0.0) + train
    return max(work / actors, train, (work + c.learner_cpu_s_per_step) / free if free else 0.0)


def samples_per_s(c: Costs, mode: str, actors: int, ranks: int = 1, cores: float | None = None,
                  allreduce_gb_s: float = 1.0) -> float:
    return c.samples_per_step / step_s(c, mode, actors, ranks, cores, allreduce_gb_s)


@dataclass
class CheckRow:
    run: str
    mode: str
    actors: int
    measured: float  # samples/s
    projected: float  # on the cores this run had: the machine's minus what others used meanwhile
    projected_idle: float  # on the whole machine
    error: float  # projected / measured - 1
    cores: float


def check(c: Costs, runs: list[RunFigures], cores: float) -> list[CheckRow]:
    """Projection against each measured run. Other people's jobs took `outside` cores during a run,
    so the projection for that run uses the cores that were left."""
    rows = []
    for r in sorted(runs, key=lambda r: (r.mode, r.actors)):
        left = cores - (r.cpu_cores or {}).get("outside", 0.0)
        projected = samples_per_s(c, r.mode, r.actors, cores=left)
        rows.append(CheckRow(r.name, r.mode, r.actors, r.samples_per_s, projected,
                             samples_per_s(c, r.mode, r.actors, cores=cores), projected / r.samples_per_s - 1, left))
    return rows


def projection(c: Costs, actors: list[int], ranks: list[int], cores: float | None,
               allreduce_gb_s: float = 1.0) -> list[dict[str, float]]:
    """Projected samples/s for every (actors, ranks), both modes."""
    return [{"actors": n, "ranks": r, "cores": cores or 0,
             "sync": samples_per_s(c, "sync", n, r, cores, allreduce_gb_s),
             "async": samples_per_s(c, "async", n, r, cores, allreduce_gb_s)}
            for r in ranks for n in actors]
