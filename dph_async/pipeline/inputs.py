"""Checks of a run's input files, made in the driver before any process starts: the model directory
(with safetensors weights), and the prompt datasets (readable, in the verl row format, a reward for
every data_source, the reward plugins loaded first). A mistake is then one error naming the setting
and the file, not a failure inside a Ray worker. Import-light (no torch, no Ray): commands check
before they load either."""

from __future__ import annotations

from pathlib import Path

from dph_async.config import ConfigError, RewardConfig
from dph_async.model_files import ModelFileError, weight_files
from dph_async.rewards.plugins import load_plugins
from dph_async.rewards.registry import UnknownDataSource, get_reward_fn
from dph_async.tasks.dataset import DatasetError, read_rows


def check_model_dir(path: str | Path, key: str) -> Path:
    """`path` as a Path if it is a Hugging Face model directory with safetensors weights; `key` names
    the setting or flag."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{key}: {path} is not a Hugging Face model directory (no config.json)")
    try:
        weight_files(Path(path))
    except ModelFileError as e:
        raise ConfigError(f"{key}: {e}") from None
    return Path(path)


def check_datasets(files: dict[str, str | Path | None], rewards: RewardConfig) -> None:
    """Every file (keyed by the setting or flag that names it; None: not set) reads as a prompt dataset
    whose data sources all have a reward."""
    load_plugins(rewards.plugins)
    for key, path in files.items():
        if path is None:
            continue
        if not Path(path).is_file():
            raise ConfigError(f"{key}: no such file: {path}")
        try:
            for source in sorted({row.data_source for row in read_rows(path)}):
                get_reward_fn(source)
        except DatasetError as e:  # it names the file and the row
            raise ConfigError(f"{key}: {e}") from None
        except UnknownDataSource as e:
            raise ConfigError(f"{key}: {path}: {e}") from None
