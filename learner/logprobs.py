"""Per-token log-probs of response tokens for a micro-batch, through the fused kernels.

The prompt rows run once, with a cache; each prompt's responses, packed back to back in one row,
then run against that cache with a mask that lets a response token see its prompt and the earlier
tokens of its own response, nothing else. For n completions of length T of a prompt of length Lp
the model sees Lp + n T tokens, not n (Lp + T), and no padding between responses. Gradients flow
back through the shared keys and values, so log-probs and gradients are those of the separate
sequences, up to float rounding. A micro-batch whose rows hold one response each (long responses)
takes a single pass over [prompt | response] with the model's own masking.
"""

from __future__ import annotations

import torch

from dph_async.kernels import fused_logprobs
from dph_async.learner import zero3
from dph_async.learner.batching import MicroBatch


def packed_attention_mask(prompt_lens: torch.Tensor, lp: int, segment: torch.Tensor, dtype: torch.dtype
                          ) -> torch.Tensor:
    """[P, 1, R, Lp + R] additive mask for the packed rows: a token attends to the real tokens of its
    prompt and to the tokens of its own response up to itself. Padding tokens attend to the prompt
    only (a row with nothing to attend to would give NaN); their outputs are never read."""
    p, r = segment.shape
    to_prompt = (torch.arange(lp)[None, :] < prompt_lens[:, None])[:, None, :].expand(p, r, lp)
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    causal = torch.ones(r, r, dtype=torch.bool).tril()
    allowed = torch.cat([to_prompt, same & causal], dim=2)[:, None]
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def response_hidden(body: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """[B, T, H]: the final hidden state that predicts each response token (the last prompt token's
    for the first). `body` is a Hugging Face decoder (`model.model`); positions are given explicitly,
    each response's starting where its prompt ends."""
    p, lp = mb.prompt_ids.shape
    b, t = mb.response_ids.shape
    steps = torch.arange(lp)
    prompt_mask = (steps[None] < mb.prompt_lens[:, None]).long()
    prompt_pos = steps.expand(p, lp)
    if not mb.shares_prompts:  # one response per row: a single pass over [prompt | response]
        ids = torch.cat([mb.prompt_ids, mb.response_ids], 1)
        attention = torch.cat([prompt_mask, mb.mask.long()], 1)
        positions = torch.cat([prompt_pos, mb.prompt_lens[:, None] + torch.arange(t)[None]], 1)
        hidden = body(input_ids=ids, attention_mask=attention, position_ids=positions,
                      use_cache=False).last_hidden_state
        last = hidden[torch.arange(b), mb.prompt_lens - 1]
        return torch.cat([last[:, None], hidden[:, lp:-1]], 1)
    out = body(input_ids=mb.prompt_ids, attention_mask=prompt_mask, position_ids=prompt_pos, use_cache=True)
    r = mb.packed_ids.shape[1]
    offset = torch.arange(r)[None] - mb.start[mb.segment.clamp(min=0)]
    packed_pos = mb.prompt_lens[:, None] + torch.where(mb.segment >= 0, offset, 0)
    mask = packed_attention_mask(mb.prompt_lens, lp, mb.segment, out.last_hidden_state.dtype)
    packed = body(input_ids=mb.packed_ids, attention_mask=mask, position_ids=packed_pos,
                  past_key_values=out.past_key_values).last_hidden_state
    # Column 0: each prompt's last hidden state (predicts a response's first token); then the packed row.
    full = torch.cat([out.last_hidden_state[torch.arange(p), mb.prompt_lens - 1][:, None], packed], 1)
    steps_t = torch.arange(t)[None]
    column = torch.where(steps_t == 0, 0, mb.start[:, None] + steps_t).clamp(max=r)
    return full[mb.row[:, None], column]


def response_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float, *, with_entropy: bool = False,
                      impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) at `temperature` for every response token of `mb` ([B, T], 0 where masked),
    and the entropy if asked. `model` is a Hugging Face causal LM (its `.model` body and `.lm_head`);
    the hidden states go to the kernel with the LM head's weight, so the [tokens, vocab] logits
    never exist. A model prepared for ZeRO-3 (`learner.zero3`) runs the kernel in its `FusedHead`,
    which gathers the partitioned weight for the kernel's forward and backward."""
    h = response_hidden(model.model, mb)
    weight = model.lm_head.weight
    head = getattr(model, zero3.HEAD, None)
    if head is not None:
        return head(h, mb.response_ids, mb.mask, weight=weight, temperature=temperature, with_entropy=with_entropy,
                    impl=impl)
    return fused_logprobs(h, weight, mb.response_ids, temperature, mask=mb.mask, with_entropy=with_entropy, impl=impl)
