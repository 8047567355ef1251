"""A throughput model of the actor-learner pipeline from measured per-component costs.

Costs, measured in one benchmark run (`Costs.from_sync`: a sync run, whose phases do not overlap):

    B   samples per learner step (groups_per_step x sampling.n)
    a   actor CPU-seconds per sample: generation, scoring (the reward worker's CPU included), weight
        loads, sending. Actors are single-threaded, so an actor with a core to itself takes a wall
        seconds per sample.
    t   learner CPU-seconds per step: training, publishing, the replay and weight-server threads
    L   from a publish to an actor having loaded those weights (median)
    d   the sync run's generation phase minus the actors' work in it: L, tickets being granted, the
        slowest actor finishing (a sync-only cost)
    r   cores busy with everything else (Ray's services, the driver)

CPU-seconds, not wall seconds: they do not grow when other processes take the cores, so costs
measured on a busy machine still hold.

Layout: N actors, R learner ranks, C cores shared by all (None: every process has its own device,
as on a cluster), eta = replay.max_staleness, and m = actors.max_inflight_prompts with Q prompts
(groups) per step. Admission grants tickets to whichever actor asks first, up to m at a time, so one
batch is spread over at most k = ceil(Q / m) actors, and with weights of version w actors may work
on batches up to w + eta: at most min(N, eta k) actors can be busy at once. Seconds per step:

    sync:   d + max(a B / N,  a B / (C - r)) + t(R)
    async:  max(a B / min(N, eta k),  t(R),  (L + a B / min(N, k) + t(R)) / (eta + 1),  (a B + t) / (C - r))

A sync step is generation then training. An async step is bounded by generation with the actors that
admission lets work, by training, by the chain "weights v reach the actors, they generate batch
v + eta, the learner trains on it" which eta + 1 steps share, and by the CPU work of a step spread
over the cores. t(R) = t / min(R, C - r) + 2 (R - 1) / R x G / `allreduce_gb_s`: training over R
data-parallel ranks (`learner.ranks`; on shared cores, over no more ranks than there are free cores)
plus a ring all-reduce of the G gradient bytes (the published weights' size).

The model takes no account of processes slowing each other down beyond the CPU bound (cache, memory
bandwidth, scheduling), of engine efficiency changing with the number of sequences in flight, or of
uneven batches; docs/scaling.md has the check against runs with 1, 2 and 3 actors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dph_async.tools.bench.figures import RunFigures


@dataclass(frozen=True)
class Costs:
    samples_per_step: float  # B
    actor_cpu_s_per_sample: float  # a
    learner_cpu_s_per_step: float  # t
    weight_latency_s: float  # L
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
            weight_latency_s=sync.weights.delay_s,
            sync_latency_s=max(0.0, sync.generate_s - a * b / sync.actors),
            other_cores=sync.cpu_cores.get("ray", 0.0),
            grad_bytes=sync.weights.publish_bytes,
        )


@dataclass(frozen=True)
class Layout:
    actors: int  # N
    ranks: int = 1  # R
    cores: float | None = None  # C; None: a device per process
    eta: int = 1
    groups_per_step: int = 16  # Q
    inflight_prompts: int | None = None  # m; None: each actor takes an even share of a batch
    allreduce_gb_s: float = 1.0


def learner_step_s(c: Costs, lay: Layout) -> float:
    """t(R): training split over R ranks plus a ring all-reduce of the gradients. On shared cores the
    ranks split it over no more than the free cores: ranks beyond them take turns on the same ones."""
    r = lay.ranks
    split = r if lay.cores is None else max(1.0, min(r, lay.cores - c.other_cores))
    return c.learner_cpu_s_per_step / split + 2 * (r - 1) / r * c.grad_bytes / (lay.allreduce_gb_s * 1e9)


def step_s(c: Costs, mode: str, lay: Layout) -> float:
    """Projected seconds per learner step (see the module docstring)."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    work = c.actor_cpu_s_per_sample * c.samples_per_step  # actor CPU-seconds per step
    train = learner_step_s(c, lay)
    free = None if lay.cores is None else max(lay.cores - c.other_cores, 1e-9)
    if mode == "sync":
        return c.sync_latency_s + max(work / lay.actors, work / free if free else 0.0) + train
    per_batch = lay.actors if lay.inflight_prompts is None else math.ceil(lay.groups_per_step / lay.inflight_prompts)
    batch_actors = min(lay.actors, per_batch)
    busy = min(lay.actors, max(1, lay.eta) * per_batch)
    chain = (c.weight_latency_s + work / batch_actors + train) / (lay.eta + 1)
    cpu = (work + c.learner_cpu_s_per_step) / free if free else 0.0
    return max(work / busy, train, chain, cpu)


def samples_per_s(c: Costs, mode: str, lay: Layout) -> float:
    return c.samples_per_step / step_s(c, mode, lay)


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
    """Projection against each measured run, in its own layout. Other people's jobs took `outside`
    cores during a run, so the projection for that run uses the cores that were left."""
    rows = []
    for r in sorted(runs, key=lambda r: (r.mode, r.actors, r.name)):
        left = cores - (r.cpu_cores or {}).get("outside", 0.0)
        lay = Layout(r.actors, r.ranks, cores=left, eta=r.eta, groups_per_step=r.groups_per_step,
                     inflight_prompts=r.inflight_prompts)
        projected = samples_per_s(c, r.mode, lay)
        idle = samples_per_s(c, r.mode, Layout(r.actors, r.ranks, cores=cores, eta=r.eta,
                                               groups_per_step=r.groups_per_step, inflight_prompts=r.inflight_prompts))
        rows.append(CheckRow(r.name, r.mode, r.actors, r.samples_per_s, projected, idle,
                             projected / r.samples_per_s - 1, left))
    return rows


def projection(c: Costs, actors: list[int], ranks: list[int], cores: float | None, eta: int,
               groups_per_step: int, allreduce_gb_s: float = 1.0) -> list[dict[str, float]]:
    """Projected samples/s for every (actors, ranks), both modes, batches split evenly over the actors."""
    rows = []
    for r in ranks:
        for n in actors:
            lay = Layout(n, r, cores, eta, groups_per_step, None, allreduce_gb_s)
            rows.append({"actors": n, "ranks": r, "cores": cores or 0,
                         "sync": samples_per_s(c, "sync", lay), "async": samples_per_s(c, "async", lay)})
    return rows
