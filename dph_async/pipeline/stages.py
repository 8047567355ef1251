"""`dph-async run`: warm start -> pre-sampling -> asynchronous DPH-RL -> evaluation -> report.

Every stage writes its results under the run directory and is skipped when they are already there,
so re-running the same command resumes a stopped run (RL continues from its newest checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import ray

from dph_async.config import ConfigError, RunConfig, dump_config
from dph_async.paths import RunPaths, checkpoint_dir, final_model, is_learner_checkpoint
from dph_async.pipeline.inputs import check_datasets, check_model_dir
from dph_async.pipeline.preflight import preflight
from dph_async.pipeline.report import write_report
from dph_async.pipeline.specs import RunSpec
from dph_async.progress import console
from dph_async.run_stats import RLResult, read_result, write_result
from dph_async.runtime.actor_process import evaluate_on_actor, presample_on_actor
from dph_async.runtime.cluster import ray_cluster
from dph_async.runtime.evaluate import EvalJob, evaluate_jobs
from dph_async.runtime.launcher import run_rl
from dph_async.runtime.learner_process import start_learner
from dph_async.runtime.placement import on_home_node
from dph_async.runtime.process_env import log_to_file
from dph_async.tasks.catalog import fits, make_splits
from dph_async.tasks.dataset import verl_row, write_rows

log = logging.getLogger(__name__)


@dataclass
class StageTimer:
    seconds: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, start: float) -> None:
        self.seconds[stage] = self.seconds.get(stage, 0.0) + time.time() - start


def validate(cfg: RunConfig, specs: list[RunSpec]) -> RunConfig:
    """Checks that need more than one key, and of the input files, done before any process starts."""
    s = cfg.sampling
    if s.top_p < 1 or s.top_k not in (-1, 0):
        raise ConfigError("sampling.top_p must be 1 and sampling.top_k -1 for training rollouts: the learner "
                          "computes log-probs over the full vocabulary, so a truncated sampling support would "
                          "bias the importance weights (see docs/decisions.md)")
    if s.n < 2:
        raise ConfigError("sampling.n must be >= 2: GRPO advantages compare completions of the same prompt")
    pg_share = cfg.learner.loss.reference_pg_share
    for spec in specs:
        objective = spec.objective_class()
        if objective.needs_pg_share and not pg_share:
            raise ConfigError(f"learner.loss.reference_pg_share: objective {spec.objective!r} trains its reference "
                              "samples only by that share's policy gradient; set it > 0 (e.g. 0.375, "
                              "docs/losses.md, As run)")
        if objective.whole_units and cfg.learner.critic.enabled:
            raise ConfigError(f"learner.critic.enabled: objective {spec.objective!r} trains on pairs, with no "
                              "per-token advantage for a critic to give")
    if cfg.mode == "sync":
        cfg = cfg.model_copy(deep=True)
        cfg.replay.max_staleness = 0
        cfg.learner.sync_every = 1
    elif cfg.replay.initial_staleness < cfg.learner.sync_every - 1:
        key = "staleness_min" if cfg.replay.auto_staleness else "max_staleness"
        raise ConfigError(f"replay.{key} ({cfg.replay.initial_staleness}) must be >= learner.sync_every - 1 "
                          f"({cfg.learner.sync_every - 1}): actors only get weights every sync_every steps")
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, "model.path")
    check_datasets({"task.data": cfg.task.data, **{f"task.test_data.{k}": v for k, v in cfg.task.test_data.items()}},
                   cfg.rewards)
    if (cfg.model.path is None) != (cfg.task.data is None):
        raise ConfigError("give both --model and --data for real work, or neither for the embedded default")
    if cfg.task.data is None and (why := fits(cfg.task.name, s.max_tokens, cfg.model.max_model_len)):
        raise ConfigError(why)
    preflight(cfg)  # the model against what the actors' engine, the learner and its kernels run
    return cfg


# Where no actor process that an RL run could take can do a stage's work (launcher.presample_on_actor,
# evaluate_on_actor), its engine runs in a fresh Ray worker process (max_calls=1): its memory goes
# when the stage ends.
@ray.remote(max_calls=1)
def _presample_task(cfg: RunConfig, model_dir: str, train: str, out_dir: str) -> dict:
    # heavy (torch, transformers, vLLM): in the Ray worker that runs the engine; the driver never loads them
    from dph_async.runtime.presample import presample

    log_to_file(Path(out_dir) / "presample.log")
    return asdict(presample(cfg, Path(model_dir), Path(train), Path(out_dir)))


@ray.remote(max_calls=1)
def _evaluate_task(cfg: RunConfig, engine_dir: str, jobs: list[EvalJob], test_sets: dict[str, str]) -> None:
    log_to_file(jobs[0].out.with_suffix(".log"))
    evaluate_jobs(cfg, Path(engine_dir), jobs, {k: Path(v) for k, v in test_sets.items()})


def prepare_embedded(cfg: RunConfig, paths: RunPaths, timer: StageTimer) -> dict[str, Path]:
    """Write the embedded task's (`task.name`) datasets and warm-start the tiny model into pi_0
    (skipped if done)."""
    splits = make_splits(cfg.task.name, cfg.seed, cfg.task.num_train, cfg.task.num_test, cfg.task.ood_warm_share)
    files = {}
    for name in ("train", "test", "ood_test"):
        rows = [verl_row(p.prompt, p.data_source, p.ground_truth, i, name) for i, p in enumerate(splits[name])]
        files[name] = write_rows(rows, paths.data / f"{name}.parquet")
    if not (paths.base_model / "config.json").is_file():
        # heavy (torch, transformers: about 3 CPU-s): only a pipeline that warm-starts its model loads
        # them in the driver; a validated config starts its Ray cluster without (tests/test_lazy_import.py)
        from dph_async.pipeline.warmstart import warm_start_tiny

        start = time.time()
        tmp = paths.root / "base_model.partial"
        losses = warm_start_tiny(cfg, splits["warmstart"], tmp)
        (tmp / "warmstart_loss.json").write_text(json.dumps(losses))
        tmp.rename(paths.base_model)
        timer.add("warm start", start)
    return files


@dataclass
class Prepared:
    """What every RL run of a pipeline starts from."""

    base: Path  # pi_0
    train: Path  # all training prompts
    tests: dict[str, Path]
    presample: dict | None  # pre-sampling summary, when a run needs it
    reference_pool: Path | None  # None when pre-sampling kept no sample
    exploration: Path | None  # D_exp

    def prompts_for(self, spec: RunSpec) -> Path:
        if not spec.trains_on_d_exp:
            return self.train
        if self.exploration is None or self.presample is None:
            raise ConfigError(f"{spec.name} trains on D_exp, but this pipeline did not pre-sample")
        if self.presample["d_exp_prompts"] == 0:
            raise ConfigError(f"{spec.name} trains on D_exp, but pi_0 solves every training prompt: D_exp is empty")
        return self.exploration

    def pool_for(self, spec: RunSpec) -> Path | None:
        if not spec.uses_pool:
            return None
        if self.reference_pool is None:
            raise ConfigError(f"{spec.name} trains a divergence on the reference pool, but pre-sampling kept no "
                              "reference sample (no prompt met the D_pef rule): lower presample.min_correct or "
                              "warm-start longer")
        return self.reference_pool


def prepare(cfg: RunConfig, paths: RunPaths, timer: StageTimer, need_presample: bool) -> Prepared:
    """Base model, datasets and (if needed) pre-sampling; skips what is already done. Inside ray_cluster."""
    if cfg.model.path is None:
        files = prepare_embedded(cfg, paths, timer)
        base, train = paths.base_model, files["train"]
        tests = {"in_domain": files["test"], "ood": files["ood_test"]}
    else:
        base, train = Path(cfg.model.path), Path(cfg.task.data)
        tests = {k: Path(v) for k, v in cfg.task.test_data.items()}
    if not need_presample:
        return Prepared(base, train, tests, None, None, None)
    if not (paths.presample / "summary.json").is_file():
        t = time.time()
        with console.status(f"pre-sampling: {cfg.presample.k} samples per training prompt from pi_0"):
            start_learner(cfg)  # its imports beside pre-sampling, for the RL run after
            # In the first RL run's actor process where it can (one engine build for both), else alone.
            if not presample_on_actor(cfg, base, train, paths.presample):
                ray.get(_presample_task.options(**on_home_node()).remote(cfg, str(base), str(train),
                                                                         str(paths.presample)))
        timer.add("pre-sampling", t)
    presample = json.loads((paths.presample / "summary.json").read_text())
    console.print(f"pre-sampling: pi_0 solves {presample['sample_accuracy']:.0%} of samples; D_pef "
                  f"{presample['d_pef_prompts']} prompts ({presample['reference_samples']} reference samples), "
                  f"D_exp {presample['d_exp_prompts']} prompts")
    pool = paths.reference_pool if presample["reference_samples"] else None
    return Prepared(base, train, tests, presample, pool, paths.exploration_data)


# What transformers writes into a saved config about where it was loaded from, not about the model.
_PROVENANCE = ("_name_or_path", "name_or_path", "is_local", "local_files_only")


def _architecture(model_dir: Path) -> str:
    """What an engine is built from besides the weights (config and tokenizer): models equal in it
    share one engine."""
    parts = {}
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        path = model_dir / name
        content = json.loads(path.read_text()) if path.is_file() else None
        parts[name] = {k: v for k, v in content.items() if k not in _PROVENANCE} if isinstance(content, dict) \
            else content
    return json.dumps(parts, sort_keys=True)


def evaluate_models(cfg: RunConfig, jobs: list[EvalJob], tests: dict[str, Path], arch: Path | None = None) -> None:
    """Evaluate the jobs whose results are not written yet: one engine for all models of one
    architecture, each loaded into it in turn; that of the process an RL run kept as its actor 0, or
    of a new one that the next run takes (launcher.evaluate_on_actor), else one in a fresh Ray worker
    process (its memory goes when the worker exits).
    `arch`: the model directory a checkpoint's weights belong to."""
    todo = [job for job in jobs if not job.out.is_file()] if tests else []
    groups: dict[str, tuple[Path, list[EvalJob]]] = {}
    for job in todo:
        model_dir = arch if is_learner_checkpoint(job.weights) else job.weights
        if model_dir is None:
            raise ValueError(f"{job.weights} is a learner checkpoint: give the model directory it belongs to")
        groups.setdefault(_architecture(model_dir), (model_dir, []))[1].append(job)
    for model_dir, group in groups.values():
        names = ", ".join(job.out.stem for job in group)
        with console.status(f"evaluating {names}: greedy and {cfg.eval.k_max} samples per test prompt"):
            # In the process actor 0 of an RL run keeps or will take (one engine build serves both).
            if not evaluate_on_actor(cfg, model_dir, group, tests):
                ray.get(_evaluate_task.options(**on_home_node()).remote(
                    cfg, str(model_dir), group, {k: str(v) for k, v in tests.items()}))


