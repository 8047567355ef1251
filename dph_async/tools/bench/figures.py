"""What one RL run of `dph-async bench` measured: the figures the report, the scaling model and
the comparison of runs share (kept apart from the bench itself so the scaling model need not import it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WeightSync:
    publishes: int
    publish_s: float  # learner: snapshot into buckets, per publish
    publish_bytes: int  # per publish
    loads: int  # all actors
    load_s: float  # actor: fetch + verify + load into the engine, per load
    load_bytes: int  # per load
    load_gb_per_s: float  # bytes fetched and loaded per second of loading
    delay_s: float  # median, from the end of a publish to the end of an actor's load of it (or a newer one)


@dataclass
class RunFigures:
    """What one RL run measured, over its steady-state window."""

    name: str
    mode: str
    actors: int
    eta: int  # replay.max_staleness
    inflight_prompts: int  # actors.max_inflight_prompts
    groups_per_step: int
    steps: int  # learner steps in the window
    window_s: float
    step_s: float
    samples_per_s: float  # fresh samples consumed by the learner
    tokens_per_s: float  # fresh tokens consumed by the learner
    generate_s: float  # g: learner seconds per step waiting for its batch
    train_s: float  # t: learner seconds per step training and publishing
    learner_busy: dict[str, float]  # share of the window per span kind
    actors_busy: list[dict[str, float]]
    all_waiting: float  # share of the window in which the learner and every actor were all waiting
    actor_tokens_per_s: float  # per actor, per second of engine stepping (whole run)
    learner_tokens_per_s: float  # median of the window's steps (fresh + reference tokens per step second)
    weights: WeightSync
    rollout_mb_per_s: float  # rollout groups into the replay, whole run
    staleness_hist: dict[str, int]
    reward_last: float  # mean reward over the last fifth of the steps
    cpu_cores: dict[str, float] | None  # mean cores busy per component (and machine, outside) in the window
    cpu_s_per_step: float | None  # CPU-seconds per step of this run's processes
    # Where a step's time goes, seconds per learner step: the learner's phases (its time/* metrics:
    # wait, assemble, forward, backward, step, publish, ...) and the actors' spans summed over actors.
    learner_phase_s: dict[str, float]
    actor_span_s: dict[str, float]
    # Each actor's rollout thread, CPU-seconds per step in the window: "thread" (all of it), "engine" (in
    # engine steps), "forward" (of those, in the model's forward). Empty for runs that did not mark them.
    actor_cpu_s: list[dict[str, float]] = field(default_factory=list)
    ranks: int = 1  # learner.ranks
