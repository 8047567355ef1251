"""`dph-async bench tta`: wall-clock to a held-out Pass@1, dph-async against its own sync mode and
TRL's GRPOTrainer on the same work.

Systems, each training the same pi_0 (the task's warm start, prepared once in the output directory)
on the same prompts for `learner.steps` steps of `learner.groups_per_step` prompts x `sampling.n`
completions at the same lr, temperature and max tokens:

    async  dph-async as configured (vLLM actors generating while the learner trains, within eta)
    sync   dph-async with mode=sync (the actors generate the batch the learner waits for)
    trl    TRL's GRPOTrainer (bench/peer_trl.py: HF generate, fp32, beta 0), in its own environment

Each run keeps its weights every `every` steps and at the last, with the run's clock at that moment:
seconds since its first generation began (dph-async: the first prompt an actor handed to its engine;
TRL: the start of its first step, which begins by generating). dph-async's clock holds its
checkpoint writing; TRL's has its writing taken out. After each run the project's evaluator scores
every kept version on the same in-domain test prompts with the same seed (eval.k_max samples a
prompt: Pass@1 as the mean share correct), off the clock. Seeds rotate the systems' order (seed i starts
with the (i mod 3)-th), so a drift of the machine's speed falls on all of them.

    <out>/base_model, data/, eval/base.json       pi_0 and the prompts, shared
    <out>/rl/<system>-seed<s>/                     dph-async's runs (metrics.jsonl, timeline.json, ...)
    <out>/peers/trl-seed<s>.json, trl-seed<s>/v<N>  TRL's steps and kept weights
    <out>/eval/<system>-seed<s>/v<N>.json          the evaluations
    <out>/tta_config.json                          the settings the directory was made with
    <out>/tta.json                                 every curve (tta_report.py reads it), after each run

A finished run (dph-async: result.json; TRL: its JSON) and a written evaluation are kept: the same
command again runs only what is missing, and other seeds join the same tta.json. A run stopped
midway starts over (its clock would otherwise hold only its resumed part), and a directory made
with other settings is refused. The clock assumes one host: its start is an actor's wall clock,
its steps the learner's.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from dph_async.config import ConfigError, RunConfig, dump_config, with_overrides
from dph_async.paths import RunPaths, checkpoint_dir, final_model
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import Prepared, StageTimer, evaluate_models, prepare, train_mode, validate
from dph_async.runtime.evaluate import EvalJob, load_results
from dph_async.safe_files import read_regular, write_output
from dph_async.tools.bench.machine import provenance
from dph_async.tools.bench.peer import held_cluster, run_peer, spec_of, trl_python, write_inputs
from dph_async.tools.bench.timeline import Timeline
from dph_async.tools.bench.tta_data import MAX_BYTES, SPLIT, Curve, TTABench, load
from dph_async.tools.bench.tta_data import SYSTEMS as SYSTEMS  # the systems this bench runs, for its callers


def kept_steps(steps: int, every: int) -> list[int]:
    """The steps whose weights a run keeps: every `every`-th and the last."""
    return sorted({*range(every, steps, every), steps})


def system_config(cfg: RunConfig, system: str, seed: int, every: int) -> RunConfig:
    """dph-async's config for one of its systems and seeds, checkpointing at the kept steps."""
    out = with_overrides(cfg, [f"mode={system}", f"seed={seed}"])
    out.learner.checkpoint_every = every
    out.learner.keep_versions = kept_steps(out.learner.steps, every)
    return validate(out, [RunSpec.of(out)])


def held_out(prepared: Prepared) -> dict[str, Path]:
    """The split the target is on, alone: an evaluation of the other splits would double the bench's
    time and decide nothing."""
    return {SPLIT: prepared.tests[SPLIT]}


def generation_start(rl_dir: Path) -> float:
    """When a dph-async run's first generation began: the first prompt an actor handed to its engine
    (the learner's first training step, should no actor span say so)."""
    tl = Timeline.load(rl_dir / "timeline.json")
    starts = [s.start for spans in tl.actors for s in spans if s.what == "submit"]
    starts += [s.start for s in tl.learner if s.what == "train"]
    return min(starts)


