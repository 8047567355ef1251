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

With `keep` (the tensors stay valid until the next load: a leased shared-memory slot, section 10 of
docs/data_plane.md), a parameter that keeps its weight becomes a view of the received tensor instead
of a copy of it; the rest is as above.

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
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod


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


def _adjacent(shards: list[torch.Tensor]) -> torch.Tensor | None:
    """The shards stacked by rows as one view, if they lie back to back in one storage; else None."""
    first = shards[0]
    end = first.storage_offset()
    for t in shards:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() \
                or t.storage_offset() != end:
            return None
        end += t.numel()
    rows = sum(t.shape[0] for t in shards)
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _joined(shards: list[torch.Tensor]) -> torch.Tensor:
    """The shards stacked by rows: a view when they lie back to back in one storage, else a copy."""
    view = _adjacent(shards)
    return torch.cat(shards) if view is None else view


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


Slot = tuple[int, str]  # (id of the layer, attribute): one parameter of the model


def _shared_parameters(model: nn.Module) -> set[Slot]:
    """Parameters that another module holds too (a tied LM head that is not the embedding module
    itself): replacing one module's would untie them, so they are only ever copied into."""
    owners: dict[int, list[Slot]] = {}
    for module in model.modules():
        for attr, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append((id(module), attr))
    return {slot for slots in owners.values() if len(slots) > 1 for slot in slots}


class InPlaceLoader:
    """Puts checkpoint tensors into a vLLM model's parameters; `load` returns False when it cannot
    place them (nothing is changed then).

    With `keep`, the caller promises the tensors stay valid and unchanged until its next load (a
    leased shared-memory segment, actors/weight_client.py): a parameter the update fills whole, in its own
    dtype and from one buffer (q/k/v lying back to back included), then becomes a view of it instead
    of a copy. The load is then no copy at all, and every actor on the host runs on the learner's one
    copy of the weights. A later load without `keep` gives such parameters memory of their own again
    before copying into them (the views are read-only)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._plan: dict[str, Target] | None = None
        self._signature: Signature | None = None
        self._shared = _shared_parameters(model)
        self.viewing: set[Slot] = set()  # parameters that are views of the caller's tensors

    def _make_plan(self, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Target] | None:
        plan: dict[str, Target] = {}
        for name, t in named:
            target = _target(self.model, name, tuple(t.shape))
            if target is None:
                return None
            plan[name] = target
        for targets in self._by_slot((t, None) for t in plan.values()).values():
            layer, attr = targets[0][0].layer, targets[0][0].attr
            padded = hasattr(layer, "org_vocab_size") and getattr(layer, attr).numel() > 0
            if not _covers([t for t, _ in targets], _full_shape(layer, attr)[0], padded):
                return None
        return plan

    @staticmethod
    def _by_slot(items) -> dict[Slot, list]:
        """(target, tensor) pairs grouped by the parameter they go into, each group in row order."""
        groups: dict[Slot, list] = {}
        for target, t in items:
            groups.setdefault((id(target.layer), target.attr), []).append((target, t))
        return {k: sorted(v, key=lambda item: item[0].start) for k, v in groups.items()}

    def _view(self, slot: Slot, param: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor | None:
        """The shards as the whole parameter, without a copy; None if they cannot be."""
        if slot in self._shared or any(t.dtype != param.dtype for t in shards):
            return None
        view = _adjacent(shards)
        return view if view is not None and view.shape == param.shape else None

    def own(self) -> None:
        """Give every parameter that is a view of the caller's tensors memory of its own (a copy)."""
        for module in self.model.modules():
            for attr, p in list(module.named_parameters(recurse=False)):
                if (id(module), attr) in self.viewing:
                    setattr(module, attr, nn.Parameter(p.detach().clone(), requires_grad=False))
        self.viewing.clear()

    def load(self, named: Sequence[tuple[str, torch.Tensor]], keep: bool = False) -> bool:
        signature = tuple((name, tuple(t.shape)) for name, t in named)
        if signature != self._signature:
            self._plan, self._signature = self._make_plan(named), signature
        if self._plan is None:
            return False
        plan = self._plan
        dropped: dict[int, torch.Tensor] = {}  # layers whose packing dropped the weight: what they get back
        touched: dict[int, nn.Module] = {}
        with torch.no_grad():
            for slot, items in self._by_slot((plan[name], t) for name, t in named).items():
                layer, attr = items[0][0].layer, items[0][0].attr
                touched[id(layer)] = layer
                param = getattr(layer, attr)
                shards = [t for _, t in items]
                if param.numel() == 0:
                    dropped[id(layer)] = shards[0] if len(shards) == 1 else _joined(shards)
                    continue
                view = self._view(slot, param, shards) if keep else None
                if view is not None:
                    setattr(layer, attr, nn.Parameter(view, requires_grad=False))
                    self.viewing.add(slot)
                    continue
                if slot in self.viewing:  # read-only memory of an earlier load: own memory again
                    param = nn.Parameter(torch.empty_like(param), requires_grad=False)
                    setattr(layer, attr, param)
                    self.viewing.discard(slot)
                for target, t in items:
                    param.data[target.start:target.start + target.rows].copy_(t)
            for key, layer in touched.items():
                weight = dropped.get(key)
                if weight is not None:
                    layer.weight = nn.Parameter(weight.to(layer.weight.dtype), requires_grad=False)
                if hasattr(layer, "cpu_linear"):  # the CPU kernels hold a packed copy: pack again
                    layer.quant_method.process_weights_after_loading(layer)
                if weight is not None and _shares_memory(layer.weight, weight):
                    layer.weight = nn.Parameter(layer.weight.detach().clone(), requires_grad=False)
        return True
