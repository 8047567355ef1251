"""Every file is data from a stranger: nothing read from disk is unpickled.

A planted pickle whose unpickling would create a marker file stands in, one at a time, for every
file of a learner checkpoint (ZeRO-1 and ZeRO-3) and for a model directory's weights; each reader
of them (`run`'s resume and `rerun --from`: `Trainer.load`; the plain `rerun`, `eval`, `analyze`
and `recover`: `checkpoint_weights`, `read_weights`, `saved_weights`, `WeightReader`) must refuse
it with an error naming the file, and the marker must never appear. The first test shows the plant
is live: unpickled, it does create the marker. The state files themselves: what they keep, and
damage refused by file and tensor.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_zero3 import ROOT, save_tiny, trainer, with_reference

from dph_async.learner.checkpoint_engine import CODEC
from dph_async.model_files import ModelFileError, weight_files
from dph_async.paths import checkpoint_weights
from dph_async.state_file import Codec, StateFile, StateFileError, load_state, save_state


class Plant:
    """Unpickled, creates `marker` (as any code a pickle names would run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return Path.touch, (self.marker,)


def plant(path: Path, marker: Path) -> None:
    torch.save({"module": Plant(marker)}, path)  # the zip format DeepSpeed's own checkpoints have


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "code_ran"


def test_the_planted_pickle_runs_code_when_unpickled(tmp_path, marker):
    plant(tmp_path / "x.pt", marker)
    torch.load(tmp_path / "x.pt", weights_only=False)
    assert marker.exists()


# --- Learner checkpoints ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
    """A checkpoint (v1) of one trained step under ZeRO-1 and under ZeRO-3; the model directory beside."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    root = tmp_path_factory.mktemp("ckpt")
    model_dir = save_tiny(root / "model", tied=False)
    out = {}
    for stage in (1, 3):
        t = trainer(model_dir, stage)
        t.train_step(with_reference(5))
        t.save(root / f"zero{stage}", {"metrics": 1, "staleness": {"eta": 2, "ess": float("nan")}})
        t.close()
        out[stage] = root / f"zero{stage}"
    return out


def test_a_checkpoint_is_state_files_and_resumes_with_its_client_state(checkpoints):
    for stage, ckpt in checkpoints.items():
        files = sorted((ckpt / "v1").iterdir())
        assert files and all(load_state(f, CODEC) for f in files)  # every file reads as a state file
        assert not list(ckpt.glob("zero_to_*.py"))  # DeepSpeed's scripts read only its own format
        t = trainer(str(ckpt.parent / "model"), stage)
        try:
            state = t.load(ckpt, "v1")
        finally:
            t.close()
        assert t.version == 1 and state["metrics"] == 1
        assert state["staleness"]["eta"] == 2 and state["staleness"]["ess"] != state["staleness"]["ess"]  # NaN kept


@pytest.mark.parametrize("stage", [1, 3])
def test_a_pickle_in_any_checkpoint_file_is_refused_by_name_and_never_run(checkpoints, stage, tmp_path, marker):
    """Each file in turn: the resume (`run`, `rerun --from`) and the weights' readers (`rerun`, `eval`,
    `analyze`) either never read it or refuse it, naming it."""
    from dph_async.runtime.evaluate import read_weights

    names = sorted(f.name for f in (checkpoints[stage] / "v1").iterdir())
    t = trainer(str(checkpoints[stage].parent / "model"), stage)
    try:
        for name in names:
            ckpt = tmp_path / name / "checkpoints"
            shutil.copytree(checkpoints[stage], ckpt)
            plant(ckpt / "v1" / name, marker)
            with pytest.raises(StateFileError, match=f"{ckpt / 'v1' / name}: not a safetensors state file"):
                t.load(ckpt, "v1")
            reads_weights = stage == 3 or "model_states" in name  # ZeRO-1's weights: its model states alone
            for read in (checkpoint_weights, read_weights):
                if reads_weights:
                    with pytest.raises(StateFileError, match=name):
                        read(ckpt / "v1")
                else:
                    read(ckpt / "v1")
    finally:
        t.close()
    assert not marker.exists()


def test_a_checkpoint_whose_version_is_not_its_name_is_refused(checkpoints, tmp_path):
    shutil.copytree(checkpoints[1] / "v1", tmp_path / "v7")
    t = trainer(str(checkpoints[1].parent / "model"), 1)
    try:
        with pytest.raises(StateFileError, match="holds version 1, its name says v7"):
            t.load(tmp_path, "v7")
    finally:
        t.close()


# --- Model directories --------------------------------------------------------------------------


@pytest.fixture
def pickled_model(checkpoints, tmp_path, marker) -> Path:
    """A Hugging Face directory (config, tokenizer) whose weights are a planted pytorch_model.bin."""
    model = tmp_path / "pickled"
    shutil.copytree(checkpoints[1].parent / "model", model)
    for f in model.glob("*.safetensors"):
        f.unlink()
    plant(model / "pytorch_model.bin", marker)
    return model


def test_a_model_directory_with_pickled_weights_is_refused_by_name(pickled_model, marker):
    from transformers import AutoModelForCausalLM

    from dph_async.pipeline.rerun import saved_weights
    from dph_async.runtime.evaluate import read_weights
    from dph_async.tools.analyze.checkpoints import Checkpoint, WeightReader

    bin_file = str(pickled_model / "pytorch_model.bin")
    for read in (weight_files, read_weights, saved_weights, lambda d: WeightReader(Checkpoint("m", d))):
        with pytest.raises(ModelFileError, match=f"{bin_file}: weights in a format other than safetensors"):
            read(pickled_model)
    with pytest.raises(OSError):  # the learner's, pre-sampling's and the mixture sampler's loader
        AutoModelForCausalLM.from_pretrained(pickled_model, use_safetensors=True)
    assert not marker.exists()


def test_an_index_naming_a_file_outside_the_directory_or_a_pickle_is_refused(pickled_model):
    from dph_async.tools.analyze.checkpoints import Checkpoint, WeightReader

    index = pickled_model / "model.safetensors.index.json"
    for name in ("pytorch_model.bin", "../elsewhere.safetensors"):
        index.write_text(json.dumps({"weight_map": {"lm_head.weight": name}}))
        with pytest.raises(ModelFileError, match=f"{index}: '{name}' is not a safetensors file of the directory"):
            WeightReader(Checkpoint("m", pickled_model))


def cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "dph_async.cli.main", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_eval_and_analyze_refuse_a_planted_pickle_in_one_error_line(pickled_model, checkpoints, tmp_path, marker):
    """The real commands: `eval --model` with pickled weights, `analyze` of a checkpoint with a pickle
    for its model states."""
    done = cli("eval", "--model", str(pickled_model), "--data", "test.parquet", cwd=tmp_path)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr == (f"error: --model: {pickled_model}/pytorch_model.bin: weights in a format other than "
                           "safetensors, which is never loaded (a pickle can run code): save the model as "
                           "safetensors (save_pretrained does)\n")

    ckpt = tmp_path / "run" / "checkpoints"
    shutil.copytree(checkpoints[1], ckpt)
    plant(ckpt / "v1" / "mp_rank_00_model_states.pt", marker)
    done = cli("analyze", str(checkpoints[1].parent / "model"), str(ckpt / "v1"), "-o", "out", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"error: {ckpt}/v1/mp_rank_00_model_states.pt: not a safetensors state file" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()


# --- The state file -----------------------------------------------------------------------------


def test_a_state_round_trips_every_kind_of_value(tmp_path):
    shared = torch.arange(6, dtype=torch.float32)
    state = {"f": 0.1, "nan": float("nan"), "inf": float("-inf"), "i": 2**40, "b": True, "n": None, "s": "x",
             "l": [1, (2.5, "y")], 3: {"int keys": "like an optimizer's"}, "o": OrderedDict(b=1, a=2),
             "size": torch.Size([2, 3]), "bf16": torch.ones(3, dtype=torch.bfloat16), "scalar": torch.tensor(7.0),
             "shared": [shared, shared], "view": shared[2:4], "empty": torch.zeros(0, 4)}
    save_state(state, tmp_path / "s")
    got = load_state(tmp_path / "s")
    assert list(got) == list(state) and type(got["o"]) is OrderedDict and list(got["o"]) == ["b", "a"]
    assert got["f"] == 0.1 and got["nan"] != got["nan"] and got["inf"] == float("-inf") and got["i"] == 2**40
    assert got["l"] == [1, (2.5, "y")] and got[3] == state[3] and type(got["size"]) is torch.Size
    for k in ("bf16", "scalar", "view", "empty"):
        assert got[k].dtype == state[k].dtype and torch.equal(got[k], state[k])
    assert got["shared"][0] is got["shared"][1] and torch.equal(got["shared"][0], shared)
    with StateFile(tmp_path / "s") as f:
        assert f.get("l", 1, 0) == 2.5 and f.get(3, "int keys") == "like an optimizer's"


def test_only_named_objects_are_stored_and_built(tmp_path):
    class Scale:
        def __init__(self, s: float) -> None:
            self.s = s

    with pytest.raises(TypeError, match=r"/a/0: a .*Scale cannot be stored"):
        save_state({"a": [Scale(2.0)]}, tmp_path / "s")
    codec = Codec({Scale: ("scale", lambda x: x.s)}, {"scale": Scale})
    save_state({"a": [Scale(2.0)]}, tmp_path / "s", codec)
    assert load_state(tmp_path / "s", codec)["a"][0].s == 2.0
    with pytest.raises(StateFileError, match=r"a node that is none of the state file's: \['x', 'scale', 2.0\]"):
        load_state(tmp_path / "s")  # a reader that names no such kind builds none


def test_damage_and_other_formats_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "s"
    save_state({"w": torch.arange(4, dtype=torch.float32)}, path)
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0x40  # a byte of the tensor
    path.write_bytes(bytes(raw))
    with pytest.raises(StateFileError, match=rf"{path}: tensor '/w' \(bytes {len(raw) - 16}-{len(raw)}\) fails its"):
        load_state(path)
    save_file({"w": torch.zeros(2)}, str(path))  # safetensors, not a state file
    with pytest.raises(StateFileError, match=f"{path}: a safetensors file of format None"):
        load_state(path)
    path.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(StateFileError, match=f"{path}: not a safetensors state file"):
        load_state(path)
    deep: list = []
    for _ in range(100):
        deep = [deep]
    save_state({"d": deep}, path)
    with pytest.raises(StateFileError, match="nested deeper than 64"):
        load_state(path)