def run_pipeline(cfg: RunConfig, compare: list[str] | None = None) -> dict:
    """Run (or resume) everything; return the summary that is also written to summary.json.
    compare: run specs (OBJECTIVE[:COEFF][@PROMPTS]) trained from the same base, else the config's own run."""
    specs = [RunSpec.parse(c) for c in compare] if compare else [RunSpec.of(cfg)]
    if compare and cfg.learner.loss.coeff is not None:
        console.print("[yellow]learner.loss.coeff does not apply under --compare: each run takes its objective's "
                      "reference coefficient, or the one given as OBJECTIVE:COEFF")
    cfg = validate(cfg, specs)
    modes = [s.name for s in specs]
    paths = RunPaths(Path(cfg.output_dir))
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(dump_config(cfg))
    timer = StageTimer()
    start = time.time()
    results: dict[str, RLResult] = {}
    need_presample = any(s.needs_presampling for s in specs)
    evals = {"base": paths.eval / "base.json", **{s.name: paths.eval / f"{s.slug}.json" for s in specs}}
    # A finished run invoked again only reads what it wrote: no Ray, whose start would be most of it.
    done = [*evals.values(), *(paths.rl(s.slug) / "result.json" for s in specs)]
    if need_presample:
        done.append(paths.presample / "summary.json")
    with contextlib.nullcontext() if all(p.is_file() for p in done) else ray_cluster(cfg, prestart=True):
        prepared = prepare(cfg, paths, timer, need_presample)
        for spec in specs:
            results[spec.name] = train_mode(cfg, paths, prepared, spec, paths.rl(spec.slug), timer)
        t = time.time()
        models = {"base": prepared.base, **{s.name: final_model(paths.rl(s.slug)) for s in specs}}
        evaluate_models(cfg, [EvalJob(models[name], out, cfg.seed) for name, out in evals.items()], prepared.tests)
        timer.add("evaluation", t)
    summary = {
        "config": cfg.model_dump(mode="json"),
        "modes": modes,
        "runs": {spec.name: {"dir": spec.slug, "objective": spec.objective, "coeff": spec.effective_coeff,
                             "prompts": "d_exp" if spec.trains_on_d_exp else "all"} for spec in specs},
        "presample": prepared.presample,
        "rl": results,
        "stage_seconds": timer.seconds,
        "wall_seconds": time.time() - start,
    }
    write_report(paths, summary, {k: v for k, v in evals.items() if v.is_file()})
    return summary


