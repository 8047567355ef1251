"""ZeRO-3: the fused log-prob kernel on a partitioned LM head, and whole weights out of a partitioned model.

Under ZeRO-3 every parameter is partitioned across the ranks; outside a forward of the module that
owns it, a parameter is an empty placeholder. DeepSpeed gathers a module's parameters in hooks
around that module's forward and backward, and reduce-scatters a parameter's gradient when autograd
accumulates it. The fused kernel reads the LM head's weight outside `lm_head`'s forward (it never
calls `lm_head`, which would build the [tokens, vocab] logits), so it runs as the forward of
`FusedHead`, a module without parameters of its own that holds the LM head's weight as a DeepSpeed
external parameter:

- forward: the pre-forward hook gathers the whole weight; the kernel reads it; the post-forward
  hook releases it.
- backward: the hook on the head's outputs gathers the weight again before the kernel's backward
  (which recomputes each vocabulary block's logits from it); the gradient for the weight goes to the
  parameter itself, whose gradient hook reduce-scatters it into this rank's partition; the hook on
  the head's inputs releases the weight once the hidden states' gradient has left.

A tied LM head (the input embeddings' weight) works the same way: the embedding's own forward and
the head's each gather it, and autograd sums both gradients before the one reduction.

DeepSpeed counts micro-batches of gradient accumulation at the start of the engine's forward; the
trainer runs the model's body and this head, never the engine's forward, so `prepare_engine` makes
the body's forward mark a micro-batch's start as the engine's would. Without it every micro-batch's
gradient would overwrite the previous ones' instead of adding to them.

Reading whole weights (`full_state_dict`) gathers one parameter at a time: every rank must call it
(each gather is a collective). With several ranks, rank 0 keeps the copies and the others only take
part in the gathers (`Trainer.whole_state`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dph_async.kernels import fused_logprobs

HEAD = "fused_head"


class FusedHead(torch.nn.Module):
    """The fused kernel as a module's forward, so that DeepSpeed gathers the LM head around it."""

    def forward(self, hidden: Tensor, targets: Tensor, mask: Tensor, *, weight: Tensor, temperature: float,
                with_entropy: bool, impl: str) -> tuple[Tensor, Tensor | None]:
        # `weight` is passed by keyword: DeepSpeed's hooks wrap positional tensors, and the kernel
        # must see the parameter itself so that its gradient reaches the parameter's reduction hook.
        return fused_logprobs(hidden, weight, targets, temperature, mask=mask, with_entropy=with_entropy, impl=impl)


def partitioned(param: Tensor) -> bool:
    """True for a parameter that DeepSpeed ZeRO-3 has partitioned."""
    return hasattr(param, "ds_id")


def prepare_model(model: torch.nn.Module) -> None:
    """Before `deepspeed.initialize` with ZeRO-3: give `model` (a Hugging Face causal LM) the
    `FusedHead` that `learner.logprobs.response_logprobs` calls. It has no parameters, so the state
    dict, the published weights and the saved model do not change."""
    import deepspeed  # heavy: a ZeRO-3 trainer's, already loaded by it (learner/trainer.py)

    model.add_module(HEAD, FusedHead())
    deepspeed.zero.register_external_parameter(getattr(model, HEAD), model.get_output_embeddings().weight)


def prepare_engine(engine) -> None:
    """After `deepspeed.initialize` with ZeRO-3: each forward of the model's body starts a micro-batch
    for DeepSpeed's gradient accumulation, as a forward through the engine would."""
    optimizer = engine.optimizer

    def start_micro_batch(module: torch.nn.Module, args: tuple) -> None:
        optimizer.clear_backward_seen_flag()

    engine.module.get_decoder().register_forward_pre_hook(start_micro_batch)


def full_state_dict(model: torch.nn.Module, keep: bool = True) -> dict[str, Tensor]:
    """`model.state_dict()` with whole tensors. Without partitioned parameters, the state dict itself;
    under ZeRO-3, CPU copies gathered one parameter at a time (so no rank ever holds more than one
    whole parameter beyond its partition), tied names sharing one copy. A collective under ZeRO-3;
    `keep=False` takes part in the gathers and copies nothing (another rank keeps the weights)."""
    if not any(partitioned(p) for p in model.parameters()):
        return model.state_dict() if keep else {}
    import deepspeed  # heavy: a ZeRO-3 trainer's, already loaded by it (learner/trainer.py)

    copies: dict[int, Tensor] = {}
    out: dict[str, Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in copies:
            if partitioned(t):
                with deepspeed.zero.GatheredParameters([t]):
                    copies[id(t)] = t.detach().to("cpu", copy=True) if keep else t
            else:
                copies[id(t)] = t.detach()
        out[name] = copies[id(t)]
    return out if keep else {}
