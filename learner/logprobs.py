"""Per-token log-probs of response tokens for a padded micro-batch, through the fused kernels."""

from __future__ import annotations

import torch

from kernels import fused_logprobs
from learner.batching import MicroBatch


def response_logprobs(model: torch.nn.Module, mb: MicroBatch, temperature: float, *, with_entropy: bool = False,
                      impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(y_t | x, y_<t) at `temperature` for every response token of `mb` ([B, T], 0 where masked).

    The model's last hidden states go to the kernel with the LM head's weight, so the [tokens, vocab]
    logits never exist. `model` is a Hugging Face causal LM (its `.model` body and `.lm_head`).
    """
    hidden = model.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
    h = torch.gather(hidden, 1, mb.positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    return fused_logprobs(h, model.lm_head.weight, mb.targets, temperature, mask=mb.mask,
                          with_entropy=with_entropy, impl=impl)
