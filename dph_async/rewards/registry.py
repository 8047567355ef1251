"""Reward functions keyed by a sample's `data_source` (the verl convention).

    @register("openai/gsm8k")
    def gsm8k(response: str, ground_truth: Any, extra_info: dict) -> RewardResult: ...

    @register("_mathverify", suffix=True)      # "deepscaler_mathverify", "aime_mathverify", ...
    def mathverify(...): ...

    @register("my_task", inline=True)          # safe to score in the caller's process (see below)

Lookup: an exact name wins; otherwise the longest registered suffix tag that the source ends with.
Anything else raises `UnknownDataSource`: a mistyped source must not be scored by some default.
The built-in reward modules register themselves when first imported; they are imported lazily, on the
first lookup, so importing this module stays cheap.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from typing import Any

from dph_async.errors import UserError
from dph_async.rewards.result import RewardResult

RewardFn = Callable[[str, Any, dict], RewardResult]

# Modules whose import registers rewards. A module that does not exist is reported in lookup errors,
# not raised here, so one missing optional module leaves the others usable.
BUILTIN_MODULES = [
    "dph_async.rewards.sql",
    "dph_async.rewards.math_score",
    "dph_async.rewards.countdown",
    "dph_async.rewards.grade",
    "dph_async.rewards.tinyv",
    "dph_async.tasks.embedded",
    "dph_async.tasks.stride",
]

_exact: dict[str, RewardFn] = {}
_suffix: dict[str, RewardFn] = {}
# Rewards registered with inline=True: pure functions whose cost is bounded by the response's length
# and that execute nothing from it (no SQL, no parser that can hang), so a caller may score them in
# its own process instead of a killable worker.
_inline: set[RewardFn] = set()
_missing: dict[str, str] = {}
_loaded = False
_lock = threading.Lock()


class UnknownDataSource(UserError):
    """No reward is registered for a data_source."""

    def __init__(self, data_source: str, message: str | None = None) -> None:
        # `message` carries a scorer service's wording; otherwise it is built from this registry.
        super().__init__(message or self._describe(data_source))
        self.data_source = data_source

    @staticmethod
    def _describe(data_source: str) -> str:
        names = ", ".join(sorted(_exact)) or "(none)"
        tags = ", ".join(sorted(_suffix)) or "(none)"
        msg = (f"no reward registered for data_source {data_source!r}; "
               f"exact names: {names}; suffix tags: {tags}")
        if _missing:
            missing = ", ".join(f"{m} ({why})" for m, why in sorted(_missing.items()))
            msg += f"; modules not available: {missing}"
        return msg


def register(name: str, *, suffix: bool = False, inline: bool = False) -> Callable[[RewardFn], RewardFn]:
    """Register a reward function under an exact data_source, or a suffix tag with `suffix=True`;
    `inline=True` declares it safe to run in the caller's process (see `_inline`)."""
    if not name:
        raise ValueError("a reward name must not be empty")
    table = _suffix if suffix else _exact

    def decorator(fn: RewardFn) -> RewardFn:
        other = table.get(name)
        if other is not None and other is not fn:
            kind = "suffix tag" if suffix else "name"
            owner = f"{other.__module__}.{other.__name__}"
            raise ValueError(f"reward {kind} {name!r} is already registered by {owner}")
        table[name] = fn
        if inline:
            _inline.add(fn)
        return fn

    return decorator


def load_builtins() -> None:
    """Import the built-in reward modules once (thread-safe)."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        for module in BUILTIN_MODULES:
            try:
                importlib.import_module(module)
            except ModuleNotFoundError as e:
                # Only the module itself being absent is tolerated; a dependency missing inside an
                # existing module is a real error and propagates.
                if e.name is None or not (module == e.name or module.startswith(e.name + ".")):
                    raise
                _missing[module] = "not installed"
        _loaded = True


def get_reward_fn(data_source: str) -> RewardFn:
    """The reward function for a data_source: exact name first, then the longest matching suffix tag."""
    load_builtins()
    fn = _exact.get(data_source)
    if fn is not None:
        return fn
    tags = [tag for tag in _suffix if data_source.endswith(tag)]
    if tags:
        return _suffix[max(tags, key=len)]
    raise UnknownDataSource(data_source)


def is_inline(data_source: str) -> bool:
    """Whether the reward for `data_source` may run in the caller's process (False if unknown)."""
    try:
        return get_reward_fn(data_source) in _inline
    except UnknownDataSource:
        return False


def registered() -> dict[str, list[str]]:
    """The registered exact names and suffix tags (for help texts and error messages)."""
    load_builtins()
    return {"exact": sorted(_exact), "suffix": sorted(_suffix)}


def registered_by(module: str) -> list[str]:
    """The names and suffix tags whose reward function is defined in `module`."""
    return sorted(name for table in (_exact, _suffix) for name, fn in table.items() if fn.__module__ == module)
