"""Where the analysed weights come from, and what each matrix is.

A checkpoint is read without building the model: a Hugging Face directory (safetensors, sharded or
not; weights in a pickle, such as pytorch_model.bin, are refused), a learner checkpoint
`rl/<run>/checkpoints/v<N>` (its model states, or under ZeRO-3 the ranks' optimizer partitions put
together; state files, never unpickled), or a whole RL run directory
`rl/<run>`, which stands for its checkpoints in version order followed by its final model: one run
as a trajectory.

Matrices are the 2-D floating-point tensors; each is named by its layer and its type (q, k, v, o,
gate, up, down, embed, head, ... after the usual Hugging Face parameter names).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from dph_async.model_files import ModelFileError, weight_files
from dph_async.paths import (
    MODEL_STATES,
    ZERO3_MODEL_STATES,
    checkpoint_dir,
    checkpoint_weights,
    final_model,
    is_learner_checkpoint,
)

# Parameter-name fragment -> (type, group). Llama/Qwen/Mistral names first, then fused (Phi-3) and
# GPT-2 ones. A matrix matching none keeps its own module name as type, in group "other".
TYPES: list[tuple[str, str, str]] = [
    ("self_attn.q_proj", "q", "attention"), ("self_attn.k_proj", "k", "attention"),
    ("self_attn.v_proj", "v", "attention"), ("self_attn.o_proj", "o", "attention"),
    ("self_attn.qkv_proj", "qkv", "attention"), ("attn.c_attn", "qkv", "attention"), ("attn.c_proj", "o", "attention"),
    ("mlp.gate_proj", "gate", "mlp"), ("mlp.up_proj", "up", "mlp"), ("mlp.down_proj", "down", "mlp"),
    ("mlp.gate_up_proj", "gate_up", "mlp"), ("mlp.c_fc", "up", "mlp"), ("mlp.c_proj", "down", "mlp"),
    ("embed_tokens", "embed", "embedding"), ("wte", "embed", "embedding"), ("wpe", "pos_embed", "embedding"),
    ("lm_head", "head", "head"),
]
TYPE_ORDER = ["q", "k", "v", "qkv", "o", "gate", "up", "gate_up", "down", "embed", "pos_embed", "head"]
_LAYER = re.compile(r"\.(?:layers|h|blocks)\.(\d+)\.")
_VERSION = re.compile(r"v(\d+)")
_SAFETENSORS_FLOATS = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}


@dataclass(frozen=True)
class MatrixInfo:
    name: str  # the parameter's name, e.g. model.layers.0.self_attn.q_proj.weight
    layer: int | None  # None outside the transformer blocks (embeddings, head)
    type: str
    group: str  # attention, mlp, embedding, head, other


def describe(name: str) -> MatrixInfo:
    m = _LAYER.search(name)
    layer = int(m.group(1)) if m else None
    for fragment, type_, group in TYPES:
        if f".{fragment}." in f".{name}":
            return MatrixInfo(name, layer, type_, group)
    parts = name.split(".")
    return MatrixInfo(name, layer, parts[-2] if len(parts) > 1 else parts[0], "other")


def type_rank(type_: str) -> tuple[int, str]:
    """Sort key: the usual types in model order, the others after them alphabetically."""
    return (TYPE_ORDER.index(type_), "") if type_ in TYPE_ORDER else (len(TYPE_ORDER), type_)


@dataclass(frozen=True)
class Checkpoint:
    """One set of weights to compare with the base: a Hugging Face directory or a learner checkpoint."""
    label: str
    path: Path
    deepspeed: bool = False

    @property
    def hf(self) -> bool:
        return not self.deepspeed


def _label(path: Path) -> str:
    """A short name: `<run>` for rl/<run>/final_model, `<run>/v<N>` for a learner checkpoint, else the
    directory's name."""
    if path.name == final_model(Path()).name:
        return path.parent.name
    if _VERSION.fullmatch(path.name) and path.parent.name == checkpoint_dir(Path()).name:
        return f"{path.parent.parent.name}/{path.name}"
    return path.name


