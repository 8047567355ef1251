"""Reward plugins: a user's own reward, from a .py file or a module name in `rewards.plugins`, loaded by
every process that scores, and one clear error naming the plugin when it cannot be used."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import ROOT, SMALL, stub_model_dir
from fastapi.testclient import TestClient

from dph_async.cli.main import main
from dph_async.config import ConfigError, load_config
from dph_async.pipeline.stages import validate
from dph_async.rewards.plugins import PluginError, load_plugins
from dph_async.rewards.scorer import make_scorer
from dph_async.rewards.service import make_app
from dph_async.rewards.worker import ScoreRequest
from dph_async.tasks.dataset import verl_row, write_rows

# A user's reward: the share of vowels in the response, correct when there are exactly ground_truth;
# `detail` says which process scored it.
PLUGIN = '''
import os

from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult


@register("{source}")
def vowels(response, ground_truth, extra_info):
    n = sum(c in "aeiou" for c in response)
    return RewardResult(score=n / len(response), correct=n == int(ground_truth), detail=str(os.getpid()))
'''


def write_plugin(where: Path, name: str) -> str:
    """A plugin file `name`.py under `where`; returns the data_source it registers (unique per test,
    since the registry is per process)."""
    source = f"vowels_{uuid.uuid4().hex[:8]}"
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.py").write_text(PLUGIN.format(source=source))
    return source


RESPONSES = ["banana", "rhythm", "queue", "aeiou xyz"]


def expected(response: str) -> float:
    return sum(c in "aeiou" for c in response) / len(response)


@pytest.mark.parametrize("inline", [True, False])
def test_a_plugin_file_in_the_config_scores_where_the_config_says(tmp_path, monkeypatch, inline):
    source = write_plugin(tmp_path, "my_reward")
    monkeypatch.chdir(tmp_path)  # the file is given relative to where the user is
    cfg = load_config("default", ["rewards.plugins=[my_reward.py]", f"rewards.inline={inline}",
                                  "rewards.workers=1"]).rewards
    assert cfg.plugins == [str(tmp_path / "my_reward.py")]  # absolute: workers may start elsewhere
    monkeypatch.chdir("/")
    requests = [ScoreRequest(source, r, 2, {}) for r in RESPONSES]
    with make_scorer(cfg) as scorer:
        results = scorer.score_many(requests)
    assert [r.score for r in results] == pytest.approx([expected(r) for r in RESPONSES])
    assert [r.correct for r in results] == [sum(c in "aeiou" for c in r) == 2 for r in RESPONSES]
    # Registered without inline=True, it runs in a killable worker process whatever rewards.inline says.
    assert all(r.status == "ok" and r.detail != str(os.getpid()) for r in results)


def test_a_plugin_module_named_in_a_run_config_file(tmp_path, monkeypatch):
    source = write_plugin(tmp_path / "site", "team_rewards")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    stub_model_dir(tmp_path / "model")  # passes the checks before start
    data = write_rows([verl_row("say banana", source, 3, 0, "train")], tmp_path / "train.parquet")
    run_config = tmp_path / "run.yaml"
    run_config.write_text(f"model: {{path: {tmp_path / 'model'}}}\ntask: {{data: {data}}}\n"
                          "rewards: {plugins: [team_rewards]}\n")
    cfg = validate(load_config(str(run_config)), [])  # the checks `dph-async run` makes before starting
    assert cfg.rewards.plugins == ["team_rewards"]
    request = ScoreRequest(source, "banana", 3, {})
    # The reward workers are fresh interpreters: a module plugin must be importable there too.
    with make_scorer(cfg.rewards) as scorer:
        [result] = scorer.score_many([request])
    assert result.status == "error" and "team_rewards: failed to import: ModuleNotFoundError" in result.detail
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    with make_scorer(cfg.rewards) as scorer:
        [result] = scorer.score_many([request])
    assert result.score == pytest.approx(0.5) and result.correct
    # A data set with a source that no reward serves is refused before anything starts.
    other = write_rows([verl_row("q", source + "x", 3, 0, "train")], tmp_path / "other.parquet")
    with pytest.raises(ConfigError, match=re.escape(f"task.data: {other}: no reward registered for "
                                                     f"data_source '{source}x'")):
        validate(load_config(str(run_config), [f"task.data={other}"]), [])


def test_dph_async_score_with_a_plugin(tmp_path, capsys):
    source = write_plugin(tmp_path, "cli_reward")
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps({"data_source": source, "response": r,
                                             "reward_model": {"ground_truth": 2}}) + "\n" for r in RESPONSES))
    out = tmp_path / "results.jsonl"
    assert main(["score", str(responses), f"rewards.plugins=[{tmp_path / 'cli_reward.py'}]", "--out", str(out)]) == 0
    scores = [json.loads(line)["score"] for line in out.read_text().splitlines()]
    assert scores == pytest.approx([expected(r) for r in RESPONSES])


@pytest.mark.parametrize(("text", "says"), [
    ("def broken(:\n", "failed to import: SyntaxError"),
    ("import no_such_module_xyz\n", "failed to import: ModuleNotFoundError"),
    ("X = 1\n", "registered no reward"),
    ("from dph_async.rewards.registry import register\n@register('countdown')\ndef f(r, g, e): ...\n",
     "reward name 'countdown' is already registered"),
    ("import sys\nsys.exit(0)\n", "raised SystemExit(0) at import; a plugin's top level must only define and "
                                 "register its rewards, never exit"),
    ("raise SystemExit('bye')\n", "raised SystemExit('bye') at import"),
    ("raise KeyboardInterrupt\n", "raised KeyboardInterrupt at import"),
])
def test_a_plugin_that_cannot_be_used_is_named(tmp_path, text, says):
    plugin = tmp_path / f"p{uuid.uuid4().hex[:8]}.py"
    plugin.write_text(text)
    with pytest.raises(PluginError, match="^" + re.escape(f"rewards.plugins: {plugin}: ")) as info:
        load_plugins([str(plugin)])
    assert says in str(info.value)
    if "import" in says:
        assert not [m for m in sys.modules if plugin.stem in m]  # nothing half-imported is left behind


@pytest.mark.parametrize(("exits", "says"), [
    ("import sys\nsys.exit(0)\n", "raised SystemExit(0) at import"),
    ("import os\nos._exit(0)\n", "ended its process at import (exit code 0; os._exit or a crash)"),
    ("import os\nos.abort()\n", "ended its process at import (killed by SIGABRT; os._exit or a crash)"),
])
def test_dph_async_score_with_a_plugin_that_exits_at_import(tmp_path, exits, says):
    """Before: `dph-async score` ended with exit 0 and nothing scored (os._exit: not even a line). In a
    process of its own, so that a regression ends that process and not the test session."""
    plugin = tmp_path / "leaves.py"
    plugin.write_text(exits)
    responses = tmp_path / "responses.jsonl"
    responses.write_text(json.dumps({"data_source": "countdown", "response": "x", "reward_model": {"ground_truth": 1}}))
    proc = subprocess.run([sys.executable, "-m", "dph_async.cli.main", "score", str(responses),
                           f"rewards.plugins=[{plugin}]"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.splitlines() == [f"error: rewards.plugins: {plugin}: {says}; a plugin's top level must only "
                                        "define and register its rewards, never exit"]


# A plugin whose reward breaks the contract: `{body}` is what it returns (or does).
BROKEN = '''
import math

from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult


@register("{source}")
def broken(response, ground_truth, extra_info):
    {body}
'''


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize(("body", "says"), [
    ("return 0.5", "returned float; a reward function must return a RewardResult"),
    ("return None", "returned NoneType; a reward function must return a RewardResult"),
    ("return {'score': 1.0}", "returned dict; a reward function must return a RewardResult"),
    ("return RewardResult(score=math.nan, correct=True)", "returned a non-finite score (nan)"),
    ("return RewardResult(score=-math.inf, correct=False)", "returned a non-finite score (-inf)"),
    ("return RewardResult(score='1', correct=True)", "returned a score of type str"),
    ("return RewardResult(score=1.0, correct=True, status='great')", "returned status 'great'"),
    ("raise SystemExit(3)", "raised SystemExit(3); a reward function must return a RewardResult, never exit"),
    # Before: correct=1 was scored ok and then every group carrying it was refused by the replay.
    ("return RewardResult(score=1.0, correct=1)", "returned correct of type int; correct is a bool (True or False)"),
    ("return RewardResult(score=1.0, correct=True, format_ok='yes')", "returned format_ok of type str"),
    # Before: an exception as detail killed the worker ("reward worker died"), naming nothing.
    ("return RewardResult(score=0.0, correct=False, detail=ValueError('no'))",
     "returned a detail of type ValueError; detail is a str"),
    ("raise ValueError('no answer')", "raised ValueError: no answer"),
    ("raise type('Mute', (Exception,), {'__str__': lambda self: 1 / 0})()",
     "raised Mute (whose message could not be read)"),
])
def test_a_reward_that_breaks_the_contract_is_a_named_scorer_failure(tmp_path, inline, body, says):
    """Masked (status error), never a number in a batch; the detail names the function, its file and the
    rule. Before: "reward worker died (exit code 1)", a TypeError raised in the caller, or NaN scored ok."""
    source = f"broken_{uuid.uuid4().hex[:8]}"
    plugin = tmp_path / "broken_reward.py"
    plugin.write_text(BROKEN.format(source=source, body=body))
    register = "@register(\"{source}\", inline=True)" if inline else "@register(\"{source}\")"
    plugin.write_text(plugin.read_text().replace(f'@register("{source}")', register.format(source=source)))
    cfg = load_config("default", [f"rewards.plugins=[{plugin}]", "rewards.workers=1"]).rewards
    with make_scorer(cfg) as scorer:
        results = scorer.score_many([ScoreRequest(source, r, 1, {}) for r in ("a", "b")])
    for r in results:
        assert r.status == "error" and r.scorer_failed and r.score == 0.0 and not r.correct
        assert r.detail.startswith(f"reward function broken ({plugin}) ") and says in r.detail, r.detail


# numpy's bools are what a numpy comparison gives: taken as Python's. Before: one killed the reward
# worker on every item (its reply would not encode) and crashed `dph-async score` when inline.
NUMPY = '''
import numpy as np

from dph_async.rewards.registry import register
from dph_async.rewards.result import RewardResult


@register("{source}"{inline})
def numpy_flags(response, ground_truth, extra_info):
    return RewardResult(score=np.float32(0.5), correct=np.bool_(response == "yes"), format_ok=np.True_,
                        detail="x" * 5000)
'''


@pytest.mark.parametrize("inline", [True, False])
def test_numpy_bools_are_taken_as_bools_and_a_long_detail_is_cut(tmp_path, capsys, inline):
    source = f"numpy_{uuid.uuid4().hex[:8]}"
    plugin = tmp_path / f"numpy_flags_{source}.py"
    plugin.write_text(NUMPY.format(source=source, inline=", inline=True" if inline else ""))
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps({"data_source": source, "response": r, "reward_model": {"ground_truth": 1}})
                                 + "\n" for r in ("yes", "no")))
    out = tmp_path / "results.jsonl"
    assert main(["score", str(responses), f"rewards.plugins=[{plugin}]", "rewards.workers=1", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["status"], r["correct"], r["format_ok"], r["score"]) for r in rows] == [("ok", True, True, 0.5),
                                                                                    ("ok", False, True, 0.5)]
    assert all(len(r["detail"]) == 1000 and r["detail"].endswith("…") for r in rows)


def test_dph_async_score_names_a_broken_reward_once(tmp_path, capsys):
    source = f"broken_{uuid.uuid4().hex[:8]}"
    plugin = tmp_path / "floats.py"
    plugin.write_text(BROKEN.format(source=source, body="return 0.5"))
    responses = tmp_path / "responses.jsonl"
    responses.write_text("".join(json.dumps({"data_source": source, "response": r, "reward_model": {"ground_truth": 1}})
                                 + "\n" for r in RESPONSES))
    assert main(["score", str(responses), f"rewards.plugins=[{plugin}]", "rewards.workers=1"]) == 0
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: 4 of 4 responses not scored: reward function broken ({plugin}) returned float; a "
                      "reward function must return a RewardResult (dph_async.rewards.result)"]


def test_missing_plugins_are_named(tmp_path):
    with pytest.raises(PluginError, match=re.escape(f"{tmp_path / 'none.py'}: no such file")):
        load_plugins([str(tmp_path / "none.py")])
    with pytest.raises(PluginError, match=r"^rewards\.plugins: no_such_plugin_module: failed to import: "
                                          r"ModuleNotFoundError"):
        load_plugins(["no_such_plugin_module"])


def test_the_scorer_service_loads_plugins_before_it_serves(tmp_path):
    source = write_plugin(tmp_path, "svc_reward")
    cfg = load_config("default", [f"rewards.plugins=[{tmp_path / 'svc_reward.py'}]", "rewards.workers=1"]).rewards
    with TestClient(make_app(cfg)) as client:
        answer = client.post("/v1/score", json={"requests": [
            {"data_source": source, "response": "queue", "ground_truth": 4}]})
    assert answer.status_code == 200, answer.text
    [result] = answer.json()["results"]
    assert result["score"] == pytest.approx(expected("queue")) and result["correct"]
    broken = load_config("default", [f"rewards.plugins=[{tmp_path / 'none.py'}]"]).rewards
    with pytest.raises(PluginError, match=r"none\.py: no such file"):
        make_app(broken)


# The embedded task's reward, moved onto its own scale: 0.25 wrong, 0.75 right. The built-in reward
# gives 0 or 1, so a step's mean reward tells which of the two scored it.
SHIFTED = '''
from dph_async.rewards.registry import get_reward_fn, register
from dph_async.rewards.result import RewardResult


@register("{source}")
def shifted(response, ground_truth, extra_info):
    inner = get_reward_fn(extra_info["inner"])(response, ground_truth, extra_info)
    return RewardResult(score=0.25 + 0.5 * inner.correct, correct=inner.correct)
'''


@pytest.mark.slow
def test_dph_async_run_trains_with_a_plugin_reward(small_base, tmp_path, monkeypatch):
    source = f"shifted_{uuid.uuid4().hex[:8]}"
    (tmp_path / "shifted.py").write_text(SHIFTED.format(source=source))
    files = {}
    for split in ("train", "test"):
        rows = pq.read_table(small_base / "data" / f"{split}.parquet").to_pylist()
        for row in rows:
            row["extra_info"] = {**row["extra_info"], "inner": row["data_source"]}
            row["data_source"] = source
        files[split] = write_rows(rows, tmp_path / f"{split}.parquet")
    out = tmp_path / "run"
    # As a user types it: options and overrides mixed, the plugin given relative to where they are.
    # In this process's Ray cluster (the suite's): the command's own start of one is tested elsewhere.
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--model", str(small_base / "base_model"), *SMALL, "rewards.plugins=[shifted.py]",
                 "--data", str(files["train"]), f"task.test_data.t={files['test']}", "--preset", "grpo",
                 "mode=sync", "actors.num_actors=1", "learner.steps=2", "--output", str(out)]) == 0
    [run] = json.loads((out / "summary.json").read_text())["runs"].values()
    steps = [json.loads(line) for line in (out / "rl" / run["dir"] / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    for m in steps:  # every completion was scored by the plugin, in the actor's process
        assert m["reward/mean"] == pytest.approx(0.25 + 0.5 * m["reward/accuracy"])
    # Evaluation (its own Ray task) scored the test set with the plugin too.
    for model in ("base", run["dir"]):
        [split] = json.loads((out / "eval" / f"{model}.json").read_text()).values()
        assert split["prompts"] > 0 and 0 <= split["sample_accuracy"] <= 1
