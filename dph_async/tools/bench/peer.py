"""`dph-async bench peer`: the same GRPO work through dph-async and through single-process trainers.

Systems, each doing `steps` steps of `prompts_per_step` prompts x n completions of the same model
and prompts at the same max tokens, lr and temperature:

    dph-async  an RL run of the config (async at its eta), measured from its own records by the
               pipeline bench's machinery (bench/pipeline.py: timeline, CPU samples)
    loop       the in-repo single-process loop (bench/peer_loop.py): HF generate, the project's
               loss, AdamW; needs nothing beyond the project
    trl        TRL's GRPOTrainer (bench/peer_trl.py) in its own virtual environment under .cache/,
               installed on first use; if it cannot be, the bench says so and goes on without it

Repeats alternate the order of the systems (rotated by one each repeat), so a drift in others' load
on the machine falls on all of them. Figures per run over its steady state (steps after `skip`):
seconds per step, completions/s, tokens/s, per-phase seconds per step, the machine's load average
at the start and end and the cores others used meanwhile. The summary: each system's median over
the repeats, and the ratio dph-async completions/s / the peer's.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

from dph_async.config import RunConfig, load_config
from dph_async.paths import RunPaths
from dph_async.pipeline.report import markdown_table, rate
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import StageTimer, prepare, prepare_embedded
from dph_async.run_stats import ActorStats, read_result
from dph_async.runtime.cluster import ray_cluster
from dph_async.stats import RatioInterval, ratio_interval
from dph_async.tasks.dataset import load_prompts
from dph_async.tools.bench.cpu import Memory, ProcessTreeCPU, cpu_between
from dph_async.tools.bench.peer_limit import Limit, limit_lines, limit_of
from dph_async.tools.bench.peer_spec import PeerSpec
from dph_async.tools.bench.pipeline import MEMORY_FILE, _run_one, measure

SYSTEMS = ("dph-async", "loop", "trl")
TRL_PACKAGES = ("transformers==5.23.0", "trl==1.16.0", "datasets==5.2.0", "accelerate==1.15.0")
PHASES = ("generate", "reward", "forward", "backward", "optimizer")
# The peers run every sequence through the model, zero advantage or not; so does dph-async here (its
# default skips them: the update is the same, the work is not).
SAME_WORK = ("learner.skip_zero_advantage=false",)
# What a report says of that setting; None: a bench.json from before it was recorded.
ZERO_ADVANTAGE = {True: "skipped", False: "trained, as the peers do", None: "(not recorded: skipped before 2026-11-29)"}


@dataclass
class PeerRun:
    system: str
    repeat: int
    steps: int  # in the steady-state window
    step_s: float
    completions_per_s: float
    tokens_per_s: float
    phases: dict[str, float]  # seconds per step (dph-async: the learner's wait for a batch, training)
    startup_s: float | None  # process start -> first step (dph-async: the RL stage's wall time outside the window)
    load_avg: tuple[float, float]  # 1-minute load average at the start and at the end
    outside_cores: float | None  # cores others' jobs used during the window
    reward_mean: float
    cpu_s_per_step: float | None  # every process of the system; None for a peer's result from before it was kept
    detail: dict = field(default_factory=dict)
    # Peak resident set per process, MiB: the peer's process; dph-async's learner and actor (the
    # largest process of each) and Ray's processes with the driver's (summed). Empty where not recorded.
    peak_rss_mb: dict[str, float] = field(default_factory=dict)


@dataclass
class PeerBench:
    date: str
    machine: dict
    workload: dict
    skip: int
    runs: list[PeerRun]
    medians: dict[str, dict[str, float]]  # system -> figure -> median over repeats
    ratios: dict[str, float]  # peer -> dph-async completions/s / the peer's (medians)
    limit: Limit | None  # what dph-async's CPU-seconds per step allow against each peer (None without one)
    notes: list[str]
    # peer -> the ratio from each repeat's two runs (made in one rotation) with its 95% interval
    intervals: dict[str, RatioInterval] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def spec_of(cfg: RunConfig, model: Path, data: Path) -> PeerSpec:
    return PeerSpec(model=str(model), data=str(data), steps=cfg.learner.steps,
                    prompts_per_step=cfg.learner.groups_per_step,
                    n=cfg.sampling.n, max_tokens=cfg.sampling.max_tokens, lr=cfg.learner.lr,
                    temperature=cfg.sampling.temperature, grad_clip=cfg.learner.grad_clip,
                    weight_decay=cfg.learner.weight_decay, seed=cfg.seed,
                    max_prompt_tokens=cfg.model.max_model_len - cfg.sampling.max_tokens)


def ensure_trl(cache: Path, log) -> tuple[Path | None, str]:
    """The Python of TRL's environment (made on first use), or None and why not."""
    torch_version = importlib.metadata.version("torch")  # this environment's torch, for TRL's to match
    venv = cache / "peer-trl"
    key = hashlib.sha256(" ".join((torch_version, *TRL_PACKAGES)).encode()).hexdigest()[:12]
    python, stamp = venv / "bin" / "python", venv / f".ready-{key}"
    if stamp.is_file():
        return python, ""
    log(f"installing TRL into {venv} (once; about a minute): torch=={torch_version}, {', '.join(TRL_PACKAGES)}")
    out = cache / "peer-trl-install.log"
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", f"torch=={torch_version}"],
             [str(python), "-m", "pip", "install", *TRL_PACKAGES]]
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for cmd in steps:
                if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode != 0:
                    return None, f"TRL could not be installed ({' '.join(cmd[-3:])} failed; log: {out})"
        stamp.touch()
    except OSError as e:
        return None, f"TRL could not be installed in {venv}: {e}"
    return python, ""


