"""Fused log-prob kernels (torch path) against the float64 reference, on fresh random inputs.

Tolerances: fp32 log-probs and entropies within 5e-5 absolute of float64 (logits of size ~10,
fp32 accumulation over H <= 64 and online log-sum-exp over up to 151,936 columns); gradients
within 1e-4 of the reference's largest entry (relative). bf16 inputs: the same numbers are exact in
fp32, so log-probs keep the fp32 tolerance; gradients come back rounded to bf16 (2^-8 relative).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from dph_async.kernels import default_block_v, fused_logprobs, onednn
from dph_async.kernels.fused import CPU_BLOCK_BUDGET
from dph_async.kernels.reference import reference_with_grads, rel_error

LOGP_ATOL = 5e-5
GRAD_RTOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def make_inputs(n, h, v, dtype=torch.float32, seed=0, scale=3.0, masked=0.25):
    """Random hidden states and LM head with logits of spread ~scale; a random ignore mask."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * scale / h**0.5).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) >= masked
    targets[~mask] = -100  # ignored positions may carry ids outside the vocabulary
    grads = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return hidden, weight, targets, mask, grads


def check_against_reference(impl, n, h, v, block_v, dtype, temperature, with_entropy, seed):
    hidden, weight, targets, mask, (g_lp, g_h) = make_inputs(n, h, v, dtype, seed)
    logp, entropy = fused_logprobs(hidden, weight, targets, temperature, mask, with_entropy, impl, block_v)
    objective = (g_lp * logp).sum() + ((g_h * entropy).sum() if with_entropy else 0.0)
    d_hidden, d_weight = torch.autograd.grad(objective, (hidden, weight))
    ref_logp, ref_entropy, ref_dh, ref_dw = reference_with_grads(
        hidden, weight, targets, temperature, mask, g_lp, g_h if with_entropy else None
    )
    assert logp.dtype == torch.float32 and d_hidden.dtype == dtype and d_weight.dtype == dtype
    assert (logp <= 0).all()
    torch.testing.assert_close(logp.double(), ref_logp, atol=LOGP_ATOL, rtol=0)
    if with_entropy:
        torch.testing.assert_close(entropy.double(), ref_entropy, atol=LOGP_ATOL, rtol=0)
    else:
        assert entropy is None
    assert rel_error(d_hidden, ref_dh) < GRAD_RTOL[dtype]
    assert rel_error(d_weight, ref_dw) < GRAD_RTOL[dtype]
    assert (logp[~mask] == 0).all() and (d_hidden[~mask] == 0).all()


@pytest.mark.parametrize(
    ("n", "h", "v", "block_v", "dtype", "temperature", "with_entropy"),
    [
        (33, 16, 1_001, 256, torch.float32, 1.0, True),  # V = 3 blocks + 233
        (48, 32, 1_001, None, torch.float32, 0.6, False),  # one block of all of V
        (24, 24, 50_257, 4_096, torch.float32, 1.3, True),  # GPT-2 vocabulary, 12 blocks + 1,105
        (40, 64, 2_048, 512, torch.bfloat16, 1.0, True),  # V a multiple of the block
        (29, 40, 1_001, 300, torch.bfloat16, 0.8, False),  # block not a multiple of 256
        (12, 8, 151_936, 8_192, torch.float32, 1.0, True),  # Qwen vocabulary, 18 blocks + 4,480
    ],
)
def test_torch_path_matches_float64_reference(n, h, v, block_v, dtype, temperature, with_entropy):
    check_against_reference("torch", n, h, v, block_v, dtype, temperature, with_entropy, seed=n * v)


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN")
@pytest.mark.parametrize(
    ("n", "h", "v", "block_v", "dtype", "temperature", "with_entropy"),
    [
        (33, 16, 1_001, 256, torch.float32, 1.0, True),
        (48, 32, 1_001, None, torch.float32, 0.6, False),
        (24, 24, 50_257, 4_096, torch.float32, 1.3, True),
        (40, 64, 2_048, 512, torch.bfloat16, 1.0, True),  # bf16 inputs: the products still in fp32
    ],
)
def test_onednn_products_match_float64_reference(n, h, v, block_v, dtype, temperature, with_entropy):
    check_against_reference("onednn", n, h, v, block_v, dtype, temperature, with_entropy, seed=n * v + 1)


