"""Reward plugins: the user's own reward functions, from a module name or a `.py` file.

    rewards.plugins: [my_rewards.py, my_package.rewards]

A plugin registers its rewards when imported, with `@register` from `dph_async.rewards.registry`,
as the built-in rewards do. Every process that scores loads the plugins of its config: each reward
worker, the process that owns a worker pool (it checks data sources before scoring), the scorer
service, and the driver of `dph-async run`, `eval` and `presample` before anything starts, so a
broken plugin is one error naming it rather than a failure inside a worker.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
import threading
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from dph_async.errors import UserError
from dph_async.rewards import registry


class PluginError(UserError):
    """A reward plugin could not be imported, or registered no reward; the message names it."""


_loaded: set[str] = set()
_lock = threading.Lock()


def load_plugins(plugins: Iterable[str]) -> None:
    """Import each plugin (a module name, or a path ending in .py) once per process."""
    with _lock:
        for plugin in plugins:
            if plugin not in _loaded:
                _load(plugin)
                _loaded.add(plugin)


def _load(plugin: str) -> None:
    # Built-ins first: a plugin that reuses a built-in name fails here, naming itself, and not later
    # inside whichever lookup happens to import the built-ins.
    registry.load_builtins()
    before = registry.registered()
    try:
        module = _import_file(Path(plugin)) if plugin.endswith(".py") else importlib.import_module(plugin)
    except PluginError:
        raise
    except Exception as e:  # whatever the plugin's top level raises: SyntaxError, ImportError, ...
        raise PluginError(f"rewards.plugins: {plugin}: failed to import: {type(e).__name__}: {e}") from e
    except BaseException as e:  # sys.exit(), exit(), KeyboardInterrupt: would end the scoring process
        what = f"{type(e).__name__}({e.code!r})" if isinstance(e, SystemExit) else type(e).__name__
        raise PluginError(f"rewards.plugins: {plugin}: raised {what} at import; a plugin's top level must only "
                          "define and register its rewards, never exit") from None
    after = registry.registered()
    if after == before and not registry.registered_by(module.__name__):
        raise PluginError(f"rewards.plugins: {plugin}: registered no reward; decorate its reward function with "
                          "@register(\"<data_source>\") from dph_async.rewards.registry (docs/rewards.md, Plugins)")


def _import_file(path: Path) -> ModuleType:
    """Execute a .py file as a module of its own, named after its resolved path."""
    if not path.is_file():
        raise PluginError(f"rewards.plugins: {path}: no such file")
    path = path.resolve()
    name = f"dph_reward_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"rewards.plugins: {path}: not a loadable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up while it runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