def dph_clock(rl_dir: Path) -> dict[int, float]:
    """Learner version -> the run's clock when that version existed (metrics.jsonl's time/wall, from
    the first generation)."""
    t0 = generation_start(rl_dir)
    rows = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {int(r["learner/version"]): r["time/wall"] - t0 for r in rows}


def _pass1(path: Path) -> float:
    return load_results(path)[SPLIT].pass_at_k[1]


def _se(path: Path) -> float:
    """The sampling standard error of an evaluation's Pass@1 on its prompts: what another draw of
    the samples of the same prompts would change, sqrt(sum_i p_i (1 - p_i) / n) / N for N prompts
    of n samples, p_i a prompt's share correct (the prompts are the same at every evaluation, so
    their own spread does not enter a comparison along a curve)."""
    res = load_results(path)[SPLIT]
    shares = [p.correct / res.samples for p in res.per_prompt]
    return math.sqrt(sum(q * (1 - q) / res.samples for q in shares)) / len(shares)


def base_eval(out: Path, seed: int) -> Path:
    """pi_0's evaluation under a run's seed: the first point of that seed's curves."""
    return RunPaths(out).eval / f"base-seed{seed}.json"


CONFIG_FILE = "tta_config.json"
MADE = ("rl", "peers", "eval", "base_model", "data", "plots", "tta.json", "tta.md", CONFIG_FILE)


def lock(cfg: RunConfig, every: int, out: Path) -> None:
    """Record the settings `out` is made with; refuse a directory made with others (its runs would mix).
    Read and written as every file of a bench directory: no link followed, the read bounded."""
    settings = json.dumps({"config": dump_config(cfg), "every": every}, indent=2)
    path = out / CONFIG_FILE
    if path.is_file() and read_regular(path, MAX_BYTES) != settings.encode():
        raise ConfigError(f"{out} holds a time-to-accuracy bench made with other settings ({path}): give another "
                          "--output, or --fresh to start over")
    write_output(path, settings)


def clear(out: Path) -> None:
    """--fresh: delete what a bench made in `out` (refused for a directory no bench made)."""
    if out.is_dir() and any(out.iterdir()) and not (out / CONFIG_FILE).is_file():
        raise ConfigError(f"--fresh: {out} holds no {CONFIG_FILE}, so no time-to-accuracy bench made it; "
                          "nothing deleted")
    for name in MADE:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.is_file():
            path.unlink()


def curve(system: str, seed: int, clock: dict[int, float], evals: dict[int, Path], base: Path) -> Curve:
    """A run's curve from its clock (step -> seconds), its evaluations (step -> file) and pi_0's."""
    steps = sorted(evals)
    return Curve(system, seed, [0, *steps], [0.0, *(clock[s] for s in steps)],
                 [_pass1(base), *(_pass1(evals[s]) for s in steps)], run_s=clock[max(clock)])


def run_dph(cfg: RunConfig, system: str, seed: int, every: int, out: Path, prepared: Prepared,
            timer: StageTimer) -> Curve:
    """One dph-async run (skipped if finished) and its evaluations (skipped if written)."""
    scfg = system_config(cfg, system, seed, every)
    name = f"{system}-seed{seed}"
    paths = RunPaths(out)
    rl_dir = paths.rl(name)
    if rl_dir.exists() and not (rl_dir / "result.json").is_file():
        shutil.rmtree(rl_dir)  # resumed, its clock would hold only the part after the stop: start it over
    train_mode(scfg, paths, prepared, RunSpec.of(scfg), rl_dir, timer, name=name)
    steps = scfg.learner.steps
    evals = {v: out / "eval" / name / f"v{v}.json" for v in kept_steps(steps, every)}
    jobs = [EvalJob(final_model(rl_dir) if v == steps else checkpoint_dir(rl_dir) / f"v{v}", f, seed)
            for v, f in evals.items()]
    evaluate_models(scfg, jobs, held_out(prepared), arch=prepared.base)
    return curve(system, seed, dph_clock(rl_dir), evals, base_eval(out, seed))


