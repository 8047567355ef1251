"""Config refusals, each with the message the docs promise: a wrong key or value names its dotted key
and what is allowed (README); a truncated sampling support is refused before any process starts
(docs/decisions.md); ZeRO-3 is refused with its reason; the CLI exits 2 with the message.
"""

from __future__ import annotations

import pytest

from dph_async.cli.main import main
from dph_async.config import ConfigError, LearnerConfig, dump_config, load_config, presets, with_overrides
from dph_async.pipeline import stages as pipeline
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import validate


def refusal(overrides: list[str], preset: str = "default") -> str:
    with pytest.raises(ConfigError) as e:
        load_config(preset, overrides)
    return str(e.value)


@pytest.mark.parametrize(("override", "key", "allowed"), [
    ("learner.stepz=3", "learner.stepz", "steps, groups_per_step"),
    ("nope=1", "nope", "seed, output_dir, mode"),
    ("learner.loss.objectiv=forward", "learner.loss.objectiv", "objective"),
])
def test_a_wrong_key_is_named_with_the_keys_allowed_there(override, key, allowed):
    msg = refusal([override])
    assert f"{key}: unknown key (allowed here: " in msg and allowed in msg


@pytest.mark.parametrize(("override", "key", "says"), [
    ("mode=fast", "mode", "'async' or 'sync'"),
    ("learner.loss.correction=naive", "learner.loss.correction", "'behavior', 'decoupled'"),
    ("learner.steps=0", "learner.steps", "greater than or equal to 1"),
    ("learner.steps=many", "learner.steps", "valid integer"),
    ("sampling.top_p=1.5", "sampling.top_p", "less than or equal to 1"),
    ("learner.weight_transport=udp", "learner.weight_transport", "'auto', 'tcp' or 'shm'"),
])
def test_a_wrong_value_is_named_with_what_is_allowed(override, key, says):
    msg = refusal([override])
    value = override.split("=")[1]
    assert f"{key}: " in msg and says in msg and value in msg.split(f"{key}: ")[1].split("(got ")[1]


def test_zero_stages_0_to_3_and_what_stage_3_refuses():
    assert [LearnerConfig(zero_stage=s).zero_stage for s in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert "learner.zero_stage" in refusal(["learner.zero_stage=4"])
    msg = refusal(["learner.zero_stage=3", "learner.diagnose_every=5"])
    assert "learner.diagnose_every" in msg and "zero_stage=3" in msg
    assert LearnerConfig(zero_stage=3, ranks=2).ranks == 2


def test_unknown_preset_and_malformed_override():
    assert all(p in refusal([], preset="nonexistent") for p in presets())
    assert "not of the form key=value" in refusal(["learner.steps"])
    assert "config file not found" in refusal([], preset="missing.yaml")



@pytest.mark.parametrize("preset", presets())
def test_overrides_on_a_loaded_config_equal_loading_with_them(preset):
    """A sweep parses its preset once and derives each cell from it: the same config as loading the
    preset with the sweep's overrides followed by the cell's, for every preset; a bad cell override is
    refused by name as on the command line."""
    sweep, cell = ["learner.steps=100", "seed=3"], ["replay.max_staleness=4", "learner.loss.coeff=200", "seed=7"]
    derived = with_overrides(load_config(preset, sweep), cell)
    assert dump_config(derived) == dump_config(load_config(preset, [*sweep, *cell]))
    assert derived.seed == 7 and derived.replay.max_staleness == 4
    with pytest.raises(ConfigError, match=r"learner\.stepz: unknown key"):
        with_overrides(derived, ["learner.stepz=3"])
    with pytest.raises(ConfigError, match="not of the form key=value"):
        with_overrides(derived, ["seed"])

@pytest.mark.parametrize(("override", "says"), [
    ("sampling.top_p=0.9", "sampling.top_p must be 1 and sampling.top_k -1"),
    ("sampling.top_k=50", "sampling.top_p must be 1 and sampling.top_k -1"),
    ("sampling.n=1", "sampling.n must be >= 2"),
    ("learner.sync_every=3", "replay.max_staleness (1) must be >= learner.sync_every - 1 (2)"),
    ("model.path=/nonexistent", "not a Hugging Face model directory"),
    ("task.data=/nonexistent.parquet", "task.data: no such file"),
    ("launcher.keep_actors_s=60", "launcher.keep_actors_s: Value error, actors can outlive this invocation only"),
])
def test_settings_the_run_cannot_honour_are_refused_before_it_starts(override, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        validate(load_config("default", [override]), [])


def test_actors_kept_on_a_cluster_need_time_to_hear_from_their_driver():
    with pytest.raises(ConfigError, match=r"launcher\.keep_actors_s: Value error, at least 10 s"):
        load_config("default", ["launcher.address=auto", "launcher.keep_actors_s=5"])
    assert load_config("default", ["launcher.address=auto", "launcher.keep_actors_s=10"]).launcher.keep_actors_s == 10


def test_the_gate_must_hold_two_of_the_largest_groups():
    with pytest.raises(ConfigError, match=r"^net\.gate_memory_mb \(100\) must be at least twice replay\.max_group_mb"):
        load_config("default", ["net.gate_memory_mb=100", "replay.max_group_mb=64"])
    assert load_config("default", ["net.gate_memory_mb=128", "replay.max_group_mb=64"]).net.gate_memory_mb == 128
    assert not load_config("default", ["net.gate=false", "net.gate_memory_mb=1", "replay.max_group_mb=64"]).net.gate


def test_compare_names_the_objectives():
    with pytest.raises(ConfigError, match="unknown objective 'gpro'; registered: grpo, "):
        validate(load_config("default"), [RunSpec.parse("grpo"), RunSpec.parse("gpro")])


def test_sync_mode_sets_its_own_staleness_and_sync():
    cfg = validate(load_config("default", ["mode=sync", "replay.max_staleness=4", "learner.sync_every=3"]), [])
    assert (cfg.replay.max_staleness, cfg.learner.sync_every) == (0, 1)


@pytest.mark.parametrize(("override", "says"), [
    ("learner.zero_stage=4", "less than or equal to 3"),
    ("sampling.top_p=0.5", "sampling.top_p must be 1"),
    ("learner.stepz=3", "learner.stepz: unknown key"),
])
def test_the_cli_exits_2_with_the_message_and_starts_nothing(override, says, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    started = []
    monkeypatch.setattr(pipeline, "ray_cluster", lambda cfg: started.append(cfg))
    assert main(["run", override, "--output", str(out)]) == 2
    printed = " ".join(capsys.readouterr().err.split())  # rich wraps long lines
    assert "error:" in printed and says in printed
    assert not started
    assert not (out / "base_model").exists() and not (out / "rl").exists()


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "42\n", "[learner, replay]\n"])
def test_a_yaml_file_whose_top_level_is_not_a_mapping_is_one_error(tmp_path, text, capsys):
    """Before: a list was a TypeError traceback ("Cannot merge incompatible container types") and a lone
    number an AssertionError, from `--preset my_run.yaml` and from `rerun` of a run whose
    learner_config.yaml had been damaged."""
    path = tmp_path / "my_run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{path}: not a mapping of settings"):
        load_config(str(path))
    assert main(["config", "--preset", str(path)]) == 2
    assert capsys.readouterr().err == (f"error: {path}: not a mapping of settings (its top level is a list or a "
                                       "single value)\n")
