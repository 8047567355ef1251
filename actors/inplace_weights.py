"""New weights into a running vLLM model by copying them into its parameters in place.

vLLM's own reload path (`reload_weights`) rebuilds every layer around the load: its parameters are
put back on the meta device, materialised, filled through the checkpoint loaders and processed again
(tens of milliseconds of bookkeeping even for a tiny model). Here the received tensors are copied
straight into place, with a plan made once from the model:

- a checkpoint tensor whose module exists in the model (`model.layers.0.self_attn.o_proj.weight`)
  goes into that parameter;
- vLLM stacks some checkpoint tensors into one parameter (the model class's `packed_modules_mapping`:
  q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj); each goes into its rows, in the layer's
  `output_sizes` order;
- an embedding's vocabulary is padded (to a multiple of 64): the checkpoint rows go first, the
  padding rows stay zero, as vLLM's loader leaves them.

On the CPU a linear layer keeps no weight after loading: `process_weights_after_loading` packs it
for the GEMM kernel (oneDNN) and drops the parameter. Such a layer gets its received weight back
(its shards concatenated, for a stacked one) and its own `process_weights_after_loading` packs it
again, so the kernels see exactly what a fresh engine built from the same weights sees, and no
second copy of the weights is kept. Layers that keep their weight (embeddings, the LM head, and every
linear layer under `actors.cpu_gemm=torch`, which runs F.linear on it) get the values copied in and
are processed again too, since their kernels may hold a packed copy; under `torch` that processing
packs nothing, and a load is the copy alone.

Stacked shards that lie back to back in one buffer (as the learner's shared-memory segment lays out
q/k/v and gate/up) are joined as one view, not concatenated. A layer whose packing keeps the weight it
was given gets its own copy of it: the received tensors are views of the sender's memory (a message
frame, or the shared segment, read-only and rewritten by the learner later).

What the plan cannot place (names of another layout, a quantized or tensor-parallel layer, an
update that leaves part of a stacked weight unset) is reported as None; the engine then loads the
whole update through `reload_weights`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: rows [start, start + rows) of a layer's `attr` tensor."""

    layer: nn.Module
    attr: str  # "weight" or "bias" (or a norm's "weight")
    start: int
    rows: int
    shape: tuple[int, ...]  # the checkpoint tensor's shape


Signature = tuple[tuple[str, tuple[int, ...]], ...]


def _processable(layer: nn.Module) -> bool:
    """Unquantized, not tensor-parallel: the layouts this plan knows."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    method = getattr(layer, "quant_method", None)
    return (method is None or isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod))) \
        and getattr(layer, "tp_size", 1) == 1


def _submodule(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


def _full_shape(layer: nn.Module, attr: str) -> tuple[int, ...] | None:
    """The shape of `layer.attr` as loaded, also when packing dropped the weight (numel 0)."""
    t = getattr(layer, attr, None)
    if not isinstance(t, torch.Tensor):
        return None
    if t.numel() > 0:
        return tuple(t.shape)
    if attr == "weight" and hasattr(layer, "output_size_per_partition"):
        return layer.output_size_per_partition, layer.input_size_per_partition
    return None


def _target(model: nn.Module, name: str, shape: tuple[int, ...]) -> Target | None:
    """Where checkpoint tensor `name` of `shape` goes, or None if this plan cannot place it."""
    path, _, attr = name.rpartition(".")
    layer = _submodule(model, path)
    start, rows = 0, shape[0] if shape else 1
    if layer is None:  # a shard of a stacked parameter?
        parent, _, leaf = path.rpartition(".")
        for packed, shards in getattr(model, "packed_modules_mapping", {}).items():
            if leaf in shards:
                layer = _submodule(model, f"{parent}.{packed}" if parent else packed)
                sizes = getattr(layer, "output_sizes", None)
                if layer is None or sizes is None or len(sizes) != len(shards):
                    return None
                i = shards.index(leaf)
                start, rows = sum(sizes[:i]), sizes[i]
                break
    if layer is None or not _processable(layer):
        return None
    full = _full_shape(layer, attr)
    if full is None or len(full) != len(shape) or tuple(full[1:]) != tuple(shape[1:]) or not shape:
        return None
    if shape[0] != rows or start + rows > full[0]:
        return None
    return Target(layer, attr, start, rows, tuple(shape))


def _joined(shards: list[torch.Tensor]) -> torch.Tensor:
    """The shards stacked by rows: a view when they lie back to back in one storage, else a copy."""
    first = shards[0]
    end = first.storage_offset()
    for t in shards:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or t.storage_offset() != end:
            return torch.cat(shards)
        end += t.numel()
    rows = sum(t.shape[0] for t in shards)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _covers(targets: list[Target], full_rows: int, padded: bool) -> bool:
    """Whether the targets fill every row of a weight (the first rows, for a padded embedding)."""
    end = 0
    for a, b in sorted((t.start, t.start + t.rows) for t in targets):
        if a != end:
            return False
        end = b
    return end == full_rows or padded


class InPlaceLoader:
    """Puts checkpoint tensors into a vLLM model's parameters; `load` returns False when it cannot
    place them (nothing is changed then)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._plan: dict[str, Target] | None = None
        self._signature: Signature | None = None

    def _make_plan(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Target] | None:
        plan: dict[str, Target] = {}
        for name, t in named:
            target = _target(self.model, name, tuple(t.shape))
            if target is None:
                return None
            plan[name] = target
        by_slot: dict[tuple[int, str], list[Target]] = {}
        for target in plan.values():
            by_slot.setdefault((id(target.layer), target.attr), []).append(target)
        for targets in by_slot.values():
            layer, attr = targets[0].layer, targets[0].attr
            padded = hasattr(layer, "org_vocab_size") and getattr(layer, attr).numel() > 0
            if not _covers(targets, _full_shape(layer, attr)[0], padded):
                return None
        return plan

    def load(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        signature = tuple((name, tuple(t.shape)) for name, t in named)
        if signature != self._signature:
            self._plan, self._signature = self._make_plan(named), signature
        if self._plan is None:
            return False
        dropped: dict[int, list[tuple[int, torch.Tensor]]] = {}  # layers whose packing dropped the weight
        touched: dict[int, nn.Module] = {}
        with torch.no_grad():
            for name, t in named:
                target = self._plan[name]
                layer = touched[id(target.layer)] = target.layer
                param = getattr(layer, target.attr)
                if param.numel() == 0:
                    dropped.setdefault(id(layer), []).append((target.start, t))
                else:
                    param.data[target.start:target.start + target.rows].copy_(t)
            for key, layer in touched.items():
                weight = None
                if key in dropped:
                    shards = [t for _, t in sorted(dropped[key], key=lambda s: s[0])]
                    weight = shards[0] if len(shards) == 1 else _joined(shards)
                    layer.weight = nn.Parameter(weight.to(layer.weight.dtype), requires_grad=False)
                if hasattr(layer, "cpu_linear"):  # the CPU kernels hold a packed copy: pack again
                    layer.quant_method.process_weights_after_loading(layer)
                if weight is not None and _shares_memory(layer.weight, weight):
                    layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        return True
