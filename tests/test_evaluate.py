"""Evaluation and pre-sampling figures against brute force: unbiased Pass@k by enumerating every
k-subset of the samples, distinct correct answers and greedy accuracy by counting, and the
D_pef / D_exp split by its rule, on made-up outcomes and on the real pre-sampling output.
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import SMALL, small_config
from transformers import AutoModelForCausalLM

from dph_async.actors.sampling import Sample, SamplingSpec
from dph_async.config import RunConfig
from dph_async.rewards.registry import get_reward_fn
from dph_async.rewards.worker import ScoreRequest, score_one
from dph_async.runtime.evaluate import evaluate_split, pass_at_k
from dph_async.runtime.presample import d_pef_prompts
from dph_async.tasks.dataset import PromptRecord
from dph_async.tasks.embedded import IN_DOMAIN


def brute_pass_at_k(correct: list[bool], k: int) -> Fraction:
    """The share of all k-subsets of the samples that hold a correct one."""
    subsets = list(itertools.combinations(correct, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


def test_pass_at_k_is_the_share_of_k_subsets_with_a_correct_sample():
    for n in range(1, 9):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(float(brute_pass_at_k(outcomes, k)), abs=1e-12)
    with pytest.raises(ValueError, match="at least 5 samples"):
        pass_at_k(4, 1, 5)


class ScriptedEngine:
    """Stands in for vLLM in this unit test: answers each prompt with fixed texts (greedy: n = 1)."""

    def __init__(self, greedy: list[str], sampled: list[list[str]]) -> None:
        self.greedy, self.sampled = greedy, sampled

    def generate(self, prompts, spec: SamplingSpec) -> list[list[Sample]]:
        texts = [[g] for g in self.greedy] if spec.temperature == 0 else self.sampled
        assert len(prompts) == len(texts) and all(len(t) == spec.n for t in texts)
        return [[Sample(key=f"{i}/{j}", text=t) for j, t in enumerate(ts)] for i, ts in enumerate(texts)]


class InProcessScorer:
    """The registered reward functions, called in this process (no worker pool needed here)."""

    def score_many(self, requests: list[ScoreRequest]):
        return [score_one(r) for r in requests]


def test_evaluate_split_against_counting():
    rng = random.Random(0)
    digits, n = "12345", 8
    records, greedy, sampled = [], [], []
    for i, target in enumerate((3, 5, 9, 15, 7)):
        truth = {"digits": digits, "target": target, "op": "+"}
        records.append(PromptRecord(f"t:{i}", IN_DOMAIN, f"{digits}+{target}=", (1, 2), truth))
        right = [a for a in ("1+2", "2+1", "4+1", "1+4", "2+3", "4+5", "5+4", "1+2+3+4+5", "3+4") if
                 sum(map(int, a.split("+"))) == target]
        pool = [*right, "1+1", "6+3", "9", "x"]  # repeated digit, foreign digit, one term, garbage
        sampled.append([rng.choice(pool) for _ in range(n)])
        greedy.append(rng.choice(pool))
    cfg = RunConfig()
    cfg.eval.k_max = n
    res = evaluate_split(ScriptedEngine(greedy, sampled), InProcessScorer(), "in_domain", records, cfg)

    fn = get_reward_fn(IN_DOMAIN)
    ok = [[fn(t, r.ground_truth, {}).correct for t in ts] for r, ts in zip(records, sampled, strict=True)]
    assert any(all(o) for o in ok) or any(any(o) and not all(o) for o in ok)  # the data is not degenerate
    for k in range(1, n + 1):
        want = sum(brute_pass_at_k(o, k) for o in ok) / len(records)
        assert res.pass_at_k[k] == pytest.approx(float(want), abs=1e-12), k
    distinct = [len({t for t, good in zip(ts, o, strict=True) if good}) for ts, o in zip(sampled, ok, strict=True)]
    assert res.distinct_correct == pytest.approx(sum(distinct) / len(records))
    assert res.sample_accuracy == pytest.approx(sum(map(sum, ok)) / (n * len(records)))
    greedy_ok = [fn(g, r.ground_truth, {}).correct for g, r in zip(greedy, records, strict=True)]
    assert res.greedy_accuracy == pytest.approx(sum(greedy_ok) / len(records))


def test_distinct_correct_counts_answers_not_samples():
    records = [PromptRecord("t:0", IN_DOMAIN, "12345+3=", (1,), {"digits": "12345", "target": 3, "op": "+"})]
    # Three samples of one right answer, one of its reordering, two wrong: 2 distinct correct answers.
    sampled = [["1+2", "1+2", "2+1", "1+2", "1+1", "3"]]
    cfg = RunConfig()
    cfg.eval.k_max = 6
    res = evaluate_split(ScriptedEngine(["1+2"], sampled), InProcessScorer(), "x", records, cfg)
    assert res.distinct_correct == 2 and res.greedy_accuracy == 1
    assert res.pass_at_k[3] == pytest.approx(1 - 0 / 20)  # C(2, 3) = 0: every 3-subset holds a right one
    assert res.pass_at_k[1] == pytest.approx(4 / 6)


def test_d_pef_rule_on_made_up_outcomes():
    rng = random.Random(1)
    outcomes = [(f"p{i}", rng.random() < q) for i, q in enumerate([0.0, 0.5, 0.9, 1.0, 1.0]) for _ in range(8)]
    counts = {p: sum(ok for q, ok in outcomes if q == p) for p, _ in outcomes}
    for need in range(1, 9):
        assert d_pef_prompts(outcomes, need) == {p for p, c in counts.items() if c >= need}
    assert d_pef_prompts(outcomes, 8) >= {"p3", "p4"} and "p0" not in d_pef_prompts(outcomes, 1)


@pytest.mark.slow
class AnsweringEngine:
    """Stands in for vLLM in this unit test: every sample of a prompt is its right answer, as token ids."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], tokenizer) -> None:
        self.answers, self.tokenizer = answers, tokenizer

    def generate(self, prompts, spec: SamplingSpec) -> list[list[Sample]]:
        out = []
        for i, p in enumerate(prompts):
            ids = self.answers[tuple(p)]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append([Sample(key=f"{i}/{j}", token_ids=list(ids), text=text) for j in range(spec.n)])
        return out


