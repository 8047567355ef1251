"""Where a run keeps its files. Every stage reads and writes here, so a stopped run resumes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
    def train_data(self) -> Path:
        return self.data / "train.parquet"

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


# The file of a DeepSpeed checkpoint that holds the model's weights (one learner rank).
MODEL_STATES = "mp_rank_00_model_states.pt"


def checkpoint_dir(rl_dir: Path) -> Path:
    return rl_dir / "checkpoints"


def final_model(rl_dir: Path) -> Path:
    return rl_dir / "final_model"


def endpoints_dir(rl_dir: Path) -> Path:
    """Where each process of an RL run writes the URL of its /health and /metrics endpoint."""
    return rl_dir / "endpoints"