def expand(path: Path) -> list[Checkpoint]:
    """The checkpoints a command-line path stands for (see the module docstring)."""
    path = Path(path)
    if (path / "config.json").is_file():
        return [Checkpoint(_label(path), path)]
    if is_learner_checkpoint(path):
        return [Checkpoint(_label(path), path, deepspeed=True)]
    ckpts = checkpoint_dir(path)
    if ckpts.is_dir() or (final_model(path) / "config.json").is_file():
        versions = sorted((int(m.group(1)), d) for d in (ckpts.iterdir() if ckpts.is_dir() else [])
                          if (m := _VERSION.fullmatch(d.name)) and is_learner_checkpoint(d))
        out = [Checkpoint(f"{path.name}/v{v}", d, deepspeed=True) for v, d in versions]
        if (final_model(path) / "config.json").is_file():
            out.append(Checkpoint(f"{path.name}/final", final_model(path)))
        if out:
            return out
    raise FileNotFoundError(f"{path}: not a Hugging Face model directory (no config.json), a learner checkpoint "
                            f"(no {MODEL_STATES} or {ZERO3_MODEL_STATES}) or an RL run directory "
                            "(no checkpoints/v<N> or final_model)")


def run_dir_of(path: Path) -> Path | None:
    """The run directory (the one with config.yaml) that holds `path`, if any."""
    for d in [Path(path), *Path(path).parents]:
        if (d / "config.yaml").is_file():
            return d
    return None


def default_out(paths: list[Path], kind: str) -> Path:
    """<run>/<kind>/<names> for checkpoints inside a run directory, else runs/<kind>/<names>; <names> joins
    the checkpoints' short names with '+'."""
    name = "+".join(dict.fromkeys(_label(Path(p)).replace("/", "-") for p in paths))
    run = run_dir_of(paths[0])
    return (run if run is not None else Path("runs")) / kind / name


def _shards(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: those its index names (each a file of the
    directory itself), else every one there (`dph_async.model_files`: a pickle is refused)."""
    index = model_dir / "model.safetensors.index.json"
    if not index.is_file():
        return weight_files(model_dir)
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ModelFileError(f"{index}: no weight_map of tensor names to file names") from None
    for name in names:
        if not (isinstance(name, str) and name.endswith(".safetensors") and Path(name).name == name):
            raise ModelFileError(f"{index}: {name!r} is not a safetensors file of the directory")
    return [model_dir / name for name in names]


class WeightReader:
    """The 2-D floating-point tensors of one checkpoint, read one at a time (safetensors lazily)."""
    def __init__(self, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self._stack = ExitStack()
        self._where: dict[str, object] = {}  # name -> an open safetensors file or a loaded state dict
        path = ckpt.path
        if ckpt.deepspeed:
            self._add(checkpoint_weights(path))
            return
        for f in _shards(path):
            self._add(self._stack.enter_context(safe_open(str(f), framework="pt")))

    def _add(self, source) -> None:
        self._where.update(dict.fromkeys(source.keys(), source))  # a state dict, or an open safetensors file

    def names(self) -> list[str]:
        """Every tensor's name, in file order."""
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> list[int]:
        src = self._where[name]
        return list(src[name].shape) if isinstance(src, dict) else list(src.get_slice(name).get_shape())

    def _floating(self, name: str) -> bool:
        src = self._where[name]
        if isinstance(src, dict):
            return src[name].dtype.is_floating_point
        return src.get_slice(name).get_dtype() in _SAFETENSORS_FLOATS

    def matrices(self) -> list[str]:
        """Names of the 2-D floating-point tensors, in file order."""
        return [n for n in self.names() if len(self.shape(n)) == 2 and self._floating(n)]

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise KeyError(f"{self.ckpt.path}: no tensor {name!r}")
        src = self._where[name]
        return src[name] if isinstance(src, dict) else src.get_tensor(name)

    def close(self) -> None:
        self._stack.close()
        self._where.clear()

    def __enter__(self) -> WeightReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def common_matrices(base: WeightReader, others: list[WeightReader]) -> Iterator[MatrixInfo]:
    """The base's matrices that every checkpoint holds with the same shape (the others are named)."""
    for name in base.matrices():
        shape = base.shape(name)
        missing = [r.ckpt.label for r in others if name not in r or r.shape(name) != shape]
        if missing:
            raise ValueError(f"{name} {shape} of the base is missing or of another shape in: {', '.join(missing)}")
        yield describe(name)
