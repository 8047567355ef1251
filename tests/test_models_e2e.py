"""A user's own model, end to end, for every common architecture: Qwen2, Mistral and Qwen3 at
tiny random sizes (tests/model_families.py: a byte-level BPE with a ChatML template, grouped-query
attention, tied and separate LM heads), on GSM8K-style ("#### 4") and boxed-answer ("\\boxed{4}")
rows scored by the math rewards, each as `dph-async run --model DIR --data train.parquet
task.test_data.dev=dev.parquet` runs it: pre-sampling, asynchronous RL with one vLLM actor taking
every new version in place, evaluation of pi_0 and the trained model, and `dph-async rerun` of the
learner bit for bit.

What each run proves about its architecture:
- the actor's engine takes the learner's weights in place (q/k/v and gate/up stacked, a tied head,
  q/k norms): every token the actor logged carries the behaviour log-prob of the learner's weights
  at the version stamped on it, and tokens of newer versions reached the learner;
- the learner's recording re-trains to the same metrics and weights (every checkpoint, the final
  model), so nothing in the learner depends on the family beyond its config.

Qwen2 is the user's case (tied head, GQA, ChatML, `openai/gsm8k`): the default preset (DPH-JS on the
pre-sampled reference pool) and `--compare grpo@d_exp` in one invocation; its rows also check the
math rewards against each recorded completion. Qwen3's run is the long one: 1,024-token completions
with weights changing mid-response, and every process's peak resident set bounded.

Llama is the embedded default's family: every other end-to-end test runs it through the same stages
(test_e2e.py, test_rerun_run.py), with the embedded character tokenizer; Mistral, whose classes in
vLLM and transformers are Llama's layers with a sliding window, runs them here with a user's BPE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, SMALL
from model_families import FAMILIES, build_user_model, chatml_bpe, math_rows
from test_run_command import LOGPROB_TOL

from dph_async.config import load_config
from dph_async.paths import RunPaths, checkpoint_dir, final_model
from dph_async.pipeline.stages import run_pipeline
from dph_async.rewards.registry import get_reward_fn, load_builtins
from dph_async.tasks.dataset import write_rows
from dph_async.tools.bench.cpu import ProcessTreeCPU

pytestmark = pytest.mark.slow

STEPS = 4
LONG = 1024  # sampling.max_tokens of the long run
# Every run: one actor, a checkpoint at every version (the log-prob check reads each; the rerun
# compares its weights with each), pre-sampling k = 4 with D_pef the prompts solved twice or more.
RUN = ["actors.num_actors=1", f"learner.steps={STEPS}", "learner.checkpoint_every=1", "learner.keep_checkpoints=0",
       "presample.k=4", "presample.min_correct=2"]
# Per family: the runs of its invocation (--compare) and what else it sets.
CASES = {
    "qwen2": (["js_low_var", "grpo@d_exp"], []),  # the default preset, and --compare grpo@d_exp
    "mistral": (["grpo@d_exp"], []),
    # eta 2: the actor keeps generating while the learner steps, so loads land mid-response.
    "qwen3": (["grpo@d_exp"], [f"sampling.max_tokens={LONG}", f"model.max_model_len={LONG + 64}",
                               "replay.max_staleness=2", "learner.groups_per_step=2", "presample.k=2",
                               "presample.min_correct=2", "eval.k_max=2", "eval.max_prompts=2"]),
}
# The peak resident set any one process of a run may reach (bytes): the long run measured the actor's
# engine at 1.8 GB (its KV cache is actors.kv_cache_gib = 1) and the learner at 0.8 GB; another KV
# cache's worth in the actor fails it.
PEAK_RSS_LIMIT = 3 << 30


@dataclass(frozen=True)
class FamilyRun:
    name: str
    root: Path
    model: Path
    specs: list[str]
    summary: dict
    peak_rss: dict[int, tuple[str, int]]  # pid -> (component, peak resident bytes), from /proc

    def rl(self, spec: str) -> Path:
        return RunPaths(self.root).rl(self.summary["runs"][spec]["dir"])


@pytest.fixture(scope="module")
def tokenizer():
    return chatml_bpe()


@pytest.fixture(scope="module")
def family_run(ray_session, tokenizer, tmp_path_factory):
    """The run of a family (made once, on first use): its model built and taught here, then the
    pipeline in this process's Ray cluster, as the `run` command calls it."""
    done: dict[str, FamilyRun] = {}

    def run(name: str) -> FamilyRun:
        if name in done:
            return done[name]
        specs, extra = CASES[name]
        long = any(x.startswith("sampling.max_tokens") for x in extra)
        root = tmp_path_factory.mktemp(name)
        train_rows = math_rows(6 if long else 16, 0, "train")
        train = write_rows(train_rows, root / "data" / "train.parquet")
        dev = write_rows(math_rows(8, 1, "dev"), root / "data" / "dev.parquet")
        model = build_user_model(FAMILIES[name], tokenizer, train_rows, root / "model",
                                 max_len=LONG + 128 if long else 128, end=not long)
        cfg = load_config("default", [*SMALL, *RUN, *extra, f"output_dir={root / 'run'}", f"model.path={model}",
                                      f"task.data={train}", f"task.test_data.dev={dev}"])
        with ProcessTreeCPU(interval=1.0) as sampler:
            summary = run_pipeline(cfg, specs)
        done[name] = FamilyRun(name, root / "run", model, specs, summary, dict(sampler.peaks))
        return done[name]

    return run


