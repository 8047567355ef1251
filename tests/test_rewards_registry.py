"""The data_source registry: exact names, suffix tags with explicit precedence, loud unknown sources."""

import importlib

import pytest

from dph_async.rewards import registry
from dph_async.rewards.registry import UnknownDataSource, get_reward_fn, register, registered
from dph_async.rewards.result import RewardResult


def _reward(score: float):
    def fn(response, ground_truth, extra_info):
        return RewardResult(score=score, correct=score == 1.0)

    return fn


def test_exact_name_wins_over_suffix_tags():
    exact, short, long = _reward(1.0), _reward(0.25), _reward(0.5)
    register("regtest_ds_mathverify")(exact)
    register("_mathverify_regtest", suffix=True)(short)
    register("long_mathverify_regtest", suffix=True)(long)
    assert get_reward_fn("regtest_ds_mathverify") is exact
    # Both tags match "x_long_mathverify_regtest": the longer one is more specific and wins.
    assert get_reward_fn("x_long_mathverify_regtest") is long
    assert get_reward_fn("other_mathverify_regtest") is short


def test_unknown_source_raises_naming_it_and_the_registered_ones():
    with pytest.raises(UnknownDataSource) as info:
        get_reward_fn("no_such_source_xyz")
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "no_such_source_xyz" in message
    for name in ("sql", "bird", "spider", "countdown", "grade", "openai/gsm8k", "_tinyv", "_mathverify"):
        assert name in message


def test_registering_a_name_twice_with_another_function_is_an_error():
    register("regtest_dup")(first := _reward(1.0))
    register("regtest_dup")(first)  # the same function again is harmless (module re-import)
    with pytest.raises(ValueError, match="already registered"):
        register("regtest_dup")(_reward(0.0))


def test_builtin_modules_include_the_embedded_task_and_import():
    assert "dph_async.tasks.embedded" in registry.BUILTIN_MODULES
    for module in registry.BUILTIN_MODULES:
        if module.startswith("dph_async.rewards."):
            importlib.import_module(module)
    names = registered()
    assert {"sql", "bird", "spider", "countdown", "grade", "openai/gsm8k", "math"} <= set(names["exact"])
    assert {"_tinyv", "_mathverify"} <= set(names["suffix"])


def test_known_sources_resolve_to_their_modules():
    assert get_reward_fn("bird").__module__ == "dph_async.rewards.sql"
    assert get_reward_fn("deepscaler_mathverify").__module__ == "dph_async.rewards.math_score"
    assert get_reward_fn("polaris_tinyv").__module__ == "dph_async.rewards.tinyv"
    assert get_reward_fn("countdown").__module__ == "dph_async.rewards.countdown"
