"""Chaos: a real `dph-async run` in which one actor keeps sending poisoned groups.

Actor 0 follows every second group it sends with a poisoned copy (actors/faults.py): a token id of
2^31 - 1, a NaN reward, a version of 10^9, in turn. Before the replay validated them, the first
ended the run (an IndexError in the learner's embedding) and the second turned every weight NaN.
The run must complete, every poisoned copy be refused and counted by its reason, nothing of them
reach the learner, and the final weights be finite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL, copy_base
from safetensors.torch import load_file

from dph_async.actors.faults import ENV

pytestmark = pytest.mark.slow

STEPS = 8


def test_a_run_survives_a_peer_that_keeps_sending_poison(small_base, tmp_path: Path):
    out = tmp_path / "chaos"
    copy_base(small_base, out)
    cmd = [sys.executable, "-m", "dph_async.cli.main", "run", "--output", str(out), *SMALL,
           "actors.num_actors=2", f"learner.steps={STEPS}", "learner.loss.objective=grpo"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, ENV: "2"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    (rl_dir,) = [p.parent for p in (out / "rl").glob("*/result.json")]
    result = json.loads((rl_dir / "result.json").read_text())
    refused = result["replay"]["refused"]["by_kind"]
    for reason in ("invalid_token_id", "invalid_reward", "invalid_version"):
        assert refused.get(reason, 0) >= 1, refused
    poisoned = sum(refused.get(r, 0) for r in ("invalid_token_id", "invalid_reward", "invalid_version"))
    sent = result["actors"][0]["groups_sent"]
    assert poisoned == sent // 2, (poisoned, sent)  # each copy refused, none accepted
    assert result["replay"]["accepted"] == sum(a["groups_sent"] for a in result["actors"])

    metrics = [json.loads(x) for x in (rl_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == STEPS
    assert all(m["learner/screened_records"] == 0 and m["learner/skipped_updates"] == 0 for m in metrics)
    weights = load_file(str(next((rl_dir / "final_model").glob("*.safetensors"))))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