def test_onednn_path_takes_oneDNNs_products(monkeypatch):
    """impl="onednn" runs the block products through oneDNN (forward and both gradients), "torch" not."""
    calls = []
    real = onednn.product
    monkeypatch.setattr(onednn, "product", lambda a, b: calls.append(1) or real(a, b))
    hidden, weight, targets, mask, (g_lp, _) = make_inputs(20, 16, 600, seed=3)
    for impl, expected in (("torch", 0), ("onednn", 3 * 3 + 3)):  # 3 blocks: 1 forward, 3 backward each
        calls.clear()
        logp, _ = fused_logprobs(hidden, weight, targets, mask=mask, impl=impl, block_v=256)
        (g_lp * logp).sum().backward()
        assert len(calls) == expected, impl
    with pytest.raises(ValueError, match="onednn"):
        fused_logprobs(hidden.to("meta"), weight.to("meta"), targets, mask=mask, impl="onednn")


def test_leading_dims_and_single_input_grads():
    """[B, T, H] inputs keep their shape; a frozen weight (or hidden) gets no gradient computed."""
    hidden, weight, targets, mask, (g_lp, _) = make_inputs(30, 16, 500, seed=1)
    _, _, ref_dh, ref_dw = reference_with_grads(hidden, weight, targets, 1.0, mask, g_lp, None)
    logp, _ = fused_logprobs(hidden.view(5, 6, 16), weight.detach(), targets.view(5, 6), mask=mask.view(5, 6))
    assert logp.shape == (5, 6)
    (d_hidden,) = torch.autograd.grad((g_lp.view(5, 6) * logp).sum(), hidden)
    assert rel_error(d_hidden, ref_dh) < 1e-4
    logp, _ = fused_logprobs(hidden.detach(), weight, targets, mask=mask)
    (d_weight,) = torch.autograd.grad((g_lp * logp).sum(), weight)
    assert rel_error(d_weight, ref_dw) < 1e-4


def test_entropy_only_objective():
    """An entropy bonus alone (log-probs unused) still back-propagates."""
    hidden, weight, targets, mask, (_, g_h) = make_inputs(20, 16, 700, seed=2)
    _, entropy = fused_logprobs(hidden, weight, targets, 0.9, mask, with_entropy=True, block_v=256)
    d_hidden, d_weight = torch.autograd.grad((g_h * entropy).sum(), (hidden, weight))
    h64 = hidden.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    logp_all = torch.log_softmax(h64 @ w64.T / 0.9, dim=-1)
    ref_entropy = torch.where(mask, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    ref_dh, ref_dw = torch.autograd.grad((g_h.double() * ref_entropy).sum(), (h64, w64))
    assert rel_error(d_hidden, ref_dh) < 1e-4 and rel_error(d_weight, ref_dw) < 1e-4


def test_all_masked_gives_zeros():
    hidden, weight, targets, _, _ = make_inputs(8, 16, 300, seed=3)
    mask = torch.zeros(8, dtype=torch.bool)
    logp, entropy = fused_logprobs(hidden, weight, targets, mask=mask, with_entropy=True)
    assert (logp == 0).all() and (entropy == 0).all()
    d_hidden, d_weight = torch.autograd.grad(logp.sum() + entropy.sum(), (hidden, weight), allow_unused=True)
    assert d_hidden is None or (d_hidden == 0).all()
    assert d_weight is None or (d_weight == 0).all()


@pytest.mark.parametrize("temperature", [0.3, 1.0])
def test_peaked_distribution_never_positive(temperature):
    """One logit ~60 above the rest (and ties at the max): log p rounds to 0 from below, never above.

    The peak sits in a late, partial block, so the online max changes after the first blocks.
    """
    n, h, v = 16, 32, 1_001
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(v, h, generator=g) * 0.01
    targets = torch.randint(900, v, (n,), generator=g)
    hidden = torch.randn(n, h, generator=g)
    weight[targets] = hidden * (60.0 / hidden.pow(2).sum(1, keepdim=True))  # logit of the target = 60
    weight[5] = weight[targets[0]]  # a tie at the max for row 0, in the first block
    hidden.requires_grad_()
    logp, entropy = fused_logprobs(hidden, weight, targets, temperature, with_entropy=True, block_v=256)
    assert (logp <= 0).all() and (entropy >= 0).all()
    ref_logp, ref_entropy, _, _ = reference_with_grads(
        hidden, weight, targets, temperature, None, torch.ones(n), None
    )
    torch.testing.assert_close(logp.double(), ref_logp, atol=LOGP_ATOL, rtol=0)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=LOGP_ATOL, rtol=0)


