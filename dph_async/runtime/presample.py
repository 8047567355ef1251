"""Pre-sampling: split the training prompts by what the base policy pi_0 already does.

k samples per prompt from pi_0. A prompt solved by at least `presample.min_correct` of them (all k by
default: DPH-RL keeps prompts the base "always solves") joins D_pef; its correct samples become
reference samples, stored with their per-token pi_0 log-probs so no reference model has to be
loaded during RL. Every other prompt joins D_exp, the RL training set.

The pi_0 log-probs are recomputed with the learner's own model code and kernels at the training
sampling temperature, so at step 0 the learner's log-probs of a reference sample equal them exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from dph_async.actors.engine import VLLMEngine
from dph_async.actors.sampling import Sample, SamplingSpec
from dph_async.config import RunConfig
from dph_async.learner.batching import Sequence, pack
from dph_async.learner.logprobs import response_logprobs
from dph_async.progress import progress
from dph_async.rewards.result import RewardResult
from dph_async.rewards.scorer import Scorer, make_scorer
from dph_async.runtime.evaluate import build_engine
from dph_async.tasks.dataset import PromptRecord, load_prompts


@dataclass
class PresampleSummary:
    prompts: int
    samples_per_prompt: int
    d_pef_prompts: int
    d_exp_prompts: int
    reference_samples: int
    sample_accuracy: float
    seconds: float


def pi0_logprobs(model_dir: Path, prompts: list[np.ndarray], responses: list[np.ndarray], temperature: float,
                 dtype: str, token_budget: int = 8192) -> list[np.ndarray]:
    """Per-token log pi_0 of each response, in the order given."""
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32, use_safetensors=True).eval()
    seqs = [Sequence(p, r, np.zeros(len(r), np.float32)) for p, r in zip(prompts, responses, strict=True)]
    index = {id(s): i for i, s in enumerate(seqs)}
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(seqs)
    with torch.no_grad():
        for mb in pack([[s] for s in seqs], "reference", token_budget, pad_id=0):
            logp, _ = response_logprobs(model, mb, temperature)
            for row, s in enumerate(mb.sequences):
                out[index[id(s)]] = logp[row][mb.mask[row]].numpy().astype(np.float32)
    return out


def d_pef_prompts(outcomes: Iterable[tuple[str, bool]], need: int) -> set[str]:
    """The prompts with at least `need` correct samples among their (prompt id, correct) outcomes."""
    correct: dict[str, int] = {}
    for prompt_id, ok in outcomes:
        correct[prompt_id] = correct.get(prompt_id, 0) + ok
    return {pid for pid, c in correct.items() if c >= need}


def _verl_rows(records: list[PromptRecord], table: pa.Table, keep: set[str]) -> pa.Table:
    """The rows of the source table whose prompt id is in `keep` (same columns, unchanged)."""
    mask = [r.prompt_id in keep for r in records]
    return table.filter(pa.array(mask))


def _sample(engine: VLLMEngine, scorer: Scorer, records: list[PromptRecord], spec: SamplingSpec,
            description: str) -> list[tuple[PromptRecord, Sample, RewardResult]]:
    """spec.n scored samples of every prompt, in prompt order."""
    out = []
    with progress() as bar:
        task = bar.add_task(description, total=len(records))
        chunk = 64
        for i in range(0, len(records), chunk):
            batch = records[i:i + chunk]
            groups = engine.generate([r.prompt_ids for r in batch], spec)
            reqs = [r.score_request(s.text) for r, group in zip(batch, groups, strict=True) for s in group]
            results = iter(scorer.score_many(reqs))
            out += [(r, s, next(results)) for r, group in zip(batch, groups, strict=True) for s in group]
            bar.update(task, advance=len(batch))
    return out


def presample(cfg: RunConfig, model_dir: Path, train_path: Path, out_dir: Path,
              tokenizer: PreTrainedTokenizerBase | None = None, engine: VLLMEngine | None = None) -> PresampleSummary:
    """Write out_dir/{samples.parquet, reference_pool.parquet, d_exp.parquet, summary.json}, sampling
    with `engine` (one of `model_dir`'s weights) or, without one, an engine built here."""
    start = time.time()
    ps = cfg.presample
    engine = engine or build_engine(cfg, model_dir)
    tok = tokenizer or engine.tokenizer
    records = load_prompts(train_path, tok, cfg.model.max_model_len - cfg.sampling.max_tokens)
    spec = SamplingSpec(temperature=ps.temperature, top_p=ps.top_p, max_tokens=cfg.sampling.max_tokens, n=ps.k)
    with make_scorer(cfg.rewards) as scorer:
        samples = _sample(engine, scorer, records, spec, f"pre-sampling (k={ps.k})")
        pef = d_pef_prompts(((r.prompt_id, res.correct) for r, _, res in samples), ps.min_correct or ps.k)
        if ps.reference_rule == "all_correct":
            kept = [(r, s, res) for r, s, res in samples if r.prompt_id in pef and res.correct]
        else:  # one fresh pi_0 sample per D_pef prompt, kept if correct (the reference implementation)
            fresh = _sample(engine, scorer, [r for r in records if r.prompt_id in pef], replace(spec, n=1),
                            "reference samples (one per D_pef prompt)")
            kept = [(r, s, res) for r, s, res in fresh if res.correct]
    logps = pi0_logprobs(model_dir, [np.asarray(r.prompt_ids, np.int32) for r, _, _ in kept],
                         [np.asarray(s.token_ids, np.int32) for _, s, _ in kept], cfg.sampling.temperature,
                         cfg.model.dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([
        {"prompt_id": r.prompt_id, "data_source": r.data_source, "response": s.text,
         "response_ids": list(s.token_ids), "behaviour_logprobs": list(s.logprobs), "score": res.score,
         "correct": res.correct, "status": res.status}
        for r, s, res in samples]), out_dir / "samples.parquet")
    pq.write_table(pa.table({
        "sample_id": [f"{r.prompt_id}/{j}" for j, (r, _, _) in enumerate(kept)],
        "prompt_ids": pa.array([list(r.prompt_ids) for r, _, _ in kept], pa.list_(pa.int32())),
        "response_ids": pa.array([list(s.token_ids) for _, s, _ in kept], pa.list_(pa.int32())),
        "ref_logprobs": pa.array([lp.tolist() for lp in logps], pa.list_(pa.float32())),
        "reward": pa.array([res.score for _, _, res in kept], pa.float64()),
        "source": [f"d_pef:{r.prompt_id}" for r, _, _ in kept],
    }), out_dir / "reference_pool.parquet")
    exp = {r.prompt_id for r in records} - pef
    pq.write_table(_verl_rows(records, pq.read_table(train_path), exp), out_dir / "d_exp.parquet")
    summary = PresampleSummary(
        prompts=len(records), samples_per_prompt=ps.k, d_pef_prompts=len(pef), d_exp_prompts=len(exp),
        reference_samples=len(kept), sample_accuracy=sum(res.correct for *_, res in samples) / max(len(samples), 1),
        seconds=time.time() - start)
    (out_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary
