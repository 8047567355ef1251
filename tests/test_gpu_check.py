"""scripts/gpu_check.sh, the GPU check, at tiny shapes on the CPU under Triton's interpreter.

The check is prepared here and run on a CUDA card when one is at hand (docs/benchmarks.md, GPU):
its whole path runs in the suite, and a planted error in the kernel makes it fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from dph_async.kernels.reference import naive_logprobs

pytestmark = pytest.mark.triton


def test_gpu_check_runs_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--tiny", "--seed", "7", "--json", str(out)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    parts = {c["part"] for c in report["checks"]}
    assert parts == {"kernel", "cost", "tiles", "losses"}
    assert all(c["ok"] for c in report["checks"]) and len(report["checks"]) >= 40
    assert {r["path"] for r in report["cost"]} == {"triton", "torch", "naive"}
    assert all(r["ms"] > 0 for r in report["cost"]) and report["seed"] == 7
    assert "checks pass" in proc.stdout.splitlines()[-1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_gpu_check_fails_a_kernel_that_is_off(monkeypatch):
    """A kernel whose log-probs are off by 1e-3 nats (and whose gradients follow) fails the check."""
    check = _module()

    def off_by_a_little(hidden, weight, targets, temperature, mask, with_entropy, impl):
        safe = torch.where(mask, targets, 0)
        hidden, weight = hidden.float(), weight.float()
        logp = naive_logprobs(hidden, weight, safe, temperature) - 1e-3
        logits = (hidden @ weight.T) / temperature
        entropy = -(logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1)
        return torch.where(mask, logp, 0.0), torch.where(mask, entropy, 0.0)

    monkeypatch.setattr(check, "fused_logprobs", off_by_a_little)
    report = check.Report(seed=0, device={})
    check.check_kernel(report, "cpu", True, torch.Generator().manual_seed(0))
    failed = {c.name for c in report.checks if not c.ok}
    cases = (("float32", 0.7), ("bfloat16", 1.3))
    assert failed == {f"{dtype} N=37 V=1001 T={t} logp max abs err" for dtype, t in cases}


def test_gpu_check_refuses_to_run_without_a_device_or_interpreter(monkeypatch, capsys):
    check = _module()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert check.main(["--tiny"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_gpu_check_runs_from_a_checkout_that_is_not_installed(tmp_path):
    """A card's machine has torch and triton but not the project: without the install's finder the
    script still maps the checkout's directories into `dph_async` (its --help imports everything)."""
    wrapper = tmp_path / "python"
    wrapper.write_text(f"""#!/bin/sh
[ "$1" = -c ] && exec {sys.executable} "$@"  # the script's check for pydantic and omegaconf
exec {sys.executable} -c '
import importlib.util, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")]
assert importlib.util.find_spec("dph_async.kernels") is None, "the mapping of the install is still visible"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
' "$@"
""")
    wrapper.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script runs from the checkout's root
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--help"], env={**env,
                          "PYTHON": str(wrapper)}, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage:" in proc.stdout