def test_bad_inputs_are_named():
    hidden, weight, targets, mask, _ = make_inputs(8, 16, 300, seed=5)
    with pytest.raises(ValueError, match="targets must lie"):
        fused_logprobs(hidden, weight, targets)  # -100 at positions no mask hides
    with pytest.raises(ValueError, match="temperature"):
        fused_logprobs(hidden, weight, targets, 0.0, mask)
    with pytest.raises(ValueError, match="float32 or both bfloat16"):
        fused_logprobs(hidden.double(), weight.double(), targets, mask=mask)
    with pytest.raises(ValueError, match="impl"):
        fused_logprobs(hidden, weight, targets, mask=mask, impl="cuda")


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    hidden, weight, targets, mask, _ = make_inputs(8, 16, 300, seed=6)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fused_logprobs(hidden, weight, targets, mask=mask, impl="triton")


def test_default_block_v():
    assert default_block_v(4_096, 151_936) == 8_192  # a 128 MiB fp32 block
    assert default_block_v(1_024, 32_768, CPU_BLOCK_BUDGET) == 2_048  # 8 MiB on the CPU
    assert default_block_v(16, 151_936) == 151_936  # small N: all of V at once
    assert default_block_v(1 << 20, 151_936) == 256  # huge N: the floor
    assert default_block_v(4_096, 1_001) == 1_001


def test_transformers_does_not_take_ours_for_hf_kernels(tmp_path):
    """Our kernels install as `dph_async.kernels`: the top-level name `kernels`, Hugging Face's, is not
    the project's, so transformers neither reports Hugging Face kernels as available nor imports ours
    while probing for it (run outside the checkout, as an installed project is)."""
    code = (
        "import importlib.metadata, importlib.util, sys, transformers\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "assert not is_kernels_available()\n"
        "assert 'kernels' not in sys.modules, 'transformers imported a kernels package'\n"
        "assert importlib.util.find_spec('kernels') is None, importlib.util.find_spec('kernels')\n"
        "assert 'dph-async' not in importlib.metadata.packages_distributions().get('kernels', [])\n"
        "import dph_async.kernels.fused\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_bench_kernels_command_smoke(tmp_path):
    """`dph-async bench kernels` at a tiny shape: both paths run, agree, and the JSON has the ratios."""
    from dph_async.cli.main import main

    out = tmp_path / "kernels.json"
    shape = ["--n", "64", "--hidden", "32", "--vocab", "3001"]
    assert main(["bench", "kernels", *shape, "--rounds", "1", "--iters", "1", "--output", str(out)]) == 0
    cpu = json.loads(out.read_text())["cpu"]
    assert cpu["time_ratio"] > 0 and cpu["memory_ratio"] > 0
    assert cpu["max_abs_diff_logp"] < 1e-4 and cpu["max_rel_diff_d_hidden"] < 1e-4
