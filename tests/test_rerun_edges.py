"""`dph-async rerun`'s own logic (dph_async/pipeline/rerun.py) around a stand-in trainer, in seconds: what it
compares (metrics bit for bit, weights and their distance), which recorded batches it feeds from which
version, where it stops, what it writes. The real trainer's rerun: tests/test_rerun.py."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_rerun import batches

from dph_async.cli.commands.rerun import add_arguments
from dph_async.config import load_config
from dph_async.learner.recording import RECORDING, BatchRecorder, write_run_info
from dph_async.learner.staleness_control import StalenessController, StalenessRule
from dph_async.paths import final_model
from dph_async.pipeline import rerun as R
from dph_async.pipeline.rerun_report import HEADLINE, WeightCheck
from dph_async.safe_files import UnsafeFile

# ---------------------------------------------------------------------------------------------
# Comparing a step's metrics.


def test_a_step_s_metrics_are_compared_bit_for_bit_and_the_clock_s_left_out():
    run = {"loss/total": 0.5, "a": 0.0, "b": float("nan"), "c": 1.0, "only_run": 2.0, "time/x": 1.0,
           "learner/step_seconds": 3.0, "learner/tokens_per_s": 9.0, "policy/ess": 0.75}
    rerun = {"loss/total": 0.5000000000000001, "a": -0.0, "b": float("nan"), "c": 1, "only_rerun": 2.0,
             "time/x": 7.0, "learner/step_seconds": 4.0, "learner/tokens_per_s": 1.0, "policy/ess": 0.75}
    step = R.compare_step(7, run, rerun)
    assert step.version == 7
    assert step.differing == ["a", "loss/total", "only_rerun", "only_run"]
    assert step.run == {"loss/total": 0.5, "policy/ess": 0.75}
    assert step.rerun == {"loss/total": 0.5000000000000001, "policy/ess": 0.75}


def test_a_step_the_run_did_not_log_is_named_as_such():
    step = R.compare_step(3, None, {"loss/total": 1.0, "z": 2.0})
    assert (step.differing, step.run, step.rerun) == (["(the run logged no metrics here)"], {}, {"loss/total": 1.0})
    assert R.compare_step(3, {}, {}).differing == []


def test_the_headline_keeps_every_headline_metric_and_only_those():
    m = {k: float(i) for i, k in enumerate(HEADLINE)} | {"other": 1.0}
    assert R.compare_step(1, m, m).run == {k: float(i) for i, k in enumerate(HEADLINE)}


# ---------------------------------------------------------------------------------------------
# Comparing weights.


def t(*values: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


@pytest.mark.parametrize(("ours", "theirs", "want"), [
    ({"a": t(3, 4), "b": t(1)}, {"a": t(3, 4), "b": t(1)}, (True, 0.0, 0.0)),
    ({"a": t(3, 5), "b": t(0)}, {"a": t(3, 4), "b": t(0)}, (False, 1 / 5, 1.0)),
    # Two tensors: squares summed over both before the ratio; the largest difference of either.
    ({"a": t(1, 2), "b": t(2, 4)}, {"a": t(0, 0), "b": t(2, 2)}, (False, math.sqrt(9 / 8), 2.0)),
    ({"a": t(3, 4)}, {"a": t(0, 0)}, (False, 5.0, 4.0)),  # the run's weights all zero: the absolute distance
    ({"a": t(3, 4, dtype=torch.float64)}, {"a": t(3, 4)}, (False, 0.0, 0.0)),  # equal values, another dtype
    ({"a": t(3, 4, 0)}, {"a": t(3, 4)}, (False, math.inf, math.inf)),  # another shape
    ({"a": t(), "b": t(-2)}, {"a": t(), "b": t(1)}, (False, 3.0, 3.0)),  # an empty tensor adds nothing
    ({"a": t(1), "tied": t(5)}, {"a": t(1)}, (True, 0.0, 0.0)),  # a saved model leaves tied tensors out
])
def test_weights_are_equal_only_bitwise_and_their_distance_is_relative_to_the_run_s(ours, theirs, want):
    check = R.compare_weights("checkpoint v4", 4, ours, theirs)
    assert (check.what, check.version) == ("checkpoint v4", 4)
    assert (check.equal, check.distance, check.max_abs) == pytest.approx(want)


def test_a_tensor_the_rerun_lacks_is_an_error_naming_five_of_them():
    theirs = {f"w{i}": t(1) for i in range(7)}
    with pytest.raises(R.RerunError, match=r"^final model: tensors \['w0', 'w1', 'w2', 'w3', 'w4'\] are not in "
                                           r"the rerun's model \(another architecture\?\)$"):
        R.compare_weights("final model", 6, {"w6": t(1)}, theirs)


# ---------------------------------------------------------------------------------------------
# The run's files: metrics, recording, config.


def test_a_run_without_metrics_has_none_and_a_damaged_first_line_is_named(tmp_path):
    assert R._run_metrics(tmp_path) == []
    (tmp_path / "metrics.jsonl").write_text('{"a": \n')
    with pytest.raises(R.RerunError, match=r"metrics\.jsonl: line 1 is not a JSON record of a step's metrics"):
        R._run_metrics(tmp_path)


def record(path: Path, versions: list[int]) -> list[int]:
    """A recording of batches of these versions; the byte offset of each record."""
    made = {b.version: b for b in batches(max(versions) + 1)}
    recorder = BatchRecorder(path)
    offsets = []
    for v in versions:
        offsets.append(path.stat().st_size)
        recorder.append(made[v])
    recorder.close()
    return offsets


@pytest.mark.parametrize("start", [0, 2, 4])
def test_the_batches_are_fed_from_the_start_version_on(tmp_path, start):
    path = tmp_path / RECORDING
    record(path, [0, 1, 2, 3, 4])
    assert [b.version for b in R._batches(path, start)] == list(range(start, 5))
    assert list(R._batches(path, 5)) == []


def test_a_missing_version_is_refused_with_the_record_s_offset(tmp_path):
    path = tmp_path / RECORDING
    offsets = record(path, [0, 1, 3])
    fed = []
    with pytest.raises(R.RerunError) as refused:
        fed.extend(b.version for b in R._batches(path, 0))
    assert fed == [0, 1]
    assert str(refused.value) == f"{path}: the record at byte {offsets[2]} is of version 3, the learner is at 2"


def test_a_recording_that_starts_later_names_the_checkpoint_to_start_from(tmp_path):
    path = tmp_path / RECORDING
    offsets = record(path, [3, 4])
    with pytest.raises(R.RerunError) as refused:
        list(R._batches(path, 1))
    assert str(refused.value) == (f"{path}: the record at byte {offsets[0]} is of version 3, the learner is at 1: "
                                  "rerun --from 3, a checkpoint of the run")


AUTO = ["replay.max_staleness=auto", "replay.staleness_min=1", "replay.staleness_max=16", "replay.staleness_window=2",
        "replay.staleness_min_wait=0", "replay.staleness_target_ess=0.5"]
RULE = StalenessRule.of(load_config("default", AUTO).replay)


def recorded_run(tmp_path: Path, extra: list[str] | None = None, versions: range = range(5)) -> Path:
    rl_dir = tmp_path / "run" / "rl" / "grpo"
    rl_dir.mkdir(parents=True)
    model = tmp_path / "run" / "base_model"
    model.mkdir()
    write_run_info(rl_dir, load_config("default", [*AUTO, *(extra or [])]), model)
    record(rl_dir / RECORDING, list(versions))
    return rl_dir


def test_the_learner_config_is_the_run_s_and_an_override_makes_a_counterfactual(tmp_path):
    rl_dir = recorded_run(tmp_path, versions=range(1))
    cfg, changed = R._learner_config(rl_dir, [])
    assert not changed and cfg.replay.auto_staleness
    cfg, changed = R._learner_config(rl_dir, ["learner.lr=0.125"])
    assert changed and cfg.learner.lr == 0.125


def test_a_run_of_several_learner_ranks_is_rerun_on_one_only_when_asked(tmp_path):
    rl_dir = recorded_run(tmp_path, ["learner.ranks=2"], range(1))
    with pytest.raises(R.RerunError, match=r"^the run's learner has 2 ranks; a rerun trains on one: add "
                                           r"learner.ranks=1 \(a counterfactual then"):
        R._learner_config(rl_dir, [])
    assert R._learner_config(rl_dir, ["learner.ranks=1"])[1]


# ---------------------------------------------------------------------------------------------
# A rerun around a stand-in trainer.


class StandInTrainer:
    """The trainer's interface. Each step adds (the batch's version + 1) to every weight, so the
    weights and the loss differ from step to step; `load` starts from a checkpoint's weights."""

    def __init__(self, checkpoints: dict[int, dict]) -> None:
        self.checkpoints = checkpoints
        self.version, self.w, self.closed, self.saved = 0, torch.zeros(3), False, []

    def train_step(self, batch) -> dict[str, float]:
        self.w += batch.version + 1
        self.version += 1
        return {"loss/total": float(self.w.sum()), "policy/ess": 0.9, "learner/step_seconds": 0.01,
                "staleness/max": float(batch.version % 3)}

    def whole_state(self) -> dict[str, torch.Tensor]:
        return {"w": self.w.clone()}

    def load(self, directory: Path, tag: str) -> dict:
        self.loaded_from = directory / tag
        self.version = int(tag[1:])
        self.w = self.checkpoints[self.version]["w"].clone()
        return self.checkpoints[self.version]["state"]

    def save_pretrained(self, path: str) -> None:
        self.saved.append(path)
        save_file({"w": self.w}, str(Path(path) / "model.safetensors"))
        (Path(path) / "config.json").write_text("{}")

    def close(self) -> None:
        self.closed = True


