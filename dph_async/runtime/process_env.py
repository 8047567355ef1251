"""What every process of a run sets up first: where its caches live, where it binds, where it logs."""

from __future__ import annotations

import os
from pathlib import Path

from dph_async.config import RunConfig


def cache_dir() -> Path:
    """Persistent caches (DeepSpeed's compiled ops) live in ./.cache unless DPH_CACHE_DIR says otherwise."""
    return Path(os.environ.get("DPH_CACHE_DIR", ".cache")).resolve()


def bind_address(cfg: RunConfig) -> str:
    return f"tcp://{cfg.net.host}:0"


def log_to_file(path: Path) -> None:
    """Send this process's stdout and stderr (engine warnings, progress bars) to `path`: the driver's
    terminal keeps only the run's own progress, and each process's log stays with the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
