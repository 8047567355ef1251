"""Whole weights out of a ZeRO-3 learner checkpoint, put together from the ranks' partitions.

Under ZeRO-3 each of the R ranks writes its own files: `zero_pp_rank_<r>_mp_rank_00_model_states.pt`
(the parameters' names and shapes, the buffers, which names share a tensor; the parameters
themselves are placeholders) and `[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt` (its fp32
partition of every parameter, as flat groups). Each rank holds ceil(n / R) values of every
parameter of n values, the parameters one after another in the order of the shapes, the last
rank's part padded: a parameter is its R parts joined, cut to n and shaped. All of them are state
files (`dph_async.state_file`), read without unpickling anything.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dph_async.state_file import StateFile, StateFileError


def model_states(directory: Path, rank: int) -> Path:
    return directory / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_states(directory: Path, rank: int) -> Path:
    """Rank `rank`'s optimizer file: its name has a `bf16_` prefix when the learner trained in bf16."""
    name = f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    plain = directory / name
    return plain if plain.is_file() else directory / f"bf16_{name}"


def _partition(path: Path) -> tuple[int, torch.Tensor]:
    """The rank count a rank's optimizer file names, and its fp32 partition as one flat tensor."""
    if not path.is_file():
        raise StateFileError(f"{path}: missing (a ZeRO-3 checkpoint has one optimizer file per rank)")
    with StateFile(path) as f:
        count = f.get("optimizer_state_dict", "partition_count")
        groups = f.get("optimizer_state_dict", "fp32_flat_groups")
    count = max(count) if isinstance(count, list) else count
    if type(count) is not int or count < 1 or not all(isinstance(g, torch.Tensor) and g.dim() == 1 for g in groups):
        raise StateFileError(f"{path}: no ZeRO-3 partition (partition_count {count!r}, fp32_flat_groups)")
    return count, torch.cat(groups) if groups else torch.zeros(0)


def zero3_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Buffers, then parameters in the checkpoint's order (fp32, from the optimizer's partitions),
    then the names that share another's tensor."""
    with StateFile(model_states(directory, 0)) as f:
        shapes = {name: shape for group in f.get("param_shapes") for name, shape in group.items()}
        if f.get("frozen_param_shapes"):
            raise StateFileError(f"{f.path}: frozen parameters, which the learner never has")
        names = set(f.get("buffer_names"))
        out = {k: v.float() if v.is_floating_point() else v for k, v in f.get("module").items() if k in names}
        shared = f.get("shared_params")
    world, first = _partition(optim_states(directory, 0))
    flats = [first] + [_partition(optim_states(directory, r))[1] for r in range(1, world)]
    parts = [math.ceil(s.numel() / world) for s in shapes.values()]
    if any(flat.numel() != sum(parts) for flat in flats):
        raise StateFileError(f"{directory}: the ranks' partitions hold {[f.numel() for f in flats]} values, the "
                             f"parameters' shapes need {sum(parts)} on each of {world} ranks")
    offset = 0
    for (name, shape), part in zip(shapes.items(), parts, strict=True):
        whole = torch.cat([flat[offset:offset + part] for flat in flats])
        out[name] = whole[:shape.numel()].view(shape)
        offset += part
    for name, same in shared.items():
        if same in out:
            out[name] = out[same]
    return out