def test_reference_logprobs_are_pi0s_at_the_sampling_temperature(tmp_path):
    """The pi_0 log-probs pre-sampling stores with each reference sample are the learner's at the
    training rollouts' temperature (sampling.temperature, what its divergence terms use), not the
    pre-sampling's own: at step 0 every divergence is then zero."""
    from conftest import save_tiny_llama
    from test_run_command import learner_logprobs
    from transformers import AutoTokenizer

    from dph_async.learner.batching import Sequence
    from dph_async.runtime.presample import presample
    from dph_async.tasks.dataset import load_prompts, verl_row, write_rows
    from dph_async.tasks.embedded import make_splits

    model = save_tiny_llama(tmp_path / "pi0")
    tok = AutoTokenizer.from_pretrained(model)
    problems = make_splits(0, 6, 2)["train"]
    train = write_rows([verl_row(q.prompt, q.data_source, q.ground_truth, i, "train") for i, q in enumerate(problems)],
                       tmp_path / "train.parquet")
    cfg = small_config(tmp_path, "sampling.temperature=0.7", "presample.temperature=1.0", "presample.k=2")
    solution = {q.prompt: q.solutions()[0] for q in problems}
    answers = {r.prompt_ids: [*tok.encode(solution[r.text], add_special_tokens=False), tok.eos_token_id]
               for r in load_prompts(train, tok, 1000)}
    presample(cfg, model, train, tmp_path / "out", tok, AnsweringEngine(answers, tok))
    pool = pq.read_table(tmp_path / "out" / "reference_pool.parquet").to_pylist()
    assert len(pool) == 2 * len(problems)  # every answer right: every prompt in D_pef, both samples kept
    units = [[Sequence(np.asarray(r["prompt_ids"]), np.asarray(r["response_ids"]), np.asarray(r["ref_logprobs"]))]
             for r in pool]
    pi0 = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    for temperature, close in ((0.7, True), (1.0, False)):
        want = learner_logprobs(pi0, units, "reference", temperature)
        gap = max(float(np.abs(want[id(s)] - s.old_logprobs).max()) for u in units for s in u)
        assert (gap < 1e-5) == close, (temperature, gap)


def test_presampling_output_follows_the_split_rule(small_base):
    """The real pre-sampling of the shared small base: D_pef = prompts with at least min_correct of their
    k samples correct (by the reward itself, scored again here), their correct samples the reference
    pool; D_exp the rest."""
    out = small_base / "presample"
    summary = json.loads((out / "summary.json").read_text())
    samples = pq.read_table(out / "samples.parquet").to_pylist()
    rows = pq.read_table(small_base / "data" / "train.parquet").to_pylist()
    train = {f"train:{r['extra_info']['index']}": r for r in rows}
    k = summary["samples_per_prompt"]
    need = small_config(small_base).presample.min_correct or k
    by_prompt: dict[str, list[dict]] = {}
    for s in samples:
        truth = train[s["prompt_id"]]["reward_model"]["ground_truth"]
        assert s["correct"] == get_reward_fn(s["data_source"])(s["response"], truth, {}).correct
        by_prompt.setdefault(s["prompt_id"], []).append(s)
    assert set(by_prompt) == set(train) and all(len(v) == k for v in by_prompt.values())
    pef = {p for p, ss in by_prompt.items() if sum(s["correct"] for s in ss) >= need}
    assert 0 < len(pef) < len(train), "the small base should give both splits something"
    exp = {f"d_exp:{r['extra_info']['index']}" for r in pq.read_table(out / "d_exp.parquet").to_pylist()}
    assert {p.replace("d_exp:", "train:") for p in exp} == set(train) - pef
    pool = pq.read_table(out / "reference_pool.parquet").to_pylist()
    kept = sorted((s["prompt_id"], tuple(s["response_ids"])) for p in pef for s in by_prompt[p] if s["correct"])
    assert sorted((r["source"].removeprefix("d_pef:"), tuple(r["response_ids"])) for r in pool) == kept
    assert all(r["reward"] == 1.0 for r in pool)
    assert (summary["d_pef_prompts"], summary["d_exp_prompts"], summary["reference_samples"]) == (
        len(pef), len(exp), len(pool))


