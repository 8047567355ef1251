"""Reward plugins: the user's own reward functions, from a module name or a `.py` file.

    rewards.plugins: [my_rewards.py, my_package.rewards]

A plugin registers its rewards when imported, with `@register` from `dph_async.rewards.registry`,
as the built-in rewards do. Every process that scores loads the plugins of its config: each reward
worker, the process that owns a worker pool (it checks data sources before scoring), the scorer
service, and the driver of `dph-async run`, `eval` and `presample` before anything starts, so a
broken plugin is one error naming it rather than a failure inside a worker.

Before a process imports a plugin it has a fresh interpreter import it (`python -m
dph_async.rewards.plugins PLUGIN`): a top level that ends its process (os._exit, a crash) cannot be
caught where it runs, and would end the caller with no word (`dph-async score` exited 0 with no output).
A reward worker skips this: the process that started it imported the same plugins first.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import signal
import subprocess
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
PROBE_TIMEOUT_S = 120.0  # an import of torch or transformers on a busy machine fits
_IMPORTED = b"dph-async: plugin imported"


def load_plugins(plugins: Iterable[str], *, probe: bool = True) -> None:
    """Import each plugin (a module name, or a path ending in .py) once per process, each first in a fresh
    interpreter unless `probe` is False (see the module's docstring)."""
    with _lock:
        for plugin in plugins:
            if plugin not in _loaded:
                if probe:
                    _probe(plugin)
                _load(plugin)
                _loaded.add(plugin)


def _probe(plugin: str) -> None:
    """PluginError if importing `plugin` ends the process that imports it. One that raises is left to the
    import here, which names what it raised; so is one the fresh interpreter cannot find (a module on a
    path this process added), since there it raises too."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # what this process sees
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, plugin], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PluginError(f"rewards.plugins: {plugin}: its import did not finish within {PROBE_TIMEOUT_S:.0f} s "
                          "(in a fresh interpreter)") from None
    if proc.returncode == 0 and proc.stdout.endswith(_IMPORTED):
        return
    code = proc.returncode
    how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
    raise PluginError(f"rewards.plugins: {plugin}: ended its process at import ({how}; os._exit or a crash); a "
                      "plugin's top level must only define and register its rewards, never exit")


def _load(plugin: str) -> None:
    # Built-ins first: a plugin that reuses a built-in name fails here, naming itself, and not later
    # inside whichever lookup happens to import the built-ins.
    registry.load_builtins()
    before = registry.registered()
    try:
        module = _import(plugin)
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


def _import(plugin: str) -> ModuleType:
    return _import_file(Path(plugin)) if plugin.endswith(".py") else importlib.import_module(plugin)


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


if __name__ == "__main__":
    # python -m dph_async.rewards.plugins PLUGIN: the probe. Whether the import returns or raises, the
    # process goes on to the marker; the caller's own import names what it raised.
    with contextlib.suppress(BaseException):
        _import(sys.argv[1])
    sys.stdout.buffer.write(b"\n" + _IMPORTED)
    sys.stdout.flush()
