"""What a model directory says about the ids and lengths its rollouts may hold."""

from __future__ import annotations

import json
from pathlib import Path

from dph_async.config import ReplayConfig, RunConfig


def vocab_size(model_dir: str | Path) -> int:
    """The rows of the model's embedding (config.json's vocab_size, or its text model's): token ids
    at or past it would index outside the learner's embedding."""
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"{path}: no vocab_size")
    return size


def replay_config(cfg: RunConfig, model_dir: str | Path) -> ReplayConfig:
    """The run's replay settings, completed with the model's vocabulary and context where the config
    leaves them unset, so the replay refuses token ids and lengths the learner cannot take."""
    replay = cfg.replay
    return replay.model_copy(update={
        "vocab_size": replay.vocab_size or vocab_size(model_dir),
        "max_sequence_tokens": replay.max_sequence_tokens or cfg.model.max_model_len,
    })
