"""Run a sweep: prepare the base model once, then every cell's RL run and its evaluations.

    <out>/config.yaml          the base config (a rerun with a different one is refused)
    <out>/sweep.json           the cells of the latest invocation
    <out>/base_model, data/, presample/, eval/base.json     shared by every cell
    <out>/eval/base_redraw.json   pi_0 on other samples (divergence and frontier sweeps: the per-band table)
    <out>/rl/<cell>/           the cell's RL run (pipeline.train_mode), eval/v<version>.json, cell.json

A cell is finished when its cell.json exists: a rerun skips it, so an interrupted sweep goes on
where it stopped and a grown grid (more seeds, another eta) runs only the new cells. A cell stopped
midway resumes from its newest checkpoint (its wall-clock curve then holds the pause; cell.json
says `resumed`).

Pass@k along a run: every cell checkpoints `eval_points` times; after its run one engine evaluates
the final model and each kept checkpoint's weights, loaded into it in turn.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from dph_async.config import ConfigError, RunConfig, dump_config, with_overrides
from dph_async.paths import RunPaths, checkpoint_dir, final_model, is_learner_checkpoint
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import Prepared, StageTimer, evaluate_models, prepare, train_mode, validate
from dph_async.progress import console
from dph_async.runtime.cluster import ray_cluster
from dph_async.runtime.evaluate import EvalJob
from dph_async.runtime.learner_process import start_learner
from dph_async.tools.ablate.cells import Cell, Sweep
from dph_async.tools.bench.machine import provenance


def eval_versions(steps: int, points: int) -> list[int]:
    """Learner versions evaluated along a run: `points` evenly spaced, the last one the final model."""
    every = -(-steps // points)
    return sorted({*range(every, steps, every), steps})


def cell_config(base: RunConfig, cell: Cell, eval_points: int) -> RunConfig:
    """The cell's config: the sweep's base config (before `validate`) with the cell's overrides."""
    cfg = with_overrides(base, list(cell.overrides))
    cfg.learner.checkpoint_every = -(-cfg.learner.steps // eval_points)
    cfg.learner.keep_versions = eval_versions(cfg.learner.steps, eval_points)  # exported after the run
    return validate(cfg, [RunSpec.parse(cell.mode)])


def run_cell(cfg: RunConfig, paths: RunPaths, prepared: Prepared, cell: Cell, eval_points: int,
             timer: StageTimer) -> None:
    """Train and evaluate one cell (resuming a stopped one); write its cell.json last."""
    rl_dir = paths.rl(cell.key)
    resumed = (checkpoint_dir(rl_dir) / "latest").is_file()
    start = time.time()
    train_mode(cfg, paths, prepared, RunSpec.parse(cell.mode), rl_dir, timer, name=cell.key)
    steps = cfg.learner.steps
    jobs = []
    for v in eval_versions(steps, eval_points):
        weights = final_model(rl_dir) if v == steps else checkpoint_dir(rl_dir) / f"v{v}"
        out = rl_dir / "eval" / f"v{v}.json"
        if v != steps and not out.is_file() and not is_learner_checkpoint(weights):
            raise FileNotFoundError(f"no checkpoint weights in {weights} (learner.checkpoint_every must divide {v})")
        jobs.append(EvalJob(weights, out, cfg.seed))
    evaluate_models(cfg, jobs, prepared.tests, arch=prepared.base)
    record = {**asdict(cell), "steps": steps, "resumed": resumed, "seconds": time.time() - start,
              "provenance": provenance()}
    (rl_dir / "cell.json").write_text(json.dumps(record, indent=2))


def run_sweep(cfg: RunConfig, sweep: Sweep, out: Path, eval_points: int, fresh: bool = False) -> list[str]:
    """Run the sweep's unfinished cells in `out` from the base config `cfg` (as loaded, not yet
    validated); return the keys of the cells run now. `fresh` (the caller has deleted the cells) also
    lets a different base config start over, shared base included."""
    specs = [RunSpec.parse(m) for m in sorted({c.mode for c in sweep.cells})]
    base = validate(cfg, specs)
    configs = {c.key: cell_config(cfg, c, eval_points) for c in sweep.cells}  # fail before any run
    paths = RunPaths(out)
    paths.root.mkdir(parents=True, exist_ok=True)
    text = dump_config(base)
    if paths.config.is_file() and paths.config.read_text() != text:
        if not fresh:
            raise ConfigError(f"{out} holds a sweep with another base config ({paths.config}); give another "
                              "--output, or --fresh to start over")
        for shared in (paths.base_model, paths.data, paths.presample, paths.eval):  # made from the old config
            shutil.rmtree(shared, ignore_errors=True)
    paths.config.write_text(text)
    (out / "sweep.json").write_text(json.dumps({"kind": sweep.kind, "x": sweep.x, "panel": sweep.panel,
                                                "cells": [asdict(c) for c in sweep.cells]}, indent=2))
    todo = [c for c in sweep.cells if not (paths.rl(c.key) / "cell.json").is_file()]
    console.print(f"{sweep.kind} sweep: {len(sweep.cells)} cells, {len(sweep.cells) - len(todo)} finished earlier, "
                  f"{len(todo)} to run in {out}")
    timer = StageTimer()
    with ray_cluster(base, prestart=bool(todo)):
        prepared = prepare(base, paths, timer, any(s.needs_presampling for s in specs))
        jobs = [EvalJob(prepared.base, paths.eval / "base.json", base.seed)]
        if sweep.kind in ("divergence", "frontier"):  # pi_0 again on fresh samples: the per-band table's unbiased row
            jobs.append(EvalJob(prepared.base, paths.eval / "base_redraw.json", base.seed + 1))
        if todo:
            start_learner(base)  # the first cell's learner imports beside pi_0's evaluation
        evaluate_models(base, jobs, prepared.tests)
        start = time.time()
        for i, cell in enumerate(todo):
            if i:
                eta = (time.time() - start) / i * (len(todo) - i)
                console.print(f"[bold]cell {i + 1}/{len(todo)}[/bold] {cell.key} (about {eta / 60:.0f} min left)")
            else:
                console.print(f"[bold]cell 1/{len(todo)}[/bold] {cell.key}")
            run_cell(configs[cell.key], paths, prepared, cell, eval_points, timer)
    return [c.key for c in todo]