def trl_python(systems: list[str], cache: Path, notes: list[str], log) -> tuple[Path | None, list[str]]:
    """TRL's Python where `systems` name it (made on first use), and the systems that will run: without
    TRL where it could not be had, which goes into `notes`."""
    if "trl" not in systems:
        return None, systems
    python, why = ensure_trl(cache, log)
    if python is None:
        notes.append(why)
        log(why)
        return None, [s for s in systems if s != "trl"]
    return python, systems


def _window(steps: list[dict], skip: int) -> list[dict]:
    return steps[skip:] if len(steps) > skip else steps


def run_peer(system: str, python: Path, spec_file: Path, prompts_file: Path, out: Path, repeat: int,
             skip: int) -> PeerRun:
    """One run of a single-process peer in a fresh process (skipped if its result is there)."""
    result = out / f"{system}-{repeat}.json"
    load0 = os.getloadavg()[0]
    if not result.is_file():
        script = ["-m", "dph_async.tools.bench.peer_loop", str(spec_file)] if system == "loop" else \
            [str(Path(__file__).with_name("peer_trl.py")), str(spec_file), str(prompts_file)]
        log = out / f"{system}-{repeat}.log"
        with ProcessTreeCPU() as sampler, log.open("w") as f:
            proc = subprocess.run([str(python), *script, str(result.with_suffix(".partial"))], stdout=f,
                                  stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{system} failed (exit {proc.returncode}); its log: {log}")
        data = json.loads(result.with_suffix(".partial").read_text())
        steps, t = data["steps"], time.time()
        window = sum(s["step_s"] for s in _window(steps, skip))
        used = cpu_between(sampler.samples, t - window, t)  # the last steps ran just before the exit
        data["outside_cores"] = used.get("outside", 0.0) / window if window > 0 else None
        data["load_avg"] = (load0, os.getloadavg()[0])
        result.with_suffix(".partial").rename(result)
        result.write_text(json.dumps(data))
    data = json.loads(result.read_text())
    win = _window(data["steps"], skip)
    seconds = sum(s["step_s"] for s in win)
    return PeerRun(
        system=system, repeat=repeat, steps=len(win), step_s=seconds / len(win),
        completions_per_s=sum(s["completions"] for s in win) / seconds,
        tokens_per_s=sum(s["tokens"] for s in win) / seconds,
        phases={p: sum(s[p] for s in win) / len(win) for p in PHASES},
        startup_s=data["startup_s"], load_avg=tuple(data["load_avg"]), outside_cores=data["outside_cores"],
        reward_mean=sum(s["reward_mean"] for s in win) / len(win),
        cpu_s_per_step=sum(s["cpu_s"] for s in win) / len(win) if "cpu_s" in win[0] else None,
        detail={k: v for k, v in data.items() if k in ("threads", "loss_type", "prompt_ids_match",
                                                       "gradient_checkpointing")},
        peak_rss_mb={system: data["peak_rss_mb"]} if "peak_rss_mb" in data else {},
    )


def held_cluster(cfg: RunConfig, prestart: bool = False) -> contextlib.AbstractContextManager:
    """The Ray cluster this process holds, where it holds one (`bench scale`'s cells share it, and the
    processes their runs keep), else a cluster of its own for the block (a fresh one per dph-async run,
    so that each run starts as an invocation does)."""
    return contextlib.nullcontext() if ray.is_initialized() else ray_cluster(cfg, prestart=prestart)


def run_dph(cfg: RunConfig, out: Path, repeat: int, skip: int) -> PeerRun:
    """One dph-async RL run of `cfg` (skipped if finished), measured as `dph-async bench` measures."""
    name = f"dph-async-{repeat}"
    paths = RunPaths(out)
    load0 = os.getloadavg()[0]
    with held_cluster(cfg, prestart=True):
        prepared = prepare(cfg, paths, StageTimer(), False)
        cpu = _run_one(cfg, paths, prepared, RunSpec.of(cfg), name, StageTimer())
    f = measure(name, cfg, paths.rl(name), skip, cpu)
    result = read_result(paths.rl(name))
    return PeerRun(
        system="dph-async", repeat=repeat, steps=f.steps, step_s=f.step_s, completions_per_s=f.samples_per_s,
        tokens_per_s=f.tokens_per_s, phases={"learner wait (g)": f.generate_s, "learner train (t)": f.train_s},
        startup_s=result.wall_seconds - f.window_s, load_avg=(load0, os.getloadavg()[0]),
        outside_cores=f.cpu_cores.get("outside") if f.cpu_cores else None, reward_mean=f.reward_last,
        cpu_s_per_step=f.cpu_s_per_step,
        detail={"eta": f.eta, "actors": f.actors, "cpu_cores": f.cpu_cores, "learner_phase_s": f.learner_phase_s,
                "tokens_per_step": f.tokens_per_s * f.step_s, **engine_cpu_per_token(result.actors),
                "weights": asdict(f.weights), "learner_busy": f.learner_busy, "actors_busy": f.actors_busy,
                "actor_cpu_s": f.actor_cpu_s, "cores": result.cores,
                "cores_shared_with": result.cores_shared_with},
        peak_rss_mb=dph_memory(paths.rl(name) / MEMORY_FILE),
    )


def dph_memory(path: Path) -> dict[str, float]:
    """A dph-async run's peak resident sets (bench/pipeline.py's memory.json): the learner's and an
    actor's largest process, Ray's processes and the driver summed; empty without the file."""
    if not path.is_file():
        return {}
    memory = {k: Memory(**v) for k, v in json.loads(path.read_text()).items()}
    out = {name: memory[k].largest_mb for k, name in (("learner", "learner"), ("actors", "actor")) if k in memory}
    if "ray" in memory:
        out["Ray and the driver"] = memory["ray"].sum_mb
    return out


def engine_cpu_per_token(actors: list[ActorStats]) -> dict[str, float]:
    """The engines' thread CPU per generated token over a run: in engine steps, and of that in the
    model's forward."""
    if not actors:
        return {}
    tokens = sum(a.tokens_generated for a in actors) or 1
    return {"engine_cpu_per_token": sum(a.generate_cpu_seconds for a in actors) / tokens,
            "forward_cpu_per_token": sum(a.forward_cpu_seconds for a in actors) / tokens}


def write_inputs(cfg: RunConfig, model: Path, data: Path, out: Path) -> tuple[Path, Path]:
    """The peers' spec and their prompts (token ids as the project encodes them, and what scores them)."""
    # heavy (transformers, and torch with it: ~3 s): the options of `bench peer` and `bench scale` import
    # this module (SYSTEMS), so their --help would wait for it; only a run gets here
    from transformers import AutoTokenizer

    spec = spec_of(cfg, model, data)
    prompts = load_prompts(data, AutoTokenizer.from_pretrained(model), spec.max_prompt_tokens)
    spec_file, prompts_file = out / "spec.json", out / "prompts.json"
    spec_file.write_text(json.dumps(asdict(spec), indent=2))
    prompts_file.write_text(json.dumps([{"ids": list(p.prompt_ids), "data_source": p.data_source,
                                         "ground_truth": p.ground_truth} for p in prompts]))
    return spec_file, prompts_file


def summarise(runs: list[PeerRun]) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    medians = {}
    for system in SYSTEMS:
        rs = [r for r in runs if r.system == system]
        if rs:
            medians[system] = {k: statistics.median(getattr(r, k) for r in rs)
                               for k in ("step_s", "completions_per_s", "tokens_per_s")}
            medians[system].update({f"phase {p}": statistics.median(r.phases[p] for r in rs) for p in rs[0].phases})
    ratios = {peer: medians["dph-async"]["completions_per_s"] / medians[peer]["completions_per_s"]
              for peer in ("loop", "trl") if peer in medians and "dph-async" in medians}
    return medians, ratios


def intervals(runs: list[PeerRun]) -> dict[str, RatioInterval]:
    """dph-async against each peer, paired within a repeat (the runs of one rotation ran one after
    the other, so they share the machine's drift), as a geometric mean with its 95% interval."""
    by = {(r.system, r.repeat): r.completions_per_s for r in runs}
    out = {}
    for peer in ("loop", "trl"):
        pairs = [(by[("dph-async", k)], v) for (s, k), v in by.items() if s == peer and ("dph-async", k) in by]
        ci = ratio_interval(pairs)
        if ci is not None:
            out[peer] = ci
    return out


def run(cfg: RunConfig, out: Path, repeats: int, skip: int, machine: dict, systems: list[str], cache: Path,
        log=print, settings: Sequence[str] = ()) -> PeerBench:
    """Prepare the workload (the embedded default's warm start, or --model/--data), then run the
    systems `repeats` times in rotating order; write bench.json. `settings`: the KEY=VALUE overrides
    `cfg` was made with, recorded so that runs of one workload under other settings tell apart."""
    out.mkdir(parents=True, exist_ok=True)
    notes = []
    with held_cluster(cfg):
        prepared = prepare(cfg, RunPaths(out), StageTimer(), False)
    peers = out / "peers"
    peers.mkdir(exist_ok=True)
    spec_file, prompts_file = write_inputs(cfg, prepared.base, prepared.train, peers)
    pythons = {"loop": Path(sys.executable)}
    trl, systems = trl_python(systems, cache, notes, log)
    if trl is not None:
        pythons["trl"] = trl
    runs: list[PeerRun] = []
    for repeat in range(1, repeats + 1):
        shift = (repeat - 1) % len(systems)
        for system in systems[shift:] + systems[:shift]:
            log(f"repeat {repeat}/{repeats}: {system}")
            try:
                run_ = run_dph(cfg, out, repeat, skip) if system == "dph-async" else \
                    run_peer(system, pythons[system], spec_file, prompts_file, peers, repeat, skip)
            except RuntimeError as e:
                if system != "trl":
                    raise
                notes.append(f"TRL did not run: {e}")
                log(notes[-1])
                systems = [s for s in systems if s != "trl"]
                continue
            runs.append(run_)
            log(f"  {system}: {run_.step_s:.3f} s/step, {rate(run_.completions_per_s)} completions/s "
                f"(load {run_.load_avg[0]:.1f} -> {run_.load_avg[1]:.1f})")
    medians, ratios = summarise(runs)
    res = PeerBench(date=time.strftime("%Y-%m-%d %H:%M %Z"), machine={**machine, "load_avg_end": os.getloadavg()},
                    workload={**asdict(spec_of(cfg, prepared.base, prepared.train)), "eta": cfg.replay.max_staleness,
                              "objective": cfg.learner.loss.objective, "actors": cfg.actors.num_actors,
                              "skip_zero_advantage": cfg.learner.skip_zero_advantage, "settings": list(settings)},
                    skip=skip, runs=runs, medians=medians, ratios=ratios,
                    limit=limit_of(runs, os.cpu_count() or 1), notes=notes, intervals=intervals(runs))
    (out / "bench.json").write_text(res.to_json())
    return res


def markdown(res: PeerBench) -> str:
    w = res.workload
    lines = [
        f"# dph-async bench peer ({res.date})", "",
        f"Machine: {res.machine.get('cpu', '?')}, {res.machine.get('cores')} cores; load average at start "
        f"{res.machine.get('load_avg')}, at end {res.machine.get('load_avg_end')}.",
        f"Work: {w['prompts_per_step']} prompts x {w['n']} completions per step, at most {w['max_tokens']} tokens, "
        f"lr {w['lr']:g}, temperature {w['temperature']:g}, {w['steps']} steps (steady state: steps after "
        f"{res.skip}); model {w['model']}; data {w['data']}; dph-async: objective {w['objective']}, "
        f"{w['actors']} actors, eta {w['eta']}, sequences of zero advantage "
        f"{ZERO_ADVANTAGE[w.get('skip_zero_advantage')]}"
        + (f"; settings given: {', '.join(w['settings'])}." if w.get("settings") else "."), "",
        "## Medians over the repeats", "",
        markdown_table(["system", "s/step", "completions/s", "tokens/s", "dph-async / system (medians)",
                        "per repeat: geometric mean (95% interval)"], [
            [s, f"{m['step_s']:.3f}", rate(m['completions_per_s']), rate(m['tokens_per_s']),
             f"{res.ratios[s]:.2f}x" if s in res.ratios else "-",
             res.intervals[s].fmt() if s in res.intervals else "-"] for s, m in res.medians.items()]), "",
        "## Runs", "",
        markdown_table(["system", "repeat", "s/step", "completions/s", "phases (s/step)", "start-up s",
                        "load avg start -> end", "cores used by others", "peak RSS MiB"], [
            [r.system, str(r.repeat), f"{r.step_s:.3f}", rate(r.completions_per_s),
             ", ".join(f"{k} {v:.3f}" for k, v in r.phases.items()),
             f"{r.startup_s:.1f}" if r.startup_s is not None else "-",
             f"{r.load_avg[0]:.1f} -> {r.load_avg[1]:.1f}",
             f"{r.outside_cores:.2f}" if r.outside_cores is not None else "-",
             ", ".join(f"{k} {v:.0f}" for k, v in r.peak_rss_mb.items()) or "-"] for r in res.runs]), "",
    ]
    if res.limit is not None:
        lines += limit_lines(res.limit)
    if res.notes:
        lines += ["Notes:", "", *(f"- {n}" for n in res.notes), ""]
    return "\n".join(lines)


USER_CASE = ("sampling.max_tokens=8", "learner.lr=1e-4")


def make_user_case(out: Path, seed: int) -> tuple[Path, Path]:
    """The user's case of issue-style reports: a tiny HF Llama (4 layers, hidden 128, fp32, the
    16-id character tokenizer), briefly trained so that it answers in a few tokens, and verl-format
    parquet prompts: the embedded task's files and warm start, made as `dph-async run` makes them."""
    cfg = load_config("default", ["model.tiny_layers=4", "warmstart.steps=300", f"seed={seed}"])
    paths = RunPaths(out)
    files = prepare_embedded(cfg, paths, StageTimer())
    return paths.base_model, files["train"]
