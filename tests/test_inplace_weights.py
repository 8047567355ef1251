"""Weights copied into a running vLLM engine in place give exactly the log-probs of a fresh engine
built from the same weights (fp32): a tiny Llama and a tiny Qwen2 (stacked q/k/v and gate/up
parameters, q/k/v biases, a padded vocabulary), sampled with the same seeds; loaded from tensors of
their own, and from the learner's shared-memory slot (read-only views of one map, stacked shards
back to back).

The same holds under both CPU kernels of the linear layers (`actors.cpu_gemm`): oneDNN's, packed again
after every load, and F.linear on the weights as loaded.

The engines run in one child process (vLLM engines live in processes of their own, as in an
actor): per case it builds an engine from weights A, loads weights B in place, samples, loads A
again and then B through shared memory (under F.linear as views of the leased segment, while the
learner publishes three more versions), samples, resets the engine to A (as a kept actor does before
its next run) and samples, then samples from a fresh engine on B.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY_VLLM_CONFIG, run_child, save_tiny_model

from dph_async.actors.engine import TORCH_GEMM_BELOW, resolve_cpu_gemm

pytestmark = pytest.mark.slow

CHILD = """
import json, sys, time
from dataclasses import replace
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM
from dph_async.actors.engine import VLLMEngine
from dph_async.actors.sampling import SamplingSpec
from dph_async.actors.weight_client import WeightClient
from dph_async.net import NetSecurity
from dph_async.learner.publish import WeightServer

def compare(a, b, gemm):
    spec = SamplingSpec(temperature=1.0, max_tokens=12, n=4, seed=7)
    prompts = [[1, 5, 6, 7, 8], [1, 9, 3], [1, 4, 4, 4, 4, 4, 4, 2, 3]]
    engine = VLLMEngine(str(a), max_model_len=32, cpu_gemm=gemm)
    unseeded = replace(spec, seed=None)  # drawn from the engine's own generator
    before_unseeded = engine.generate(prompts, unseeded)
    before = engine.generate(prompts, spec)
    model_b = AutoModelForCausalLM.from_pretrained(b)
    tensors = [(k, v.clone()) for k, v in model_b.state_dict().items()]
    engine.load_weights(tensors, version=1)
    forward, cpu = engine.forward_seconds, time.thread_time()
    loaded = engine.generate(prompts, spec)
    forward_share = [(engine.forward_seconds - forward) / (time.thread_time() - cpu)]
    engine.load_weights([(k, v.clone()) for k, v in AutoModelForCausalLM.from_pretrained(a).state_dict().items()], 2)
    server = WeightServer("tcp://127.0.0.1:0", NetSecurity(), 1 << 20, transport="shm")
    client = WeightClient(server.address, NetSecurity(), actor_id=0, transport="shm")
    server.publish(model_b, version=3)
    while (ready := client.newest(2)) is None:
        time.sleep(0.01)
    with client.tensors(ready, lease=engine.shares_weights) as shared:
        viewing = engine.load_weights(shared, ready.version, keep=client.leased)
    views = len(engine._inplace.viewing)
    assert viewing == (views > 0)  # what the actor reads to keep or give back its lease
    model_a = AutoModelForCausalLM.from_pretrained(a)
    for version in (4, 5, 6):  # the learner publishes on: the leased slot must not be rewritten
        server.publish(model_a, version=version)
    loaded_shm = engine.generate(prompts, spec)
    replaced = server._slots.replaced_busy
    client.close()
    server.close()
    model = engine.llm.apply_model(lambda m: m)[0]
    kept = [name for name, p in model.named_parameters() if name.endswith("proj.weight") and p.numel() > 0]
    engine.reset(str(a))  # what a kept actor does before its next run: back to A, version 0
    reset_unseeded = engine.generate(prompts, unseeded)
    forward, cpu = engine.forward_seconds, time.thread_time()
    reset = engine.generate(prompts, spec)
    forward_share.append((engine.forward_seconds - forward) / (time.thread_time() - cpu))
    fresh = VLLMEngine(str(b), max_model_len=32, cpu_gemm=gemm).generate(prompts, spec)
    dump = lambda gs: [[(s.token_ids, s.logprobs) for s in g] for g in gs]
    return {"loads": engine.loads, "before": dump(before), "loaded": dump(loaded), "loaded_shm": dump(loaded_shm),
            "fresh": dump(fresh), "linear_weights_kept": len(kept), "reset": dump(reset),
            "before_unseeded": dump(before_unseeded), "reset_unseeded": dump(reset_unseeded),
            "reset_version": engine.version, "views": views, "replaced": replaced, "forward_share": forward_share}

