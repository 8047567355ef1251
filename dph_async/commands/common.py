"""Helpers shared by the command modules (not a command itself: it has no NAME)."""

from __future__ import annotations

from dph_async.config import ConfigError, RunConfig, load_config
from dph_async.progress import console


def load_cli_config(preset: str, overrides: list[str]) -> RunConfig | None:
    """The config, or None after printing what is wrong with it."""
    try:
        return load_config(preset, overrides)
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}")
        return None