class StandInTokenizer:
    def save_pretrained(self, path: str) -> None:
        (Path(path) / "tokenizer.json").write_text("{}")


def the_run_s(steps: int) -> tuple[list[dict], dict[int, dict]]:
    """What the stand-in trainer logs after each of `steps` steps of the recorded batches, and what a
    checkpoint of each version holds (weights, the controller's state: its bound grows, 1, 2, 4)."""
    trainer, rows, checkpoints = StandInTrainer({}), [], {}
    controller = StalenessController(RULE)
    for batch in batches(steps):
        m = trainer.train_step(batch)
        R.finish_metrics(m, batch, controller)
        rows.append(m)
        checkpoints[trainer.version] = {"w": trainer.w.clone(), "state": {"staleness": controller.state()}}
    return rows, checkpoints


@pytest.fixture
def standin(monkeypatch):
    """The rerun module with a stand-in trainer, and the run's checkpoints at v2 and v4; returns the
    trainers it built, the model directories it checked, the run's metrics and weights per version."""
    rows, states = the_run_s(5)
    checkpoints = {v: states[v] for v in (2, 4)}
    weights = {v: states[v]["w"] for v in states}
    built: list[StandInTrainer] = []
    models: list[Path] = []

    def build(cfg, model_dir, device):
        built.append(StandInTrainer(checkpoints))
        built[-1].built_with = (cfg, model_dir, device)
        return built[-1], StandInTokenizer()

    monkeypatch.setattr(R, "build_trainer", build)
    monkeypatch.setattr(R, "check_model_dir", lambda path, key: models.append((Path(path), key)))
    monkeypatch.setattr(R, "is_learner_checkpoint", lambda tag: tag.parent.name == "checkpoints"
                        and tag.name in {f"v{v}" for v in checkpoints})
    monkeypatch.setattr(R, "checkpoint_weights", lambda tag: {"w": checkpoints[int(tag.name[1:])]["w"]})
    return built, models, rows, weights


