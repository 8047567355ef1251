"""The arithmetic of the limit: how fast dph-async's measured costs let it run against a peer.

On `cores` cores no schedule runs a step in less than its CPU-seconds / cores, so at a cost of C
CPU-seconds per step dph-async runs at most

    ceiling = peer s/step / (C / cores)

times the peer's speed, however well its processes overlap. Splitting C into parts and keeping only
some says how far cutting the others could go:

    training      the learner's forward, loss, backward and optimizer: what any trainer of this
                  batch spends (the loop trains the same model on the same tokens)
    forward       the engines' model forward (decoder and logits) for the batch's tokens: what any
                  engine generating them spends
    bookkeeping   the rest of vLLM's engine steps: scheduling, KV blocks, sampling, output objects
    the rest      the learner's batching, publishing and receiving; the actors' weight loads,
                  scoring and sending; Ray

The target is TARGET x each peer; it is out of reach at the measured costs when even the parts kept
exceed `allowed_cpu_s` = cores x the peer's s/step / TARGET.

A second bound holds whatever the cores: each actor's rollout loop (engine steps, weight loads,
scoring, sending) runs on one thread, which spends no more CPU than wall time. So a step takes at
least the CPU-seconds per step of the busiest actor's thread (T, measured over the steady state), and

    thread ceiling = peer s/step / T

Where it equals the measured ratio, that thread is full and sets the speed. Its engine steps alone
say how far cutting the rest of the thread could go.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from dph_async.pipeline.report import markdown_table

TARGET = 1.5  # dph-async / a single-process trainer, completions/s
TRAINING = ("forward", "loss", "backward", "optimizer")  # the learner's phases that do the arithmetic


@dataclass
class PeerCost:
    step_s: float  # median over its runs
    cpu_s: float | None  # its CPU-seconds per step (every thread), median; None if not recorded
    allowed_cpu_s: float  # dph-async's CPU-seconds per step at TARGET x this peer on every core
    ceilings: dict[str, float]  # the parts of dph-async kept -> the most dph-async / this peer they allow


@dataclass
class Limit:
    cores: int
    parts: dict[str, float]  # dph-async's CPU-seconds per step, by part (medians over its runs)
    threads: dict[str, float]  # thread_s_of's names -> an actor's thread CPU-seconds per step, medians
    peers: dict[str, PeerCost]


def parts_of(run) -> dict[str, float] | None:
    """CPU-seconds per step of one dph-async run, by part; None without its CPU samples."""
    d = run.detail
    cores = d.get("cpu_cores")
    if not cores or "forward_cpu_per_token" not in d:
        return None
    per_step = {k: cores.get(k, 0.0) * run.step_s for k in ("learner", "actors", "ray")}
    # One learner thread (learner.threads=1): its phases' wall time is its CPU time.
    training = min(sum(d["learner_phase_s"].get(k, 0.0) for k in TRAINING), per_step["learner"])
    if actor_cpu := d.get("actor_cpu_s"):  # the actors' clocks over the steady state
        engine, forward = (sum(a[k] for a in actor_cpu) for k in ("engine", "forward"))
    else:  # a run from before they were marked: per token over the whole run
        engine, forward = (d[k] * d["tokens_per_step"] for k in ("engine_cpu_per_token", "forward_cpu_per_token"))
    engine = min(engine, per_step["actors"])
    forward = min(forward, engine)
    return {
        "learner: training": training,
        "actors: the model's forward": forward,
        "actors: vLLM's bookkeeping": engine - forward,
        "learner: the rest": per_step["learner"] - training,
        "actors: the rest": per_step["actors"] - engine,
        "Ray": per_step["ray"],
    }


def thread_s_of(run) -> dict[str, float]:
    """The busiest actor's thread, CPU-seconds per step in one run: all of it and its engine steps
    alone (runs from before the actors marked their clocks: nothing)."""
    actor_cpu = run.detail.get("actor_cpu_s")
    if not actor_cpu:
        return {}
    return {"the busiest actor's thread, as measured": max(a["thread"] for a in actor_cpu),
            "the busiest actor's thread, its engine steps alone": max(a["engine"] for a in actor_cpu)}


KEPT = {  # what each ceiling keeps of dph-async's parts
    "every part, as measured": None,
    "training and vLLM's engine steps": ("learner: training", "actors: the model's forward",
                                         "actors: vLLM's bookkeeping"),
    "training and the model's forward alone": ("learner: training", "actors: the model's forward"),
}


def limit_of(runs: list, cores: int) -> Limit | None:
    """The limit from the dph-async runs against each peer among `runs` (None without both)."""
    parts = [p for r in runs if r.system == "dph-async" and (p := parts_of(r)) is not None]
    peers = sorted({r.system for r in runs} - {"dph-async"})
    if not parts or not peers:
        return None
    med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    per_run = [thread_s_of(r) for r in runs if r.system == "dph-async" and parts_of(r) is not None]
    threads = {k: statistics.median(t[k] for t in per_run) for k in per_run[0]} if all(per_run) else {}
    costs = {}
    for peer in peers:
        mine = [r for r in runs if r.system == peer]
        step = statistics.median(r.step_s for r in mine)
        cpu = [r.cpu_s_per_step for r in mine if r.cpu_s_per_step is not None]
        ceilings = {name: cores * step / sum(med[k] for k in (keys or med)) for name, keys in KEPT.items()}
        ceilings |= {name: step / t for name, t in threads.items()}
        costs[peer] = PeerCost(step_s=step, cpu_s=statistics.median(cpu) if cpu else None,
                               allowed_cpu_s=cores * step / TARGET, ceilings=ceilings)
    return Limit(cores=cores, parts=med, threads=threads, peers=costs)


def limit_lines(lim: Limit) -> list[str]:
    """The limit as a report section (markdown)."""
    total = sum(lim.parts.values())
    peers = list(lim.peers.items())
    return [
        f"## The limit on {lim.cores} cores", "",
        f"No schedule runs a step in less than its CPU-seconds / {lim.cores}: at C CPU-seconds per step "
        f"dph-async runs at most {lim.cores} x (a peer's s/step) / C times the peer's speed. dph-async's "
        "CPU-seconds per step, by part (medians over its runs), and the peers':", "",
        markdown_table(["part", "CPU-s per step", "share"],
                       [[k, f"{v:.3f}", f"{v / total:.0%}"] for k, v in lim.parts.items()]
                       + [["dph-async, all", f"{total:.3f}", "100%"]]
                       + [[f"{name}, all (its s/step: {c.step_s:.3f})",
                           f"{c.cpu_s:.3f}" if c.cpu_s is not None else "-", "-"] for name, c in peers]
                       + [[f"what {TARGET:g}x {name} allows dph-async", f"{c.allowed_cpu_s:.3f}", "-"]
                          for name, c in peers]), "",
        markdown_table(["parts kept (the others cut to nothing)",
                        *(f"at most dph-async / {name}" for name, _ in peers)],
                       [[k, *(f"{c.ceilings[k]:.2f}x" for _, c in peers)] for k in KEPT]), "",
    ] + ([
        "Each actor's rollout loop runs on one thread, so a step takes at least the busiest actor's "
        "thread CPU-seconds per step, whatever the cores (where its ceiling equals the measured ratio, "
        "that thread is full and sets the speed):", "",
        markdown_table(["bound", "CPU-s per step", *(f"at most dph-async / {name}" for name, _ in peers)],
                       [[k, f"{t:.3f}", *(f"{c.ceilings[k]:.2f}x" for _, c in peers)]
                        for k, t in lim.threads.items()]), "",
    ] if lim.threads else [])