def wal_groups(rl_dir: Path) -> list:
    from dph_async.replay.wal import IngestRecord, WriteAheadLog

    return [g for r in WriteAheadLog(rl_dir / "replay_wal").records() if isinstance(r, IngestRecord)
            for g in r.groups]


def check_behaviour_logprobs(model_dir: Path, rl_dir: Path, temperature: float, only_mixed: bool = False) -> int:
    """Every logged token (or each token of the completions that span a load) against the learner's
    weights at its stamped version, over the KV cache earlier versions wrote; the check must be able
    to fail (version 0's weights read the later tokens far off). Returns how many tokens it checked."""
    from sampled_logprobs import model_at, sampled_logprobs

    groups = wal_groups(rl_dir)
    versions = {int(v) for g in groups for c in g.completions for v in c.versions}
    models = {v: model_at(model_dir, checkpoint_dir(rl_dir), v) for v in versions | {0}}
    worst, blind, checked = 0.0, 0.0, 0
    for g in groups:
        completions = [c for c in g.completions if len(c.token_ids)]
        firsts = {int(c.versions[0]) for c in completions}
        if len(firsts) > 1:  # a load between its completions' first steps: tests/test_inflight_logprobs.py
            continue
        (first,) = firsts
        for c in completions:
            stamped = [int(v) for v in c.versions]
            if only_mixed and len(set(stamped)) == 1:
                continue
            want = sampled_logprobs(models, g.prompt_ids, c.token_ids, stamped, first, temperature)
            worst = max(worst, float(np.abs(want - c.logprobs).max()))
            checked += len(stamped)
            if max(stamped) >= 2:
                at_0 = sampled_logprobs(models, g.prompt_ids, c.token_ids, [0] * len(stamped), 0, temperature)
                blind = max(blind, float(np.abs(at_0 - c.logprobs).max()))
    assert checked, f"{rl_dir}: no token to check"
    assert worst < LOGPROB_TOL, f"{rl_dir}: behaviour log-probs differ from those sampled by up to {worst:.2e}"
    assert blind > 10 * LOGPROB_TOL, f"{rl_dir}: versions 0 and 2+ differ by only {blind:.2e}: the check is blind"
    return checked


