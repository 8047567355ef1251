"""The KL monitor: k1 and k3 with standard errors against exact KLs (a categorical, a two-step
autoregressive table, and a tiny Llama enumerated over every two-token response at the sampling
temperature), and the size of the bias of scoring at temperature 1 what was sampled at tau."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dph_async.learner.kl_monitor import KLMonitor, estimate, sample, sequence_terms

F64 = torch.float64


def _exact_kl(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p * (p.log() - q.log())).sum())


def test_k1_and_k3_match_the_exact_kl_of_a_categorical_with_honest_errors():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=F64), 0)
    q = torch.softmax(torch.randn(6, generator=g, dtype=F64), 0)
    n = 20000
    y = torch.multinomial(p, n, replacement=True, generator=g)
    k1, k3 = sequence_terms(p.log()[y][:, None], q.log()[y][:, None], torch.ones(n, 1))
    est = estimate(k1, k3)
    kl = _exact_kl(p, q)
    assert abs(est.k1 - kl) < 4 * est.k1_se and abs(est.k3 - kl) < 4 * est.k3_se
    # the standard error against the exact one, sqrt(Var_p[log p/q] / n)
    var = float((p * (p.log() - q.log()) ** 2).sum()) - kl**2
    assert est.k1_se == pytest.approx(math.sqrt(var / n), rel=0.05)
    assert (k3 >= 0).all() and est.sequences == n


def test_sums_over_tokens_estimate_the_kl_of_sequences():
    """Two steps, the second's distribution depending on the first: exact KL by enumeration."""
    g = torch.Generator().manual_seed(1)
    v = 4
    p1, q1 = (torch.softmax(torch.randn(v, generator=g, dtype=F64), 0) for _ in range(2))
    p2, q2 = (torch.softmax(torch.randn(v, v, generator=g, dtype=F64), 1) for _ in range(2))
    kl = sum(float(p1[a] * p2[a, b]) * math.log(float(p1[a] * p2[a, b] / (q1[a] * q2[a, b])))
             for a, b in itertools.product(range(v), repeat=2))
    n = 20000
    a = torch.multinomial(p1, n, replacement=True, generator=g)
    b = torch.multinomial(p2[a], 1, generator=g)[:, 0]
    logp = torch.stack([p1.log()[a], p2.log()[a, b]], 1)
    logq = torch.stack([q1.log()[a], q2.log()[a, b]], 1)
    est = estimate(*sequence_terms(logp, logq, torch.ones(n, 2)))
    assert abs(est.k1 - kl) < 4 * est.k1_se and abs(est.k3 - kl) < 4 * est.k3_se
    # a padded second token counts for nothing: one-step sequences estimate KL(p1 || q1)
    one = estimate(*sequence_terms(logp, logq, torch.tensor([[1.0, 0.0]]).expand(n, 2)))
    assert abs(one.k1 - _exact_kl(p1, q1)) < 4 * one.k1_se


def _tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=12, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _two_token_logprobs(model, prompt, tau) -> torch.Tensor:
    """[V, V] log pi(a, b | prompt) at temperature tau, by enumeration."""
    with torch.no_grad():
        ids = torch.as_tensor(prompt)[None]
        first = torch.log_softmax(model(input_ids=ids).logits[0, -1].double() / tau, -1)
        v = first.shape[0]
        seqs = torch.cat([ids.expand(v, -1), torch.arange(v)[:, None]], 1)
        second = torch.log_softmax(model(input_ids=seqs).logits[:, -1].double() / tau, -1)
    return first[:, None] + second


def test_monitor_on_a_tiny_llama_matches_the_enumerated_kl_at_the_sampling_temperature():
    model, base = _tiny(0), _tiny(1)
    with torch.no_grad():  # a base near the model, as after some training
        for pm, pb in zip(model.parameters(), base.parameters(), strict=True):
            pb.copy_(pm + 0.3 * (pb - pm))
    prompt = np.array([3, 5, 7], dtype=np.int64)
    tau = 0.7
    lp, lq = _two_token_logprobs(model, prompt, tau), _two_token_logprobs(base, prompt, tau)
    exact = float((lp.exp() * (lp - lq)).sum())
    monitor = KLMonitor(base, every=1, samples=3000, per_prompt=3000, temperature=tau, max_tokens=2,
                        eos_id=None, pad_id=0, seed=3)
    est = monitor.measure(model, [prompt], version=0)
    assert est.sequences == 3000
    assert abs(est.k1 - exact) < 4 * est.k1_se and abs(est.k3 - exact) < 4 * est.k3_se
    # Scoring at temperature 1 what was sampled at tau (the samplers paper's KL script) expects another number
    # (here 14% off, both exact).
    lp1, lq1 = _two_token_logprobs(model, prompt, 1.0), _two_token_logprobs(base, prompt, 1.0)
    mismatched = float((lp.exp() * (lp1 - lq1)).sum())
    assert abs(mismatched - exact) > 0.05 * exact


def test_sampling_stops_after_eos_and_is_seeded():
    model = _tiny(0)
    prompt = np.array([3, 5], dtype=np.int64)
    outs = sample(model, prompt, 64, 1.0, 6, eos_id=2, gen=torch.Generator().manual_seed(0))
    again = sample(model, prompt, 64, 1.0, 6, eos_id=2, gen=torch.Generator().manual_seed(0))
    assert all((a == b).all() for a, b in zip(outs, again, strict=True))
    for r in outs:
        assert 1 <= len(r) <= 6 and (2 not in r[:-1])
        assert len(r) == 6 or r[-1] == 2
    assert any(len(r) < 6 for r in outs)


def test_report_shows_the_last_kl_estimate_of_each_run():
    from dph_async.pipeline.report import kl_rows

    curves = {"a": [{"learner/version": 2.0, "kl/k1": 0.5, "kl/k1_se": 0.1, "kl/k3": 0.4, "kl/k3_se": 0.05,
                     "kl/sequences": 64.0},
                    {"learner/version": 4.0, "kl/k1": 0.7, "kl/k1_se": 0.1, "kl/k3": 0.6, "kl/k3_se": 0.05,
                     "kl/sequences": 64.0},
                    {"learner/version": 5.0}],
              "b": [{"learner/version": 1.0}]}
    assert kl_rows(curves) == [["a", "4", "0.7 ± 0.1", "0.6 ± 0.05", "64"]]


def test_with_several_prompts_the_error_is_over_the_prompts_means():
    k1 = torch.tensor([1.0, 3.0, 10.0, 10.0, 4.0], dtype=F64)
    prompt = torch.tensor([0, 0, 1, 1, 2])
    est = estimate(k1, k1, prompt)
    means = torch.tensor([2.0, 10.0, 4.0], dtype=F64)
    assert est.k1 == pytest.approx(float(means.mean())) and est.sequences == 5
    assert est.k1_se == pytest.approx(float(means.std()) / math.sqrt(3))
    one = estimate(k1, k1, torch.zeros(5, dtype=torch.long))  # one prompt: over its sequences
    assert one.k1_se == pytest.approx(float(k1.std()) / math.sqrt(5))
