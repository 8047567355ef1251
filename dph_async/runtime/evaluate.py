"""Evaluation: greedy accuracy, unbiased Pass@k for k = 1..k_max, and answer diversity, per test set.

Pass@k from n samples with c correct (Chen et al., 2021): 1 - C(n - c, k) / C(n, k), averaged over
prompts; unbiased for every k <= n. Diversity: distinct correct answers per prompt among the n.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from math import comb
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dph_async.actors.sampling import SamplingSpec
from dph_async.config import RunConfig
from dph_async.model_files import weight_files
from dph_async.paths import checkpoint_weights, is_learner_checkpoint
from dph_async.progress import progress
from dph_async.rewards.scorer import make_scorer
from dph_async.tasks.dataset import PromptRecord, load_prompts

if TYPE_CHECKING:  # torch and the engine load where a model is evaluated: a driver starts Ray without them
    import torch

    from dph_async.actors.engine import VLLMEngine


@dataclass(frozen=True)
class EvalJob:
    """One model to evaluate: its weights (a Hugging Face model directory, or a learner checkpoint
    `checkpoints/v<N>` of a model of `pipeline.evaluate_models`' `arch`), the file its results go to,
    and the seed of its samples."""

    weights: Path
    out: Path
    seed: int


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    return 1.0 - comb(n - c, k) / comb(n, k)


@dataclass
class PromptResult:
    """One test prompt: how many of the n samples were correct, how many distinct correct answers."""

    prompt_id: str
    correct: int
    distinct: int
    greedy: bool


@dataclass
class SplitResult:
    name: str
    prompts: int
    greedy_accuracy: float
    pass_at_k: dict[int, float]
    sample_accuracy: float
    distinct_correct: float  # mean number of distinct correct answers among the n samples
    seconds: float
    samples: int = 0  # n, samples per prompt
    per_prompt: list[PromptResult] = field(default_factory=list)


def _score(scorer, records: list[PromptRecord], texts: list[list[str]]) -> list[list[bool]]:
    reqs = [r.score_request(t) for r, ts in zip(records, texts, strict=True) for t in ts]
    flat = iter(res.correct for res in scorer.score_many(reqs))
    return [[next(flat) for _ in ts] for ts in texts]


def evaluate_split(engine: VLLMEngine, scorer, name: str, records: list[PromptRecord], cfg: RunConfig
                   ) -> SplitResult:
    start = time.time()
    ec, n = cfg.eval, cfg.eval.k_max
    prompts = [r.prompt_ids for r in records]
    greedy = engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=cfg.sampling.max_tokens,
                                                   logprobs=False))
    sampled = engine.generate(prompts, SamplingSpec(temperature=ec.temperature, top_p=ec.top_p,
                                                    max_tokens=cfg.sampling.max_tokens, n=n, logprobs=False))
    greedy_ok = _score(scorer, records, [[g[0].text] for g in greedy])
    texts = [[s.text for s in group] for group in sampled]
    ok = _score(scorer, records, texts)
    counts = [sum(o) for o in ok]
    distinct = [len({t for t, good in zip(ts, oks, strict=True) if good}) for ts, oks in zip(texts, ok, strict=True)]
    return SplitResult(
        name=name,
        prompts=len(records),
        greedy_accuracy=sum(g[0] for g in greedy_ok) / len(records),
        pass_at_k={k: sum(pass_at_k(n, c, k) for c in counts) / len(records) for k in range(1, n + 1)},
        sample_accuracy=sum(counts) / (n * len(records)),
        distinct_correct=sum(distinct) / len(records),
        seconds=time.time() - start,
        samples=n,
        per_prompt=[PromptResult(r.prompt_id, c, d, g[0]) for r, c, d, g in zip(records, counts, distinct, greedy_ok,
                                                                                strict=True)],
    )


def read_weights(source: Path) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a Hugging Face model directory (its safetensors files) or of a learner
    checkpoint: the names the engine's loaders take."""
    # heavy (torch, with safetensors' loader): a worker's, where an engine runs; the driver imports this
    # module for its results and jobs
    from safetensors.torch import load_file

    if is_learner_checkpoint(source):
        return list(checkpoint_weights(source).items())
    return [item for f in weight_files(source) for item in load_file(f).items()]


def build_engine(cfg: RunConfig, model_dir: Path) -> VLLMEngine:
    """An engine of `model_dir`'s weights for a stage the driver runs in a worker of its own
    (evaluation, pre-sampling), on the learner's threads."""
    # heavy (vLLM, about 8 CPU-s): only a process that runs the engine loads it, never the driver
    from dph_async.actors.engine import VLLMEngine

    return VLLMEngine(str(model_dir), dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
                      seed=cfg.seed, kv_cache_gib=cfg.actors.kv_cache_gib, threads=cfg.learner.threads,
                      share_prefill=cfg.actors.share_prefill)


def evaluate_jobs(cfg: RunConfig, engine_dir: Path, jobs: Sequence[EvalJob], test_sets: dict[str, Path],
                  engine: VLLMEngine | None = None) -> None:
    """Evaluate several models of one architecture with one engine holding `engine_dir`'s weights:
    `engine`, or one built here; each job's weights are loaded into it in place (about 11 CPU-seconds
    of imports and engine build saved per model after the first). Each job's sampling starts from its
    own seed and its prompts are cached under its own salt, so its results are those of a fresh
    engine holding its weights."""
    engine = engine or build_engine(cfg, engine_dir)
    held = engine_dir
    with make_scorer(cfg.rewards) as scorer:
        for job in jobs:
            if job.weights != held:
                engine.load_weights(read_weights(job.weights), engine.version + 1)
                held = job.weights
            write_results(evaluate_engine(engine, scorer, cfg, test_sets, job.seed, job.weights.name), job.out)


def evaluate_engine(engine: VLLMEngine, scorer, cfg: RunConfig, test_sets: dict[str, Path], seed: int,
                    label: str) -> dict[str, SplitResult]:
    """Evaluate the engine's current weights on every test set, sampling from `seed`."""
    # Unseeded requests sample from the process's generators: reseeded here, the samples depend on the
    # seed and the weights, not on what the engine generated before.
    import torch  # heavy (about 1.5 s): loaded already where an engine runs, never by the driver

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    results = {}
    with progress(transient=True) as bar:
        task = bar.add_task(f"eval {label}", total=len(test_sets))
        for name, path in test_sets.items():
            records = load_prompts(path, engine.tokenizer, cfg.model.max_model_len - cfg.sampling.max_tokens,
                                   limit=cfg.eval.max_prompts)
            results[name] = evaluate_split(engine, scorer, name, records, cfg)
            bar.update(task, advance=1)
    return results


def evaluate(cfg: RunConfig, model_dir: Path, test_sets: dict[str, Path], out_path: Path | None = None
             ) -> dict[str, SplitResult]:
    """Evaluate one model on every test set; optionally write the results as JSON."""
    engine = build_engine(cfg, model_dir)
    with make_scorer(cfg.rewards) as scorer:
        results = evaluate_engine(engine, scorer, cfg, test_sets, cfg.seed, model_dir.name)
    if out_path is not None:
        write_results(results, out_path)
    return results


def write_results(results: dict[str, SplitResult], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({k: asdict(v) for k, v in results.items()}, indent=2))


# Test prompts grouped by what pi_0 did on them (its n samples): like D_pef, like D_exp, or unsolved.
DIFFICULTY = {"always": "pi_0 always right", "mostly": "pi_0 right in at least half",
              "rarely": "pi_0 right in under half", "never": "pi_0 never right"}


def difficulty_of(correct: int, samples: int) -> str:
    """The band of a test prompt by pi_0's correct samples of `samples`: always (all: the D_pef rule),
    mostly (at least half), rarely (under half, at least one), never."""
    if correct == samples:
        return "always"
    if correct == 0:
        return "never"
    return "mostly" if 2 * correct >= samples else "rarely"


@dataclass
class SubsetResult:
    prompts: int
    pass_at_k: dict[int, float]
    distinct_correct: float


def by_base_difficulty(base: SplitResult, model: SplitResult) -> dict[str, SubsetResult]:
    """`model`'s Pass@k and distinct correct answers on the test prompts split by how often the base
    model pi_0 was right on them (`difficulty_of`). Both results must hold per-prompt records for the
    same prompts."""
    kind = {r.prompt_id: difficulty_of(r.correct, base.samples) for r in base.per_prompt}
    out = {}
    for name in DIFFICULTY:
        rows = [r for r in model.per_prompt if kind.get(r.prompt_id) == name]
        if rows:
            out[name] = SubsetResult(
                prompts=len(rows),
                pass_at_k={k: sum(pass_at_k(model.samples, r.correct, k) for r in rows) / len(rows)
                           for k in range(1, model.samples + 1)},
                distinct_correct=sum(r.distinct for r in rows) / len(rows),
            )
    return out


def load_results(path: Path) -> dict[str, SplitResult]:
    raw = json.loads(path.read_text())
    # JSON keys are strings: Pass@k's k comes back as an int.
    return {k: SplitResult(**{**v, "pass_at_k": {int(i): p for i, p in v["pass_at_k"].items()},
                              "per_prompt": [PromptResult(**r) for r in v.get("per_prompt", [])]})
            for k, v in raw.items()}