def main():
    out, *cases = sys.argv[1:]
    out = Path(out)
    out.write_text(json.dumps({f"{cases[i]}/{cases[i + 1]}": compare(cases[i + 2], cases[i + 3], cases[i + 1])
                               for i in range(0, len(cases), 4)}))

if __name__ == "__main__":
    main()
"""


def _pair(arch: str, tmp: Path) -> tuple[Path, Path]:
    """Two random models of one architecture: B differs from A in every tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config, cls = (LlamaConfig(**TINY_VLLM_CONFIG), LlamaForCausalLM) if arch == "llama" else \
        (Qwen2Config(**TINY_VLLM_CONFIG), Qwen2ForCausalLM)
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = cls(config)
        with torch.no_grad():  # random norms and biases too, so a load that missed one would show
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.3 * torch.randn_like(p))
        paths.append(save_tiny_model(model, tmp / f"{arch}-{seed}"))
    return paths[0], paths[1]


# Both CPU kernels of the linear layers (actors.cpu_gemm): oneDNN's, packed again after a load, on
# both architectures; F.linear on the weights as loaded (nothing packed) on the Llama.
CASES = (("llama", "onednn"), ("qwen2", "onednn"), ("llama", "torch"))


def test_inplace_load_matches_a_fresh_engine(tmp_path, engine_zygote):
    models = {arch: _pair(arch, tmp_path) for arch in ("llama", "qwen2")}
    cases = [str(x) for arch, gemm in CASES for x in (arch, gemm, *models[arch])]
    results = run_child(CHILD, tmp_path, *cases, zygote=engine_zygote)
    assert set(results) == {f"{arch}/{gemm}" for arch, gemm in CASES}
    for case, res in results.items():
        assert res["loads"] == {"inplace": 4, "reload": 0}, case
        assert res["loaded"] == res["fresh"], case  # same tokens, bit-identical log-probs
        assert res["loaded_shm"] == res["fresh"], case
        assert res["loaded"] != res["before"], case  # the load changed what the engine computes
        # The engine's forward clock runs inside generation and not beyond it, after in-place loads
        # and a reset alike (the split `bench peer` reports between the model and vLLM's bookkeeping).
        assert all(0 < share < 1 for share in res["forward_share"]), (case, res["forward_share"])
        # Reset to A: the engine computes again what it computed when it was new on A.
        assert res["reset"] == res["before"] and res["reset_version"] == 0, case
        # and draws what a new engine draws: its generator is seeded again
        assert res["reset_unseeded"] == res["before_unseeded"], case
        # Under F.linear the engine ran on views of the leased segment (no copy), and the learner's
        # next publishes went around the slot it held instead of rewriting it.
        torch_gemm = case.endswith("/torch")
        assert (res["views"] > 0) == torch_gemm and (res["replaced"] > 0) == torch_gemm, (case, res["views"])
        # oneDNN keeps only its packed copy of a linear layer's weight; F.linear runs on the weight.
        assert (res["linear_weights_kept"] > 0) == case.endswith("/torch"), (case, res["linear_weights_kept"])
    # The two kernels compute the same function (not bitwise alike): each sample's first token, drawn
    # with the same seed, and its log-prob.
    def first(res: dict) -> list[tuple[int, float]]:
        return [(ids[0], lps[0]) for group in res["fresh"] for ids, lps in group]

    for (a, lp_a), (b, lp_b) in zip(first(results["llama/torch"]), first(results["llama/onednn"]), strict=True):
        assert a == b and abs(lp_a - lp_b) < 1e-4


@pytest.mark.parametrize("size, expected", [(1, "torch"), (TORCH_GEMM_BELOW - 1, "torch"),
                                            (TORCH_GEMM_BELOW, "onednn"), (0, "onednn")])
def test_auto_kernels_follow_the_size_of_the_weights(tmp_path, size, expected):
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * (size // 2))
    (tmp_path / "model-00002.bin").write_bytes(b"\0" * (size - size // 2))
    (tmp_path / "tokenizer.json").write_bytes(b"\0" * TORCH_GEMM_BELOW)  # not a weight
    assert resolve_cpu_gemm("auto", str(tmp_path)) == expected
    for explicit in ("onednn", "torch"):
        assert resolve_cpu_gemm(explicit, str(tmp_path)) == explicit
    assert resolve_cpu_gemm("auto", str(tmp_path / "missing")) == "onednn"
