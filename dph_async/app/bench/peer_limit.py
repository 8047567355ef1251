"""The arithmetic of the limit: how fast dph-async's measured costs let it run against the loop.

On `cores` cores no schedule runs a step in less than its CPU-seconds / cores, so at a cost of C
CPU-seconds per step dph-async runs at most

    ceiling = loop s/step / (C / cores)

times the loop's speed, however well its processes overlap. Splitting C into parts and keeping only
some says how far cutting the others could go:

    training      the learner's forward, loss, backward and optimizer: what any trainer of this
                  batch spends (the loop trains the same model on the same tokens)
    forward       the engines' model forward (decoder and logits) for the batch's tokens: what any
                  engine generating them spends
    bookkeeping   the rest of vLLM's engine steps: scheduling, KV blocks, sampling, output objects
    the rest      the learner's batching, publishing and receiving; the actors' weight loads,
                  scoring and sending; Ray

The target is TARGET x the loop; it is out of reach at the measured costs when even the parts kept
exceed `allowed_cpu_s` = cores x loop s/step / TARGET.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

TARGET = 1.5  # dph-async / a single-process trainer, completions/s
TRAINING = ("forward", "loss", "backward", "optimizer")  # the learner's phases that do the arithmetic


@dataclass
class Limit:
    cores: int
    loop_step_s: float
    loop_cpu_s: float | None  # the loop's CPU-seconds per step (every thread)
    allowed_cpu_s: float  # dph-async's CPU-seconds per step at TARGET x the loop on every core
    parts: dict[str, float]  # dph-async's CPU-seconds per step, by part (medians over its runs)
    ceilings: dict[str, float]  # the parts kept -> the most dph-async / loop they allow


def parts_of(run) -> dict[str, float] | None:
    """CPU-seconds per step of one dph-async run, by part; None without its CPU samples."""
    d = run.detail
    cores = d.get("cpu_cores")
    if not cores or "forward_cpu_per_token" not in d:
        return None
    per_step = {k: cores.get(k, 0.0) * run.step_s for k in ("learner", "actors", "ray")}
    # One learner thread (learner.threads=1): its phases' wall time is its CPU time.
    training = min(sum(d["learner_phase_s"].get(k, 0.0) for k in TRAINING), per_step["learner"])
    engine = min(d["engine_cpu_per_token"] * d["tokens_per_step"], per_step["actors"])
    forward = min(d["forward_cpu_per_token"] * d["tokens_per_step"], engine)
    return {
        "learner: training": training,
        "actors: the model's forward": forward,
        "actors: vLLM's bookkeeping": engine - forward,
        "learner: the rest": per_step["learner"] - training,
        "actors: the rest": per_step["actors"] - engine,
        "Ray": per_step["ray"],
    }


def limit_of(runs: list, cores: int) -> Limit | None:
    """The limit from the dph-async runs and the loop's runs among `runs` (None without both)."""
    parts = [p for r in runs if r.system == "dph-async" and (p := parts_of(r)) is not None]
    loops = [r for r in runs if r.system == "loop"]
    if not parts or not loops:
        return None
    med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    loop_step = statistics.median(r.step_s for r in loops)
    loop_cpu = [r.cpu_s_per_step for r in loops if r.cpu_s_per_step is not None]

    def ceiling(*keys: str) -> float:
        return cores * loop_step / sum(med[k] for k in keys)

    arithmetic = ("learner: training", "actors: the model's forward")
    engine = (*arithmetic, "actors: vLLM's bookkeeping")
    return Limit(
        cores=cores, loop_step_s=loop_step, loop_cpu_s=statistics.median(loop_cpu) if loop_cpu else None,
        allowed_cpu_s=cores * loop_step / TARGET, parts=med,
        ceilings={"every part, as measured": ceiling(*med), "training and vLLM's engine steps": ceiling(*engine),
                  "training and the model's forward alone": ceiling(*arithmetic)},
    )


def limit_lines(lim: Limit) -> list[str]:
    """The limit as a report section (markdown)."""
    from dph_async.app.report import markdown_table

    total = sum(lim.parts.values())
    loop_cpu = f" (its own CPU: {lim.loop_cpu_s:.3f} CPU-s per step)" if lim.loop_cpu_s is not None else ""
    return [
        f"## The limit on {lim.cores} cores", "",
        f"No schedule runs a step in less than its CPU-seconds / {lim.cores}. The loop takes "
        f"{lim.loop_step_s:.3f} s per step{loop_cpu}; {TARGET:g}x its speed allows dph-async "
        f"{lim.allowed_cpu_s:.3f} CPU-s per step. dph-async's, by part (medians over its runs):", "",
        markdown_table(["part", "CPU-s per step", "share"],
                       [[k, f"{v:.3f}", f"{v / total:.0%}"] for k, v in lim.parts.items()]
                       + [["all", f"{total:.3f}", "100%"]]), "",
        markdown_table(["parts kept (the others cut to nothing)", "at most dph-async / loop"],
                       [[k, f"{v:.2f}x"] for k, v in lim.ceilings.items()]), "",
    ]
