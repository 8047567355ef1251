"""A model directory's weights are read from safetensors files only.

A model directory may come from anyone (`--model DIR`, a run directory someone copied). Weights in a
pickle format (`pytorch_model.bin`, `*.pt`, ...) could run code when loaded, so they are never
loaded: a directory whose weights are only in such a file is refused, naming the file. (Every
loader is also told so: transformers' `use_safetensors=True`, vLLM's `load_format="safetensors"`.)
"""

from __future__ import annotations

from pathlib import Path

from dph_async.errors import UserError

# Weight files of formats other than safetensors (pickles: torch.save, pickled numpy; others: TF, Flax).
FOREIGN = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".npy", ".npz", ".h5", ".msgpack")


class ModelFileError(UserError):
    """A model directory without safetensors weights: names the directory or the foreign file."""


def weight_files(model_dir: Path) -> list[Path]:
    """The `*.safetensors` files of `model_dir`, in name order."""
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    foreign = sorted(f for f in model_dir.iterdir() if f.suffix in FOREIGN) if model_dir.is_dir() else []
    if foreign:
        raise ModelFileError(f"{foreign[0]}: weights in a format other than safetensors, which is never loaded "
                             "(a pickle can run code): save the model as safetensors (save_pretrained does)")
    raise ModelFileError(f"{model_dir}: no *.safetensors weights")