def train_mode(cfg: RunConfig, paths: RunPaths, prepared: Prepared, spec: RunSpec, rl_dir: Path, timer: StageTimer,
               name: str | None = None) -> RLResult:
    """One RL run in rl_dir (resumed from its newest checkpoint if it was stopped; skipped if finished).
    Returns its record (result.json): learner, actor and replay statistics, restarts, wall time."""
    if (rl_dir / "result.json").is_file():
        return read_result(rl_dir)
    mcfg = spec.apply(cfg)
    name = name or spec.name
    latest = checkpoint_dir(rl_dir) / "latest"
    resume_tag = latest.read_text().strip() if latest.is_file() else None
    if resume_tag is None and rl_dir.exists():
        shutil.rmtree(rl_dir)  # a run stopped before its first checkpoint starts over
    t = time.time()
    with WandbStream(mcfg, paths, spec.slug) as wb:
        result = run_rl(mcfg, name, rl_dir, prepared.base, prepared.prompts_for(spec),
                        prepared.pool_for(spec), resume_tag=resume_tag, on_metrics=wb)
    timer.add(f"rl ({name})", t)
    write_result(result, rl_dir)
    return read_result(rl_dir)


class WandbStream:
    """An offline (unless configured) wandb run for one RL mode, fed as metrics stream in."""

    def __init__(self, cfg: RunConfig, paths: RunPaths, mode: str) -> None:
        self.cfg, self.paths, self.mode = cfg, paths, mode
        self.run = None

    def __enter__(self):
        lc = self.cfg.logging
        if lc.wandb_mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb  # heavy and optional: only a run that logs to wandb loads it

            name = f"{lc.run_name or self.paths.root.name}-{self.mode}"
            self.run = wandb.init(project=lc.wandb_project, name=name, id=name.replace("/", "-"), resume="allow",
                                  dir=str(self.paths.root), mode=lc.wandb_mode, config=self.cfg.model_dump(mode="json"))
        return self

    def __call__(self, metrics: dict[str, float]) -> None:
        if self.run is not None:
            self.run.log(metrics, step=int(metrics["learner/version"]))

    def __exit__(self, *exc: object) -> None:
        if self.run is not None:
            self.run.finish()