def write_run(rl_dir: Path, rows: list[dict], final: torch.Tensor | None) -> None:
    (rl_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if final is not None:
        final_model(rl_dir).mkdir()
        (final_model(rl_dir) / "config.json").write_text("{}")
        save_file({"w": final}, str(final_model(rl_dir) / "model.safetensors"))


def test_a_rerun_of_the_run_s_steps_is_the_run(tmp_path, standin):
    built, models, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    write_run(rl_dir, rows, weights[5])
    report = R.rerun(rl_dir, tmp_path / "out", [])
    assert models == [(tmp_path / "run" / "base_model", f"{rl_dir / 'recording.json'}: model_dir")]
    cfg, model_dir, device = built[0].built_with
    assert (cfg.replay.staleness_window, model_dir, device) == (2, str(tmp_path / "run" / "base_model"), None)
    assert (report.run_dir, report.out, report.overrides) == (str(rl_dir), str(tmp_path / "out"), [])
    assert (report.start, report.end, report.stopped) == (0, 5, "the recording ends at version 5")
    assert [(s.version, s.differing) for s in report.steps] == [(v, []) for v in range(1, 6)]
    assert report.weights == [WeightCheck("checkpoint v2", 2, True, 0.0, 0.0),
                              WeightCheck("checkpoint v4", 4, True, 0.0, 0.0),
                              WeightCheck("final model", 5, True, 0.0, 0.0)]
    assert report.bitwise and built[0].closed and built[0].saved == []  # not a counterfactual: no model written
    logged = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert logged == rows
    assert json.loads((tmp_path / "out" / "report.json").read_text())["bitwise"]
    assert (tmp_path / "out" / "learner_config.yaml").read_text().count("max_staleness: auto") == 1


def test_each_step_is_compared_with_the_run_s_step_of_its_version(tmp_path, standin):
    _, _, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    changed = [dict(r) for r in rows[:4]]
    changed[2]["loss/total"] += 1  # the run's step to version 3
    write_run(rl_dir, changed, weights[5])
    report = R.rerun(rl_dir, tmp_path / "out", [])
    assert [(s.version, s.differing) for s in report.steps] == [
        (1, []), (2, []), (3, ["loss/total"]), (4, []), (5, ["(the run logged no metrics here)"])]
    # The run logged 4 steps: its final model is of version 4, not compared with the rerun's at 5.
    assert [w.what for w in report.weights] == ["checkpoint v2", "checkpoint v4"]


def test_a_rerun_from_a_checkpoint_until_a_version_starts_and_stops_there(tmp_path, standin):
    built, _, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    write_run(rl_dir, rows, weights[5])
    report = R.rerun(rl_dir, tmp_path / "out", [], start=2, until=4)
    assert (report.start, report.end, report.stopped) == (2, 4, "--until 4")
    assert [(s.version, s.differing) for s in report.steps] == [(3, []), (4, [])]
    assert [w.what for w in report.weights] == ["checkpoint v4"] and built[0].version == 4
    assert built[0].loaded_from == rl_dir / "checkpoints" / "v2"
    # The controller's state came from the checkpoint (its bound there, not the rule's minimum): the
    # bound it decides at v4 is the run's.
    logged = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["staleness/eta"] for m in logged] == [rows[2]["staleness/eta"], rows[3]["staleness/eta"]] == [2.0, 4.0]