def rerun_is_bitwise(rl_dir: Path, out: Path, steps: int) -> None:
    proc = subprocess.run([sys.executable, "-m", "dph_async.cli.main", "rerun", str(rl_dir), "-o", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["bitwise"], report["verdict"]
    assert [s["version"] for s in report["steps"]] == list(range(1, steps + 1))
    assert [w["what"] for w in report["weights"]] == [*(f"checkpoint v{v}" for v in range(1, steps + 1)), "final model"]


@pytest.mark.parametrize("name", list(CASES))
def test_a_users_model_of_each_family_runs_end_to_end(family_run, name, tmp_path):
    run = family_run(name)
    config = json.loads((run.model / "config.json").read_text())
    assert config["model_type"] == FAMILIES[name].model_type
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    summary, steps = run.summary, run.summary["config"]["learner"]["steps"]
    pre = summary["presample"]
    assert pre["d_exp_prompts"] > 0 and pre["d_pef_prompts"] + pre["d_exp_prompts"] == pre["prompts"], pre
    assert set(summary["rl"]) == set(run.specs)
    for spec in run.specs:
        result, rl_dir = summary["rl"][spec], run.rl(spec)
        assert result.learner.steps == steps
        (actor,) = result.actors
        # Every version the learner published reached the actor, and tokens of newer weights were trained on.
        assert actor.weight_loads >= 1 and actor.weight_shm_loads == actor.weight_loads, actor
        consumed = [json.loads(x) for x in (rl_dir / "consumed.jsonl").read_text().splitlines()]
        assert [c["version"] for c in consumed] == list(range(steps))
        assert max(newest for c in consumed for *_, newest in c["groups"]) >= 1
        assert (final_model(rl_dir) / "config.json").is_file()
        check_behaviour_logprobs(run.model, rl_dir, summary["config"]["sampling"]["temperature"],
                                 only_mixed=name == "qwen3")
    evals = {k: json.loads((run.root / "eval" / f"{v}.json").read_text())
             for k, v in [("base", "base"), *((s, summary["runs"][s]["dir"]) for s in run.specs)]}
    for results in evals.values():
        assert set(results) == {"dev"}
        assert 0 <= results["dev"]["greedy_accuracy"] <= 1
    rerun_is_bitwise(run.rl(run.specs[0]), tmp_path / "rerun", steps)


def test_math_rewards_score_every_completion_of_a_real_run(family_run, tokenizer):
    """GSM8K's "#### n" and MATH's "\\boxed{n}" rows through the math rewards in the actor: each
    completion's recorded reward is the reward of its decoded text, and both formats were found right
    and wrong."""
    run = family_run("qwen2")
    load_builtins()
    rows = dict(enumerate(math_rows(16, 0, "train")))  # by extra_info.index, which D_exp keeps
    seen: dict[tuple[str, bool], int] = {}
    for spec in run.specs:
        for g in wal_groups(run.rl(spec)):
            row = rows[int(g.prompt_id.rsplit(":", 1)[1])]
            assert g.data_source == row["data_source"]
            reward = get_reward_fn(g.data_source)
            for c in g.completions:
                text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
                want = reward(text, row["reward_model"]["ground_truth"], row["extra_info"])
                assert (c.reward.score, c.reward.correct) == (want.score, want.correct), (text, c.reward, want)
                seen[g.data_source, bool(c.reward.correct)] = seen.get((g.data_source, bool(c.reward.correct)), 0) + 1
    assert set(seen) == {(s, ok) for s in ("openai/gsm8k", "math") for ok in (True, False)}, seen


def test_long_completions_bounded_memory_and_weights_changing_mid_response(family_run):
    """Completions of 1,024 tokens: most run to the limit, several span weight loads (their every token
    checked at its version in the family test), and no process's resident set grew past the limit."""
    run = family_run("qwen3")
    completions = [c for g in wal_groups(run.rl("grpo@d_exp")) for c in g.completions]
    full = [c for c in completions if c.finish_reason == "length"]
    assert full and all(len(c.token_ids) == LONG for c in full)
    assert sum(len(set(c.versions.tolist())) > 1 for c in completions) >= 1
    peaks = {pid: (component, peak) for pid, (component, peak) in run.peak_rss.items() if component != "ray"}
    assert {c for c, _ in peaks.values()} >= {"learner", "actors"}, peaks
    print({pid: f"{component} {peak / 2**20:.0f} MB" for pid, (component, peak) in peaks.items()})
    assert all(peak < PEAK_RSS_LIMIT for _, peak in peaks.values()), peaks
