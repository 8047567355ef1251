"""Per-token log-probs of response tokens for a micro-batch, through the fused kernels.

When the completions of a prompt share it (`MicroBatch.shares_prompts`), the prompt rows run once
and their keys and values are indexed out to every completion, which then runs only its own tokens:
for n completions of a prompt of length Lp and responses of length T, the model sees Lp + n T tokens
instead of n (Lp + T). Gradients flow back through the shared keys and values (the indexing sums
them), so log-probs and gradients are those of the separate sequences, up to float rounding.
"""

from __future__ import annotations

import torch

from kernels import fused_logprobs
from learner.batching import MicroBatch


def response_hidden(body: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """[B, T, H]: the final hidden state that predicts each response token (the last prompt token's
    for the first). `body` is a Hugging Face decoder (`model.model`). Prompts and responses are
    right-padded; padding is masked out of attention and positions are given explicitly."""
    p, lp = mb.prompt_ids.shape
    b, t = mb.response_ids.shape
    steps = torch.arange(lp)
    prompt_mask = (steps[None] < mb.prompt_lens[:, None]).long()
    response_pos = mb.prompt_lens[mb.row][:, None] + torch.arange(t)[None]
    if mb.shares_prompts:
        out = body(input_ids=mb.prompt_ids, attention_mask=prompt_mask, position_ids=steps.expand(p, lp),
                   use_cache=True)
        cache = out.past_key_values
        cache.batch_select_indices(mb.row)
        attention = torch.cat([prompt_mask[mb.row], mb.mask.long()], 1)
        responses = body(input_ids=mb.response_ids, attention_mask=attention, position_ids=response_pos,
                         past_key_values=cache).last_hidden_state
        last = out.last_hidden_state[mb.row, mb.prompt_lens[mb.row] - 1]
    else:  # one response per prompt row: a single pass over [prompt | response]
        ids = torch.cat([mb.prompt_ids, mb.response_ids], 1)
        attention = torch.cat([prompt_mask, mb.mask.long()], 1)
        positions = torch.cat([steps.expand(p, lp), response_pos], 1)
        hidden = body(input_ids=ids, attention_mask=attention, position_ids=positions,
                      use_cache=False).last_hidden_state
        last, responses = hidden[torch.arange(b), mb.prompt_lens - 1], hidden[:, lp:]
    return torch.cat([last[:, None], responses[:, :-1]], 1)


def response_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float, *, with_entropy: bool = False,
                      impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) at `temperature` for every response token of `mb` ([B, T], 0 where masked),
    and the entropy if asked. `model` is a Hugging Face causal LM (its `.model` body and `.lm_head`);
    the hidden states go to the kernel with the LM head's weight, so the [tokens, vocab] logits
    never exist."""
    h = response_hidden(model.model, mb)
    return fused_logprobs(h, model.lm_head.weight, mb.response_ids, temperature, mask=mb.mask,
                          with_entropy=with_entropy, impl=impl)
