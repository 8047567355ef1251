"""What a run reports, typed end to end: the learner's and each actor's statistics, and the whole RL
run's record (`RLResult`, written to rl/<mode>/result.json and read back through the type).

Light (no torch, vLLM or Ray): the driver, `status` and the benchmarks read these; the learner and
the actors fill them in their own processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from dph_async.replay_stats import ReplayStats
from dph_async.spans import Span


@dataclass
class LearnerStats:
    steps: int = 0
    train_seconds: float = 0.0
    wait_seconds: float = 0.0
    publish_seconds: float = 0.0
    publish_bytes: int = 0
    checkpoint_seconds: float = 0.0
    drops: dict[str, int] = field(default_factory=dict)
    timeline: list[Span] = field(default_factory=list)
    # The bound's changes under replay.max_staleness=auto: (wall time, new eta, the window's mean ESS,
    # the window's mean data wait).
    staleness: list[tuple[float, int, float, float]] = field(default_factory=list)


@dataclass
class ActorStats:
    actor_id: int
    groups_sent: int = 0
    tokens_generated: int = 0
    generate_seconds: float = 0.0  # inside engine steps
    generate_cpu_seconds: float = 0.0  # the thread's CPU-seconds inside engine steps
    forward_cpu_seconds: float = 0.0  # of those, in the model's forward passes; the rest is the engine's bookkeeping
    thread_cpu_seconds: float = 0.0  # the thread's CPU-seconds over the run: engine steps, loads, scoring, sending
    # Every CPU_MARK_S, (wall clock, thread_cpu_seconds, generate_cpu_seconds, forward_cpu_seconds) so
    # far: the three over any window of the run (bench's steady state)
    cpu_marks: list[tuple[float, float, float, float]] = field(default_factory=list)
    wait_seconds: float = 0.0  # waiting for tickets or weights
    score_seconds: float = 0.0
    weight_loads: int = 0
    weight_load_seconds: float = 0.0  # fetch, verify and load into the engine
    weight_fetch_seconds: float = 0.0  # the fetch and checksum part of it
    ticket_seconds: float = 0.0  # asking for admission while the engine has work
    send_seconds: float = 0.0
    weight_bytes: int = 0
    weight_fetch_failures: int = 0  # versions refused (bad checksum, no longer held) or unanswered; old weights stay
    weight_shm_loads: int = 0  # of weight_loads: read from the learner's shared memory (the rest over TCP)
    weight_shm_fallbacks: int = 0  # versions whose segment could not be opened here: read over TCP
    weight_leased_loads: int = 0  # of weight_shm_loads: the engine kept views of the leased segment, no copy
    version: int = 0
    skipped_accepted: int = 0  # positions already accepted before a restart
    resumed_at: int = 0  # the replay's watermark when this process started: every position below was accepted
    wall_seconds: float = 0.0
    cores: list[int] = field(default_factory=list)  # the rollout thread's cores at its end (launcher.pin_cores)
    threads_offloaded: int = 0  # the process's other threads moved to the learner's cores at the start (pin_cores)
    timeline: list[tuple[float, float, str]] = field(default_factory=list)  # (start, end, what), wall clock


@dataclass
class RLResult:
    """One RL run, as run_rl returns it and result.json records it (less the metrics and timelines)."""

    name: str
    learner: LearnerStats
    actors: list[ActorStats]
    replay: ReplayStats
    actor_restarts: int
    wall_seconds: float
    final_model: str
    pids: dict[str, int] = field(default_factory=dict)
    # Seconds from the start of the run to: actors_ready (every engine built), learner_ready (trainer
    # built), first_step (the first metrics arrive), last_step, end (final model written, all stopped).
    phases: dict[str, float] = field(default_factory=dict)
    # Where each actor ran: (address, Ray node id), in order; a restart on another node adds one.
    nodes: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    # The cores each process of the driver's host was pinned to ("learner": every rank), if any
    # (launcher.pin_cores).
    cores: dict[str, list[int]] = field(default_factory=dict)
    # Other invocations on the host whose claims left this run too few cores to pin (cpu_claims.py).
    cores_shared_with: list[str] = field(default_factory=list)
    # The learner's per-step metrics, as the driver read them (empty when read back from result.json:
    # metrics.jsonl has them).
    metrics: list[dict[str, float]] = field(default_factory=list)


def write_result(result: RLResult, rl_dir: Path) -> None:
    """result.json (without the per-step metrics, which metrics.jsonl holds) and timeline.json (the
    processes' busy/wait spans, which benchmarks read, and the staleness bound's changes)."""
    timeline = {"learner": result.learner.timeline, "actors": [a.timeline for a in result.actors],
                "staleness": result.learner.staleness}  # replay.max_staleness=auto: (time, eta, ESS, wait)
    (rl_dir / "timeline.json").write_bytes(msgspec.json.encode(timeline))
    data = msgspec.to_builtins(result)
    del data["metrics"]
    data["learner"]["timeline"] = data["learner"]["staleness"] = []
    for a in data["actors"]:
        a["timeline"] = []
    (rl_dir / "result.json").write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2))


def read_result(rl_dir: Path) -> RLResult:
    """The RL run's record from rl_dir/result.json, through its type (a missing or mistyped field is
    an error naming it)."""
    return msgspec.json.decode((rl_dir / "result.json").read_bytes(), type=RLResult)


def result_from(data: dict) -> RLResult:
    """An RLResult from its JSON form as summary.json nests it (JSON's object keys are strings: the
    replay's staleness histogram's keys become ints again)."""
    return msgspec.convert(data, RLResult, strict=False)