def test_a_rerun_until_its_start_trains_nothing(tmp_path, standin):
    _, _, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    write_run(rl_dir, rows, weights[5])
    report = R.rerun(rl_dir, tmp_path / "out", [], start=4, until=4)
    assert (report.end, report.stopped, report.steps) == (4, "--until 4", [])
    report = R.rerun(rl_dir, tmp_path / "out2", [], start=2, until=None)
    assert (report.end, report.stopped) == (5, "the recording ends at version 5")


def test_a_recording_with_nothing_from_the_start_on_ends_there(tmp_path, standin):
    rl_dir = recorded_run(tmp_path, versions=range(2))
    report = R.rerun(rl_dir, tmp_path / "out", [], start=2)
    assert (report.start, report.end, report.stopped, report.steps) == (2, 2, "the recording ends at version 2", [])


def test_a_counterfactual_writes_its_final_model_over_an_earlier_one(tmp_path, standin):
    built, _, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    write_run(rl_dir, rows, weights[5])
    out = tmp_path / "out"
    final_model(out).mkdir(parents=True)
    (final_model(out) / "stale.bin").write_text("an earlier rerun's")
    report = R.rerun(rl_dir, out, ["learner.lr=0.5"])
    assert report.counterfactual and report.end == 5
    # Written under a hidden name beside it, then renamed: no reader sees half a model.
    [written] = built[0].saved
    assert Path(written).parent == out and Path(written).name.startswith(".final_model-")
    assert sorted(p.name for p in final_model(out).iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert [p.name for p in out.iterdir() if p.name.startswith(".final_model")] == []
    shutil.rmtree(final_model(out))
    final_model(out).write_text("a file where the model goes")
    R.rerun(rl_dir, out, ["learner.lr=0.5"], until=1)
    assert (final_model(out) / "config.json").is_file()


def test_a_final_model_that_cannot_be_written_leaves_nothing_half_written(tmp_path, standin):
    built, _, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    write_run(rl_dir, rows, weights[5])

    def fails(path: str) -> None:
        (Path(path) / "part").write_text("half")
        raise OSError("disk full")

    out = tmp_path / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StandInTrainer, "save_pretrained", lambda self, path: fails(path))
        with pytest.raises(OSError, match="disk full"):
            R.rerun(rl_dir, out, ["learner.lr=0.5"], until=1)
    assert sorted(p.name for p in out.iterdir()) == ["learner_config.yaml", "metrics.jsonl"]
    assert built[0].closed


