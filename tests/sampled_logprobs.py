"""What an actor's engine samples from, token by token, recomputed with Hugging Face's model.

An engine that loads weights between two steps keeps the KV cache of its running requests (an
in-flight update, docs/decisions.md): the token a step samples comes from that step's weights
attending to keys and values earlier steps computed with theirs. Token t of a completion is sampled
by the step that takes in token t - 1 (the prompt's last token for t = 0) at the weights stamped on
token t, and that step writes token t - 1's keys and values; the prompt but its last token is
computed by the group's first step (its leader's, whose prompt the others copy). `sampled_logprobs`
replays exactly that with an HF model per version and one DynamicCache, in float64 at the end:
the behaviour log-probs an engine must record, within the kernels' float tolerance.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from dph_async.paths import checkpoint_weights


def model_at(base: Path, checkpoints: Path, version: int) -> torch.nn.Module:
    """The learner's weights at `version`: the base model (version 0) or checkpoints/v<version>."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if version:
        model.load_state_dict(checkpoint_weights(checkpoints / f"v{version}"))
    return model


@torch.no_grad()
def sampled_logprobs(models: Mapping[int, torch.nn.Module], prompt: Sequence[int], tokens: Sequence[int],
                     versions: Sequence[int], prompt_version: int, temperature: float) -> np.ndarray:
    """log p(tokens[t]) under the distribution the engine sampled it from: softmax(logits / temperature)
    of the weights `models[versions[t]]`, over the KV cache the earlier steps wrote (the prompt but its
    last token at `prompt_version`). A run of tokens of one version is one forward pass: the steps
    that sampled them took in their predecessors at that version, one at a time, which is what a
    causal pass over the run computes."""
    from transformers import DynamicCache

    cache = DynamicCache()
    if len(prompt) > 1:
        models[prompt_version](input_ids=torch.tensor([list(prompt[:-1])]), past_key_values=cache, use_cache=True)
    inputs = [int(prompt[-1]), *map(int, tokens[:-1])]  # what the step sampling token t took in
    out = []
    start = 0
    while start < len(tokens):
        end = start
        while end < len(tokens) and versions[end] == versions[start]:
            end += 1
        logits = models[int(versions[start])](input_ids=torch.tensor([inputs[start:end]]), past_key_values=cache,
                                              use_cache=True).logits[0]
        logp = torch.log_softmax(logits.double() / temperature, -1)
        out += logp[torch.arange(end - start), torch.tensor([int(t) for t in tokens[start:end]])].tolist()
        start = end
    return np.asarray(out)
