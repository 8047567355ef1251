"""The Triton kernels under TRITON_INTERPRET=1 (on the CPU) against the float64 reference.

TRITON_INTERPRET must be set before triton is first imported, and other tests in this pytest process
may already have imported it; so the kernels run in one child process (this file run as a script),
which reads the cases' inputs from a file and writes back outputs and gradients. The comparisons
happen here. Tolerances as in test_kernels.py; the interpreter is 100-400x slower than torch, hence
the small shapes (V of 1-4k; N and V not multiples of the 64 x 128 tiles, H not of the 64 K-tile).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dph_async.kernels.reference import reference_with_grads, rel_error

pytestmark = pytest.mark.triton

# (name, n, h, v, block_v, dtype, temperature, with_entropy)
CASES = [
    ("v1001_entropy", 37, 16, 1_001, 256, torch.float32, 0.7, True),
    ("v4000_chunks", 70, 40, 4_000, 1_000, torch.float32, 1.0, False),
    ("v1024_exact_tiles", 64, 64, 1_024, 512, torch.float32, 1.2, True),
    ("bf16", 40, 32, 1_001, 384, torch.bfloat16, 1.0, True),
]
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # bf16: d logits are stored in bf16 too
LOGP_ATOL = 5e-5


def _inputs(n, h, v, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 3.0 / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) >= 0.25
    targets[~mask] = -100
    return {"hidden": hidden, "weight": weight, "targets": targets, "mask": mask,
            "g_lp": torch.randn(n, generator=g), "g_h": torch.randn(n, generator=g)}


def _peaked_inputs():
    """Target logits 60 above the rest, in the last partial tile: log p must round to 0 from below."""
    inputs = _inputs(20, 32, 1_001, torch.float32, seed=99)
    inputs["weight"] *= 0.01
    inputs["mask"][:] = True
    inputs["targets"] = torch.randint(896, 1_001, (20,), generator=torch.Generator().manual_seed(98))
    h = inputs["hidden"]
    inputs["weight"][inputs["targets"]] = h * (60.0 / h.pow(2).sum(1, keepdim=True))
    return inputs


def _run_child(cases: dict, tmp: Path) -> dict:
    torch.save(cases, tmp / "in.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, __file__, str(tmp / "in.pt"), str(tmp / "out.pt")],
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return torch.load(tmp / "out.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    cases = {}
    for i, (name, n, h, v, block_v, dtype, temperature, with_entropy) in enumerate(CASES):
        cases[name] = {**_inputs(n, h, v, dtype, seed=1000 + i), "temperature": temperature,
                       "with_entropy": with_entropy, "block_v": block_v}
    cases["peaked"] = {**_peaked_inputs(), "temperature": 0.5, "with_entropy": True, "block_v": 256}
    return cases, _run_child(cases, tmp_path_factory.mktemp("triton"))


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_triton_matches_float64_reference(results, name):
    cases, outputs = results
    case, out = cases[name], outputs[name]
    ref_logp, ref_entropy, ref_dh, ref_dw = reference_with_grads(
        case["hidden"], case["weight"], case["targets"], case["temperature"], case["mask"], case["g_lp"],
        case["g_h"] if case["with_entropy"] else None,
    )
    dtype = case["hidden"].dtype
    assert out["d_hidden"].dtype == dtype and out["d_weight"].dtype == dtype
    assert (out["logp"] <= 0).all()
    torch.testing.assert_close(out["logp"].double(), ref_logp, atol=LOGP_ATOL, rtol=0)
    if case["with_entropy"]:
        torch.testing.assert_close(out["entropy"].double(), ref_entropy, atol=LOGP_ATOL, rtol=0)
    assert rel_error(out["d_hidden"], ref_dh) < GRAD_RTOL[dtype]
    assert rel_error(out["d_weight"], ref_dw) < GRAD_RTOL[dtype]
    masked = ~case["mask"]
    assert masked.any() and (out["logp"][masked] == 0).all() and (out["d_hidden"][masked] == 0).all()


def test_triton_peaked_distribution_never_positive(results):
    cases, outputs = results
    case, out = cases["peaked"], outputs["peaked"]
    assert (out["logp"] <= 0).all() and (out["entropy"] >= 0).all()
    ref_logp, ref_entropy, _, _ = reference_with_grads(
        case["hidden"], case["weight"], case["targets"], case["temperature"], None, case["g_lp"], None
    )
    torch.testing.assert_close(out["logp"].double(), ref_logp, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(out["entropy"].double(), ref_entropy, atol=LOGP_ATOL, rtol=0)


def _child(path_in: str, path_out: str) -> None:
    """Runs every case through impl="triton" (under the interpreter) and saves outputs and gradients."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from dph_async.kernels import fused_logprobs

    outputs = {}
    for name, case in torch.load(path_in).items():
        hidden = case["hidden"].clone().requires_grad_()
        weight = case["weight"].clone().requires_grad_()
        logp, entropy = fused_logprobs(hidden, weight, case["targets"], case["temperature"], case["mask"],
                                       case["with_entropy"], impl="triton", block_v=case["block_v"])
        objective = (case["g_lp"] * logp).sum()
        if entropy is not None:
            objective = objective + (case["g_h"] * entropy).sum()
        d_hidden, d_weight = torch.autograd.grad(objective, (hidden, weight))
        outputs[name] = {"logp": logp.detach(), "entropy": None if entropy is None else entropy.detach(),
                         "d_hidden": d_hidden, "d_weight": d_weight}
    torch.save(outputs, path_out)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