ONE_ENGINE = """
import json, sys
from pathlib import Path
from dph_async.actors.engine import SamplingSpec, VLLMEngine
from dph_async.runtime import evaluate
from dph_async.runtime.evaluate import evaluate_jobs
from dph_async.runtime.evaluate import EvalJob
from dph_async.config import load_config

root, base, other, overrides = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), json.loads(sys.argv[4])
cfg = load_config("default", overrides)
tests = {"in_domain": root / "data" / "test.parquet", "ood": root / "data" / "ood_test.parquet"}
out = Path(sys.argv[5])
generated = []  # the token ids of every generate() call, in order: 4 per job (greedy and sampled, 2 splits)
generate = VLLMEngine.generate
def recorded(self, prompts, spec):
    groups = generate(self, prompts, spec)
    generated.append([[s.token_ids for s in g] for g in groups])
    return groups
VLLMEngine.generate = recorded
engines = []
build = evaluate.build_engine
evaluate.build_engine = lambda *a: engines.append(build(*a)) or engines[-1]
# One engine built from the base evaluates the base, then the other model loaded in place...
evaluate_jobs(cfg, base, [EvalJob(base, out / "base.json", 3), EvalJob(other, out / "after.json", 5)], tests)
# ...and a fresh engine built from the other model evaluates it alone, then with another seed.
evaluate_jobs(cfg, other, [EvalJob(other, out / "fresh.json", 5), EvalJob(other, out / "seed6.json", 6)], tests)
(out / "generated.json").write_text(json.dumps(dict(zip(("base", "after", "fresh", "seed6"),
                                                        (generated[i:i + 4] for i in range(0, 16, 4))))))
# Evaluation asks for no log-probs: the same seeded draws as with them, the samples without.
draws = {lp: generate(engines[-1], [[1, 5, 6, 7], [1, 9]], SamplingSpec(n=4, max_tokens=8, seed=11, logprobs=lp))
         for lp in (True, False)}
(out / "logprobs.json").write_text(json.dumps({str(lp): [[(s.token_ids, s.logprobs) for s in g] for g in gs]
                                               for lp, gs in draws.items()}))
"""


@pytest.mark.slow
def test_a_model_evaluated_after_another_in_one_engine_gets_a_fresh_engines_results(small_base, tmp_path):
    """Evaluation loads each model of a stage into one engine: a model evaluated after another (the
    engine's generators used, its prefix cache filled) draws the samples a fresh engine built from it
    draws, token for token, and gets its results; another seed draws other samples. Asking for no
    log-probs (as evaluation does) draws the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = small_base / "base_model"
    other = tmp_path / "other"
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_pretrained(other)
    AutoTokenizer.from_pretrained(base).save_pretrained(other)
    out = tmp_path / "eval"
    subprocess.run([sys.executable, "-c", ONE_ENGINE, str(small_base), str(base), str(other), json.dumps(SMALL),
                    str(out)], check=True, timeout=600)

    tokens = json.loads((out / "generated.json").read_text())
    assert tokens["after"] == tokens["fresh"]
    assert tokens["base"] != tokens["after"], "the other model should answer differently from the base"
    assert tokens["seed6"][0] == tokens["fresh"][0], "greedy answers do not depend on the seed"
    assert tokens["seed6"][1] != tokens["fresh"][1], "another seed should draw other samples"
    draws = json.loads((out / "logprobs.json").read_text())
    with_lp, without = ([s for g in draws[k] for s in g] for k in ("True", "False"))
    assert [ids for ids, _ in with_lp] == [ids for ids, _ in without]
    assert all(len(lps) == len(ids) > 0 for ids, lps in with_lp) and all(lps == [] for _, lps in without)
    after, fresh = (json.loads((out / n).read_text()) for n in ("after.json", "fresh.json"))
    assert after.keys() == {"in_domain", "ood"}
    for split in (*after.values(), *fresh.values()):
        del split["seconds"]  # wall clock
    assert after == fresh
