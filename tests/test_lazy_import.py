"""A driver validates a config and starts its Ray cluster without torch, matplotlib or vLLM (the loss
modules load at first use: dph_async/lazy_import.py), so that those imports are not on a fresh
invocation's path to its cluster; the objectives still compute their losses once used."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dph_async.lazy_import import lazy_module

ROOT = Path(__file__).resolve().parents[1]
DRIVER = """
import sys
from dph_async.pipeline.stages import validate
from dph_async.pipeline.specs import RunSpec
from dph_async.config import load_config
validate(load_config("default", []), [RunSpec.parse(m) for m in ("grpo@d_exp", "js_low_var", "reverse_kl:0.1", "dpo")])
print(sorted(m for m in ("torch", "matplotlib", "vllm", "transformers", "deepspeed") if m in sys.modules))
import torch
from dph_async.learner.objectives import make_objective
from dph_async.config import LossConfig
d = make_objective(LossConfig(objective="forward")).reference_divergence(torch.tensor([-1.0]), torch.tensor([-2.0]))
print("forward KL", round(float(d), 6), type(sys.modules["dph_async.learner.losses"]).__name__)
"""


def test_a_driver_validates_its_config_without_torch_and_the_losses_load_when_used():
    out = subprocess.run([sys.executable, "-c", DRIVER], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    first, second = out.stdout.strip().splitlines()
    assert first == "[]"
    # u = exp(-1 - (-2)) = e: u - log u - 1 = e - 2, computed by the loss module, loaded on that first use.
    assert second == f"forward KL {round(2.718281828459045 - 2, 6)} module"


def test_a_lazy_module_is_the_module_once_imported_and_unknown_names_fail():
    import json

    assert lazy_module("json") is json
    with pytest.raises(ImportError, match="no_such_module"):
        lazy_module("no_such_module_here")
