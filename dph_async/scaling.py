"""A throughput model of the actor-learner pipeline from measured per-component costs.

Inputs, all from one sync benchmark run (its generation and training phases alternate, so each is
measured without the other competing for the cores):

    B      samples per learner step (groups_per_step x sampling.n)
    a      actor seconds per sample: g x N / B (g: the sync generation phase, N actors in parallel);
           includes loading the new weights, generating, scoring and sending
    t      learner seconds per step: training, plus publishing the weights
    k_a    actor CPU-seconds per sample (engine, reward workers)
    k_l    learner CPU-seconds per step (training, replay, weight server)
    r      cores busy with everything else (Ray's services, the driver)

Projected seconds per learner step with N actors, R learner ranks and C cores shared by them all
(C = None: every process has its own device, as on a cluster):

    async:  max(a B / N,  t(R),  (k_a B + k_l) / (C - r))
    sync:   max(a B / N,  k_a B / (C - r)) + t(R)

An async step is as long as the slowest of generation, training and (on shared cores) the CPU work
of the step; a sync step is generation then training. t(R) = t_train / R + allreduce(R) + t_publish,
with a ring all-reduce of the gradients (the published weight bytes) moving 2 (R - 1) / R of them
at `allreduce_gb_s`. Only R = 1 is measured here (the learner runs one rank); R > 1 is a projection.
docs/scaling.md has the derivation, the check against 1, 2 and 3 actors, and its limits.
"""

from __future__ import annotations

from dataclasses import dataclass

from dph_async.bench.pipeline import RunFigures


@dataclass(frozen=True)
class Costs:
    samples_per_step: float  # B
    actor_s_per_sample: float  # a
    train_s: float  # learner training seconds per step
    publish_s: float  # learner publishing seconds per step
    actor_cpu_s_per_sample: float  # k_a
    learner_cpu_s_per_step: float  # k_l
    other_cores: float  # r
    grad_bytes: int

    @classmethod
    def from_sync(cls, sync: RunFigures) -> Costs:
        if sync.cpu_cores is None:
            raise ValueError(f"run {sync.name!r} has no CPU samples; the model needs them")
        b = sync.samples_per_s * sync.step_s
        busy = sync.learner_busy
        return cls(
            samples_per_step=b,
            actor_s_per_sample=sync.generate_s * sync.actors / b,
            train_s=busy.get("train", 0.0) * sync.step_s,
            publish_s=(busy.get("publish", 0.0) + busy.get("checkpoint", 0.0)) * sync.step_s,
            actor_cpu_s_per_sample=sync.cpu_cores.get("actors", 0.0) * sync.step_s / b,
            learner_cpu_s_per_step=sync.cpu_cores.get("learner", 0.0) * sync.step_s,
            other_cores=sync.cpu_cores.get("ray", 0.0),
            grad_bytes=sync.weights.publish_bytes,
        )


def learner_step_s(c: Costs, ranks: int, allreduce_gb_s: float) -> float:
    """t(R): the training compute split over R ranks, a ring all-reduce of the gradients, publishing."""
    allreduce = 2 * (ranks - 1) / ranks * c.grad_bytes / (allreduce_gb_s * 1e9)
    return c.train_s / ranks + allreduce + c.publish_s


def step_s(c: Costs, mode: str, actors: int, ranks: int = 1, cores: float | None = None,
           allreduce_gb_s: float = 1.0) -> float:
    """Projected seconds per learner step (see the module docstring)."""
    if mode not in ("sync", "async"):
        raise ValueError(f"mode must be sync or async, got {mode!r}")
    generate = c.actor_s_per_sample * c.samples_per_step / actors
    train = learner_step_s(c, ranks, allreduce_gb_s)
    free = None if cores is None else max(cores - c.other_cores, 1e-9)
    actor_cpu = c.actor_cpu_s_per_sample * c.samples_per_step
    if mode == "sync":
        return max(generate, actor_cpu / free if free else 0.0) + train
    return max(generate, train, (actor_cpu + c.learner_cpu_s_per_step) / free if free else 0.0)


def samples_per_s(c: Costs, mode: str, actors: int, ranks: int = 1, cores: float | None = None,
                  allreduce_gb_s: float = 1.0) -> float:
    return c.samples_per_step / step_s(c, mode, actors, ranks, cores, allreduce_gb_s)


@dataclass
class CheckRow:
    mode: str
    actors: int
    measured: float  # samples/s
    projected: float
    error: float  # projected / measured - 1


def check(c: Costs, runs: list[RunFigures], cores: float) -> list[CheckRow]:
    """Projection against each measured run on this machine."""
    rows = []
    for r in sorted(runs, key=lambda r: (r.mode, r.actors)):
        projected = samples_per_s(c, r.mode, r.actors, cores=cores)
        rows.append(CheckRow(r.mode, r.actors, r.samples_per_s, projected, projected / r.samples_per_s - 1))
    return rows


def projection(c: Costs, actors: list[int], ranks: list[int], cores: float | None,
               allreduce_gb_s: float = 1.0) -> list[dict[str, float]]:
    """Projected samples/s for every (actors, ranks), both modes."""
    return [{"actors": n, "ranks": r, "cores": cores or 0,
             "sync": samples_per_s(c, "sync", n, r, cores, allreduce_gb_s),
             "async": samples_per_s(c, "async", n, r, cores, allreduce_gb_s)}
            for r in ranks for n in actors]
