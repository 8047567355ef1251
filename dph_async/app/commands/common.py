"""Helpers shared by the command modules (not a command itself: it has no NAME)."""

from __future__ import annotations

from collections.abc import Callable

from dph_async.app.progress import console
from dph_async.config import ConfigError, RunConfig, load_config


def load_cli_config(preset: str, overrides: list[str]) -> RunConfig | None:
    """The config, or None after printing what is wrong with it."""
    try:
        return load_config(preset, overrides)
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}")
        return None


def guarded(work: Callable[[], object], interrupted: str) -> int:
    """Run `work`: exit status 0 when it finishes, 2 after printing a config error, 130 after printing
    `interrupted` on Ctrl-C."""
    try:
        work()
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}")
        return 2
    except KeyboardInterrupt:
        console.print(f"[yellow]interrupted: {interrupted}")
        return 130
    return 0