def run_trl(cfg: RunConfig, seed: int, every: int, out: Path, prepared: Prepared, python: Path,
            prompts_file: Path) -> Curve:
    """One TRL run (skipped if finished), keeping its weights at the kept steps, and their evaluations."""
    peers = prompts_file.parent
    name = f"trl-seed{seed}"
    spec = replace(spec_of(cfg, prepared.base, prepared.train), seed=seed, save_every=every,
                   save_dir=str((peers / name).resolve()))
    seed_spec = peers / f"spec-{name}.json"
    write_output(seed_spec, json.dumps(asdict(spec), indent=2))
    # run_peer names its result <system>-<repeat>.json: here the repeat is the seed
    run_peer("trl", python, seed_spec, prompts_file, peers, seed, skip=0)
    steps = json.loads((peers / f"trl-{seed}.json").read_text())["steps"]
    clock = {i + 1: s["wall"] for i, s in enumerate(steps)}
    evals = {v: out / "eval" / name / f"v{v}.json" for v in kept_steps(len(steps), every)}
    jobs = [EvalJob(peers / name / f"v{v}", f, seed) for v, f in evals.items()]
    evaluate_models(cfg, jobs, held_out(prepared))
    return curve("trl", seed, clock, evals, base_eval(out, seed))


def order(systems: list[str], seed_index: int) -> list[str]:
    """The systems in the order one seed runs them: rotated by one per seed."""
    shift = seed_index % len(systems)
    return systems[shift:] + systems[:shift]


def run(cfg: RunConfig, out: Path, seeds: list[int], systems: list[str], every: int, cache: Path,
        log=print) -> TTABench:
    """Prepare pi_0 once and evaluate it under every seed, then every seed's systems in rotating order;
    tta.json is rewritten after each run, with the curves of earlier invocations (the same settings)."""
    out.mkdir(parents=True, exist_ok=True)
    lock(cfg, every, out)
    notes: list[str] = []
    python, systems = trl_python(systems, cache, notes, log)
    paths, timer = RunPaths(out), StageTimer()
    summary = out / "tta.json"
    curves = {(c.system, c.seed): c for c in load(summary).curves} if summary.is_file() else {}
    with held_cluster(cfg, prestart=True):
        prepared = prepare(cfg, paths, timer, False)
        all_seeds = sorted({*seeds, *(s for _, s in curves)})
        evaluate_models(cfg, [EvalJob(prepared.base, base_eval(out, s), s) for s in all_seeds], held_out(prepared))
        spec = spec_of(cfg, prepared.base, prepared.train)
        res = TTABench(provenance=provenance(), every=every, curves=[], notes=notes,
                       base_pass1=statistics.fmean(_pass1(base_eval(out, s)) for s in all_seeds),
                       base_se=_se(base_eval(out, all_seeds[0])),
                       workload={**asdict(spec), "task": cfg.task.name, "eta": cfg.replay.max_staleness,
                                 "actors": cfg.actors.num_actors, "objective": cfg.learner.loss.objective,
                                 "k": cfg.eval.k_max, "test_prompts": cfg.eval.max_prompts})
        if python is not None:
            (out / "peers").mkdir(exist_ok=True)
            prompts_file = write_inputs(cfg, prepared.base, prepared.train, out / "peers")[1]
        for i, seed in enumerate(seeds):
            for system in order(systems, i):
                log(f"seed {seed} ({i + 1}/{len(seeds)}): {system}")
                try:
                    c = run_trl(cfg, seed, every, out, prepared, python, prompts_file) if system == "trl" else \
                        run_dph(cfg, system, seed, every, out, prepared, timer)
                except RuntimeError as e:
                    if system != "trl":
                        raise
                    notes.append(f"TRL did not run: {e}")  # e.g. no reward for a user's data in its environment
                    log(notes[-1])
                    systems = [s for s in systems if s != "trl"]
                    continue
                curves[(system, seed)] = c
                res.curves = list(curves.values())
                write_output(summary, res.to_json())
                log(f"  {system}: {c.run_s:.1f} s for {c.steps[-1]} steps; held-out Pass@1 "
                    + " ".join(f"{p:.3f}" for p in c.pass1) + f" (load {os.getloadavg()[0]:.1f})")
    res.curves = list(curves.values())
    write_output(summary, res.to_json())
    return res