def test_the_diagnosed_step_is_the_one_named(tmp_path, standin, monkeypatch):
    _, _, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    write_run(rl_dir, rows, weights[5])
    diagnosed = []

    def diagnose(trainer, batch, top_tokens):
        diagnosed.append((trainer.version, batch.version, top_tokens))
        return WeightCheck("diagnosis", trainer.version, True, 0.0, 0.0)

    monkeypatch.setattr(R, "diagnose_step", diagnose)
    R.rerun(rl_dir, tmp_path / "out", [], diagnose=3, top_tokens=7)
    assert diagnosed == [(3, 3, 7)]
    assert json.loads((tmp_path / "out" / "diagnose_v3.json").read_text())["version"] == 3
    # Without a number: as many tokens as the command lists by default.
    R.rerun(rl_dir, tmp_path / "out2", [], diagnose=1)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert diagnosed[-1] == (1, 1, parser.parse_args(["run"]).top_tokens)


def test_a_rerun_refuses_a_run_without_a_recording_or_the_checkpoint_asked_for(tmp_path, standin):
    built, _, _, _ = standin
    rl_dir = recorded_run(tmp_path, versions=range(1))
    with pytest.raises(R.RerunError, match=r"^.*checkpoints/v3: no checkpoint of version 3 \(--from names one"):
        R.rerun(rl_dir, tmp_path / "out", [], start=3)
    (rl_dir / RECORDING).unlink()
    with pytest.raises(R.RerunError, match=rf"^{rl_dir / RECORDING} not found: the run recorded no batches "
                                           r"\(learner.record_batches was off\)$"):
        R.rerun(rl_dir, tmp_path / "out", [])
    assert built == []  # refused before a trainer was built


def test_a_trainer_that_fails_to_load_its_checkpoint_is_closed(tmp_path, standin):
    built, _, _, _ = standin
    rl_dir = recorded_run(tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(StandInTrainer, "load", lambda self, d, tag: (_ for _ in ()).throw(OSError("damaged")))
        with pytest.raises(OSError, match="damaged"):
            R.rerun(rl_dir, tmp_path / "out", [], start=2)
    assert built[0].closed


def test_a_link_where_the_final_model_goes_is_refused_not_followed(tmp_path, standin):
    built, _, rows, weights = standin
    rl_dir = recorded_run(tmp_path)
    write_run(rl_dir, rows, weights[5])
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    final_model(out).symlink_to(elsewhere)
    with pytest.raises(UnsafeFile) as refused:
        R.rerun(rl_dir, out, ["learner.lr=0.5"], until=1)
    assert str(refused.value) == (f"{final_model(out)}: a symbolic link, where the rerun's final model belongs; "
                                  "not followed")
    assert not any(elsewhere.iterdir()) and built[0].saved == []


def test_a_run_without_auto_staleness_is_rerun_without_a_controller_even_from_a_checkpoint_that_has_one(
        tmp_path, standin):
    """A checkpoint may hold a controller's state (the run's config was changed since, or an override
    turns auto off): without auto staleness there is none to restore, and no staleness metric."""
    rl_dir = recorded_run(tmp_path, ["replay.max_staleness=2"])
    trainer = StandInTrainer({})
    run_rows = []
    for batch in batches(5):
        m = trainer.train_step(batch)
        R.finish_metrics(m, batch, None)
        run_rows.append(m)
    write_run(rl_dir, run_rows, None)
    report = R.rerun(rl_dir, tmp_path / "out", [], start=2)
    assert [(s.version, s.differing) for s in report.steps] == [(3, []), (4, []), (5, [])]
    logged = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert not any(k.startswith("staleness/") and k != "staleness/max" for m in logged for k in m)
