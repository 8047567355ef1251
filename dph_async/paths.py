"""Where a run keeps its files. Every stage reads and writes here, so a stopped run resumes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads only where weights are read, not wherever a path is needed
    import torch


def torch_extensions_dir() -> str:
    """Where DeepSpeed's compiled ops are built and found (TORCH_EXTENSIONS_DIR, read when DeepSpeed is
    imported): the variable if set, else DPH_CACHE_DIR's (default `.cache`) torch_extensions."""
    return os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path(os.environ.get("DPH_CACHE_DIR", ".cache"))
                                                        / "torch_extensions")


@dataclass(frozen=True)
class RunPaths:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def base_model(self) -> Path:
        """pi_0: the warm-started embedded model, or a copy-free pointer to --model."""
        return self.root / "base_model"

    @property
    def presample(self) -> Path:
        return self.root / "presample"

    @property
    def reference_pool(self) -> Path:
        return self.presample / "reference_pool.parquet"

    @property
    def exploration_data(self) -> Path:
        return self.presample / "d_exp.parquet"

    def rl(self, name: str) -> Path:
        """One RL run: `rl/<name>` (a mode of --compare, or the configured divergence)."""
        return self.root / "rl" / name

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def plots(self) -> Path:
        return self.root / "plots"


# The file of a DeepSpeed checkpoint that holds the model's whole weights (ZeRO 0-2: rank 0 writes it).
MODEL_STATES = "mp_rank_00_model_states.pt"
# What ZeRO-3 writes instead (one per rank): its weights are placeholders, the weights themselves are
# in the ranks' optimizer partitions, which `checkpoint_weights` puts together.
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def is_learner_checkpoint(directory: Path) -> bool:
    """Whether `directory` (checkpoints/v<N>) holds a learner checkpoint, whichever ZeRO stage wrote it."""
    return (directory / MODEL_STATES).is_file() or (directory / ZERO3_MODEL_STATES).is_file()


def checkpoint_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The model's whole weights (on the CPU) in the learner checkpoint `directory`, read as state
    files (`dph_async.state_file`): a file of another format, a pickle included, is refused by name."""
    # heavy (torch, about 1.5 s): every command imports this module; reading a checkpoint alone needs it
    from dph_async.state_file import StateFile
    from dph_async.zero3_checkpoint import zero3_weights

    if (directory / MODEL_STATES).is_file():
        with StateFile(directory / MODEL_STATES) as f:
            return f.get("module")
    return zero3_weights(directory)


def checkpoint_dir(rl_dir: Path) -> Path:
    return rl_dir / "checkpoints"


def final_model(rl_dir: Path) -> Path:
    return rl_dir / "final_model"


def endpoints_dir(rl_dir: Path) -> Path:
    """Where each process of an RL run writes the URL of its /health and /metrics endpoint."""
    return rl_dir / "endpoints"
