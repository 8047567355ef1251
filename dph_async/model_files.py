"""A model directory's weights are read from safetensors files only.

A model directory may come from anyone (`--model DIR`, a run directory someone copied). Weights in a
pickle format (`pytorch_model.bin`, `*.pt`, ...) could run code when loaded, so they are never
loaded: a directory whose weights are only in such a file is refused, naming the file. (Every
loader is also told so: transformers' `use_safetensors=True`, vLLM's `load_format="safetensors"`.)
"""

from __future__ import annotations

import json
from pathlib import Path

from dph_async.errors import UserError

# Weight files of formats other than safetensors (pickles: torch.save, pickled numpy; others: TF, Flax).
FOREIGN = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".npy", ".npz", ".h5", ".msgpack")


class ModelFileError(UserError):
    """A model directory without safetensors weights: names the directory or the foreign file."""


def check_index(model_dir: Path) -> None:
    """A sharded model's index (`model.safetensors.index.json`) may name only safetensors files of
    `model_dir` itself that are there: vLLM and transformers open what it names, so `../x.safetensors`
    would load weights from outside the directory, and a missing shard fails only inside a process."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        names = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise ModelFileError(f"{index}: no weight_map of tensor names to file names") from None
    for name in sorted(names, key=str):
        if not (isinstance(name, str) and name.endswith(".safetensors") and Path(name).name == name):
            raise ModelFileError(f"{index}: {name!r} is not a safetensors file of the directory")
        if not (Path(model_dir) / name).is_file():
            raise ModelFileError(f"{index}: names {name!r}, which is not in the directory")


def weight_files(model_dir: Path) -> list[Path]:
    """The `*.safetensors` files of `model_dir`, in name order (its index, if any, checked first)."""
    model_dir = Path(model_dir)
    check_index(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    foreign = sorted(f for f in model_dir.iterdir() if f.suffix in FOREIGN) if model_dir.is_dir() else []
    if foreign:
        raise ModelFileError(f"{foreign[0]}: weights in a format other than safetensors, which is never loaded "
                             "(a pickle can run code): save the model as safetensors (save_pretrained does)")
    raise ModelFileError(f"{model_dir}: no *.safetensors weights")
