"""A tied LM head (Qwen2, Qwen3, Gemma: the input embeddings' weight) through the fused log-prob kernel,
against float64 on fresh random inputs.

There is no separate tied path in kernels/: the kernel takes the head's weight, and autograd adds its
gradient to the embedding lookup's. What must hold is that sum, in the kernel alone (the weight read
by the lookup and by the kernel) and in the learner's log-probs of a tied Hugging Face model (packed
prompts, the kernel given `lm_head.weight`), whose every parameter's gradient must be float64's.
"""

from __future__ import annotations

import pytest
import torch
from test_learner import random_units
from transformers import Qwen2Config, Qwen2ForCausalLM

from dph_async.kernels import fused_logprobs
from dph_async.kernels.reference import reference_logprobs, rel_error
from dph_async.learner.batching import pack
from dph_async.learner.logprobs import response_logprobs

LOGP_ATOL = 5e-5
GRAD_RTOL = 1e-4


def tied_objective(embed, mix, ids, targets, mask, g_lp, g_h, temperature, fused: bool):
    """sum(g_lp * log p + g_h * entropy) of a one-layer model whose head is its embedding."""
    hidden = torch.tanh(embed[ids] @ mix)
    if fused:
        logp, entropy = fused_logprobs(hidden, embed, targets, temperature, mask, with_entropy=True, impl="torch",
                                       block_v=256)
    else:
        logp, entropy = reference_logprobs(hidden, embed, targets, temperature, mask)
    return (g_lp.to(logp.dtype) * logp).sum() + (g_h.to(logp.dtype) * entropy).sum(), logp


@pytest.mark.parametrize(("n", "h", "v", "temperature", "seed"), [(37, 32, 1_001, 1.0, 0), (64, 48, 2_300, 0.7, 1)])
def test_fused_kernel_on_a_tied_head_matches_float64(n, h, v, temperature, seed):
    g = torch.Generator().manual_seed(seed)
    embed = (torch.randn(v, h, generator=g) * 3 / h**0.5).requires_grad_()
    mix = (torch.randn(h, h, generator=g) / h**0.5).requires_grad_()
    ids, targets = torch.randint(0, v, (n,), generator=g), torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) >= 0.2
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    got, logp = tied_objective(embed, mix, ids, targets, mask, g_lp, g_h, temperature, fused=True)
    d_embed, d_mix = torch.autograd.grad(got, (embed, mix))
    e64, m64 = embed.detach().double().requires_grad_(), mix.detach().double().requires_grad_()
    want, ref_logp = tied_objective(e64, m64, ids, targets, mask, g_lp, g_h, temperature, fused=False)
    ref_embed, ref_mix = torch.autograd.grad(want, (e64, m64))
    torch.testing.assert_close(logp.double(), ref_logp, atol=LOGP_ATOL, rtol=0)
    assert rel_error(d_embed, ref_embed) < GRAD_RTOL and rel_error(d_mix, ref_mix) < GRAD_RTOL
    # Both uses contribute: the lookup's rows alone, or the head's alone, are far from the sum.
    lookup_rows = torch.zeros(v, dtype=torch.bool)
    lookup_rows[ids[mask]] = True
    head_only = ref_embed.clone()
    head_only[lookup_rows] = 0
    assert rel_error(head_only, ref_embed) > 100 * GRAD_RTOL


def test_learner_logprobs_of_a_tied_model_match_float64():
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ref = Qwen2ForCausalLM(config).double().eval()
    ref.load_state_dict(model.state_dict())
    total, want = 0.0, 0.0
    for mb in pack(random_units(seed=3, groups=2, n=3), "fresh", token_budget=60, pad_id=0, share_prompts=True):
        logp, _ = response_logprobs(model, mb, temperature=0.7, impl="torch")
        total = total + (logp.sum(1) * mb.advantages).sum()
        for row, s in enumerate(mb.sequences):
            ids = torch.tensor([[*s.prompt_ids.tolist(), *s.response_ids.tolist()]])
            logits = ref(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1] / 0.7
            seq = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids):, None])[:, 0]
            torch.testing.assert_close(logp[row, : len(s.response_ids)].double(), seq.detach(), atol=LOGP_ATOL,
                                       rtol=0)
            want = want + seq.sum() * float(mb.advantages[row])
    total.backward()
    want.backward()
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel_error(p.grad, grads[name].grad) < 1e-3, name
