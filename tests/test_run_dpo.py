"""`dph-async run --preset dpo actors.sampler=mixp` as a user runs it, at the small size: online DPO
with the samplers paper's mixture sampler, whose actor samples with the policy and pi_0 in torch.

The run completes (training, its pairs, the evaluation of pi_0 and the trained model, the report);
every logged completion carries the mixture it was sampled from, 1.5 and 0.5 in turn, and each
token's behaviour log-prob is that of docs/losses.md's mixture of the learner's weights at the
token's version and pi_0 (float64 here), at the sampling temperature.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import SMALL, copy_base
from sampled_logprobs import model_at
from test_samplers import doc_distribution

from dph_async.paths import checkpoint_dir

pytestmark = pytest.mark.slow

STEPS = 3
TEMPERATURE = 0.7
# The actor's torch forward in fp32 against the same model's in float64.
TOL = 1e-4


def mixture_logprobs(models: dict, weight: float, prompt: list[int], tokens: list[int],
                     versions: list[int]) -> np.ndarray:
    """Each token's log-prob under pi_theta(version)^a pi_0^(1 - a) at TEMPERATURE (a torch engine
    recomputes the whole prefix every step: no KV cache kept across a load)."""
    out = np.zeros(len(tokens))
    for v in set(versions):
        logp = doc_distribution(models[v], models[0], weight, prompt + tokens, TEMPERATURE)[len(prompt) - 1: -1]
        at = [t for t, u in enumerate(versions) if u == v]
        out[at] = logp[at, [tokens[t] for t in at]].numpy()
    return out


def test_online_dpo_with_the_mixture_sampler_runs_end_to_end(small_base, tmp_path):
    from dph_async.replay.wal import IngestRecord, WriteAheadLog

    out = tmp_path / "out"
    copy_base(small_base, out)
    proc = subprocess.run([sys.executable, "-m", "dph_async.cli.main", "run", "--output", str(out), "--preset", "dpo",
                           *SMALL, "actors.sampler=mixp", f"learner.steps={STEPS}", "learner.checkpoint_every=1",
                           "learner.keep_checkpoints=0", f"sampling.temperature={TEMPERATURE}"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["modes"] == ["dpo"] and summary["rl"]["dpo"]["learner"]["steps"] == STEPS
    assert set(summary["eval"]) == {"base", "dpo"} and "| dpo |" in (out / "summary.md").read_text()
    rl_dir = out / "rl" / "dpo"
    metrics = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS and any("loss/dpo" in m for m in metrics)  # a step of ties has no pair
    # One pair per group with a reward spread: two of its completions trained, the others not.
    assert all(m["batch/fresh_samples"] == 2 * (m["batch/groups"] - m["batch/skipped_groups"]) for m in metrics)

    groups = [g for r in WriteAheadLog(rl_dir / "replay_wal").records() if isinstance(r, IngestRecord)
              for g in r.groups]
    assert groups and all([c.policy_weight for c in g.completions] == [1.5, 0.5, 1.5, 0.5] for g in groups)
    versions = {int(v) for g in groups for c in g.completions for v in c.versions}
    models = {v: model_at(out / "base_model", checkpoint_dir(rl_dir), v) for v in versions | {0}}
    worst = 0.0
    for g in groups:
        for c in g.completions:
            want = mixture_logprobs(models, c.policy_weight, [int(x) for x in g.prompt_ids],
                                    [int(x) for x in c.token_ids], [int(v) for v in c.versions])
            worst = max(worst, float(np.abs(want - c.logprobs).max()))
    assert max(versions) >= 2 and worst < TOL, (sorted(versions), worst)
