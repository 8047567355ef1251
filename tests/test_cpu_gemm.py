"""The learner's oneDNN linear layers (learner/cpu_gemm.py) against float64, on fresh random inputs.

Tolerance: float32 products over at most 465 terms, within 2e-5 of the float64 result's largest
entry (relative); a trainer's gradients within 1e-4 of torch's own path (relative to the largest).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError
from test_learner import recording_gradients
from transformers import LlamaConfig, LlamaForCausalLM

from dph_async.config import LearnerConfig, LossConfig
from dph_async.kernels import onednn
from dph_async.learner import cpu_gemm
from dph_async.learner.cpu_gemm import OneDNNLinear
from dph_async.protocol import Batch, Completion, RolloutGroup, SamplingInfo
from dph_async.rewards.result import RewardResult


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.detach().double() - want).abs().max() / want.abs().max())


def counted_products(monkeypatch) -> list[tuple[int, ...]]:
    """Record the shapes of the products that run through oneDNN."""
    seen: list[tuple[int, ...]] = []
    product = cpu_gemm._product

    def counting(a, b, bias=None):
        seen.append((*a.shape, b.shape[0]))
        return product(a, b, bias)

    monkeypatch.setattr(cpu_gemm, "_product", counting)
    return seen


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_a_onednn_linear_gives_float64_outputs_and_gradients(monkeypatch, bias, layout):
    seed = int(np.random.default_rng().integers(1 << 31))
    g = torch.Generator().manual_seed(seed)
    layer = nn_linear(128, 336, bias, g)
    cpu_gemm.use_onednn(layer)
    x = torch.randn(5, 93, 128, generator=g)
    if layout == "transposed":  # a view whose rows are not contiguous, as attention's outputs are
        x = torch.randn(93, 5, 128, generator=g).transpose(0, 1)
    x.requires_grad_()
    dy = torch.randn(5, 93, 336, generator=g)
    w64, x64, dy64 = layer.weight.detach().double(), x.detach().double(), dy.double()
    products = counted_products(monkeypatch)

    y = layer(x)
    y.backward(dy)

    want_y = x64 @ w64.T + (layer.bias.detach().double() if bias else 0)
    assert rel_error(y, want_y) < 2e-5, seed
    assert rel_error(x.grad, dy64 @ w64) < 2e-5, seed
    assert rel_error(layer.weight.grad, dy64.reshape(-1, 336).T @ x64.reshape(-1, 128)) < 2e-5, seed
    if bias:
        assert rel_error(layer.bias.grad, dy64.sum((0, 1))) < 2e-5, seed
    # The forward and both backward products ran through oneDNN: y, dx and dW.
    assert products == [(465, 128, 336), (465, 336, 128), (336, 465, 128)]


def nn_linear(n_in: int, n_out: int, bias: bool, g: torch.Generator) -> torch.nn.Linear:
    layer = torch.nn.Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
        if bias:
            layer.bias.copy_(torch.randn(n_out, generator=g))
    return layer


def test_small_products_stay_with_torch(monkeypatch):
    """Below 2^21 multiply-adds (docs/decisions.md, measured by `bench gemm`) oneDNN's fixed cost
    outweighs its speed: F.linear runs them. The bound is written out here, not read from the module."""
    layer = torch.nn.Linear(128, 128, bias=False)
    cpu_gemm.use_onednn(layer)
    products = counted_products(monkeypatch)
    rows = (1 << 21) // (128 * 128)
    layer(torch.randn(rows - 1, 128)).sum().backward()
    assert products == []
    layer(torch.randn(rows, 128)).sum().backward()
    assert products == [(rows, 128, 128), (128, rows, 128)]  # y and dW: the input needs no gradient
    layer(torch.randn(rows, 128, requires_grad=True)).sum().backward()
    assert len(products) == 5


def test_auto_picks_onednn_for_a_float32_model_on_the_cpu_below_zero3():
    cpu = dict(device="cpu", dtype=torch.float32)
    assert cpu_gemm.resolve("auto", zero_stage=1, **cpu) == "onednn"
    assert cpu_gemm.resolve("auto", zero_stage=3, **cpu) == "torch"
    assert cpu_gemm.resolve("auto", zero_stage=0, device="cpu", dtype=torch.bfloat16) == "torch"
    assert cpu_gemm.resolve("auto", zero_stage=1, device="cuda", dtype=torch.float32) == "torch"
    assert cpu_gemm.resolve("torch", zero_stage=1, **cpu) == "torch"
    with pytest.raises(ValueError, match=r"learner\.cpu_gemm=onednn: the learner trains on cuda"):
        cpu_gemm.resolve("onednn", zero_stage=1, device="cuda", dtype=torch.float32)
    with pytest.raises(ValidationError, match="cpu_gemm"):
        LearnerConfig(zero_stage=3, cpu_gemm="onednn")


V = 24


def rollouts(rng: np.random.Generator, groups: int = 16, n: int = 8) -> Batch:
    """Groups large enough that every linear layer's products pass MIN_MACS."""
    out = []
    for seq in range(groups):
        prompt = rng.integers(3, V, size=8).astype(np.int32)
        comps = []
        for k in range(n):
            t = int(rng.integers(2, 9))
            r = float(k % 2)
            comps.append(Completion(rng.integers(3, V, size=t).astype(np.int32), -rng.random(t).astype(np.float32),
                                    np.zeros(t, np.int32), RewardResult(r, r > 0), "stop"))
        out.append(RolloutGroup(0, seq, f"p{seq}", "x", prompt, comps, SamplingInfo(1.0, 1.0, -1, 8), 0.0, 0.0))
    return Batch(0, out, [], {})


def first_gradients(model_dir: str, gemm: str, batch: Batch) -> tuple[list[torch.Tensor], object]:
    from dph_async.learner.trainer import Trainer

    cfg = LearnerConfig(zero_stage=0, cpu_gemm=gemm, loss=LossConfig(objective="js", coeff=0.1))
    t = Trainer(model_dir, cfg, temperature=1.0, dtype="float32", pad_id=0, max_response_tokens=8)
    seen = recording_gradients(t)
    t.train_step(batch)
    return seen[0], t


def test_a_trainer_on_onednn_takes_torchs_gradients(tmp_path, monkeypatch):
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))
    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=128, intermediate_size=336, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                 tie_word_embeddings=False)).save_pretrained(tmp_path)
    batch = rollouts(np.random.default_rng())
    want, plain = first_gradients(str(tmp_path), "torch", batch)
    products = counted_products(monkeypatch)
    head = []
    real = onednn.product
    monkeypatch.setattr(onednn, "product", lambda a, b: head.append(b.shape) or real(a, b))
    got, t = first_gradients(str(tmp_path), "auto", batch)

    assert t.cpu_gemm == "onednn" and plain.cpu_gemm == "torch"
    # The LM head's products in the log-prob kernel too (its weight [V, 128] in the forward).
    assert t.kernel == "onednn" and plain.kernel == "auto" and (V, 128) in head
    # The policy's and the frozen reference's linear layers (js scores fresh tokens against pi_0).
    for model in (t.module, t.reference_model):
        layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert layers and all(type(m) is OneDNNLinear for m in layers)
    assert products  # the model's products did run through oneDNN
    for a, b in zip(got, want, strict=True):
        assert rel_error(a, b.double()) < 1e-4
    t.close()
    plain.close()
