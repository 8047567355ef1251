"""A group's completions copy their prompt's KV from the first one computed (actors/shared_prefill.py)
and draw what they would have drawn computing it themselves.

In one child process (as in an actor), two engines of one tiny Llama, one sharing prompts and one
not, stream the same seeded groups of 6 completions: 11 prompts of 9-13 tokens (two of them the
same) and one of 41 (a whole KV block and a part). The completions are the same tokens with the
same log-probs (to float rounding: the copied prompt's last token runs in another batch). The
sharing engine computed every prompt once: each prompt's other completions copied all of it but its
last token, less the whole blocks vLLM's prefix cache shares, except where the first completion
stopped at its first token; the other engine copied nothing. A group of one-token completions,
whose leader finishes in the step that computes its prompt, comes back whole, its other
completions computing their prompts themselves.
"""

from __future__ import annotations

import pytest
from conftest import run_child, save_tiny_llama

pytestmark = pytest.mark.slow

CHILD = """
import json, random, sys
from dph_async.actors.engine import SamplingSpec, VLLMEngine

def stream(engine, prompts, spec, tag):
    for i, p in enumerate(prompts):
        engine.add(f"{tag}{i}", p, spec, n=spec.n)
    done, steps = {}, 0
    while engine.has_unfinished():
        done.update({s.key: [s.token_ids, s.logprobs] for s in engine.step()})
        steps += 1
    return done, steps

def main():
    out, model = sys.argv[1:]
    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 16) for _ in range(rng.randrange(8, 13))] for _ in range(10)]
    prompts.append([1] + [rng.randrange(3, 16) for _ in range(40)])  # a whole block and a part
    prompts.append(list(prompts[3]))  # two groups of one prompt: one leader for both
    spec = SamplingSpec(temperature=1.0, max_tokens=10, n=6, seed=11, logprobs=True)
    plain = VLLMEngine(model, max_model_len=64, share_prefill=False)
    shared = VLLMEngine(model, max_model_len=64)
    a, _ = stream(plain, prompts, spec, "g")
    b, _ = stream(shared, prompts, spec, "g")
    copied = [plain.sharing.copied_tokens, shared.sharing.copied_tokens]
    one = SamplingSpec(temperature=1.0, max_tokens=1, n=6, seed=3, logprobs=True)
    c, steps = stream(shared, prompts[:1], one, "one")
    json.dump({"plain": a, "shared": b, "copied": copied, "one": c, "one_steps": steps,
               "prompt_lens": [len(p) for p in prompts], "one_copied": shared.sharing.copied_tokens - copied[1],
               "leaders_left": len(shared.sharing._leaders),
               "block": shared.llm.llm_engine.vllm_config.cache_config.block_size}, open(out, "w"))

if __name__ == "__main__":
    main()
"""


def test_completions_sharing_a_prompts_kv_draw_what_they_would_have_drawn(tmp_path, engine_zygote):
    model = save_tiny_llama(tmp_path / "model")
    res = run_child(CHILD, tmp_path, str(model), timeout=600, zygote=engine_zygote)

    plain, shared = res["plain"], res["shared"]
    assert sorted(plain) == sorted(shared) and len(plain) == 12 * 6
    for key, (tokens, logprobs) in plain.items():
        assert shared[key][0] == tokens, key
        assert max(abs(x - y) for x, y in zip(shared[key][1], logprobs, strict=True)) < 1e-5, key
    # Each prompt computed once: every completion but its first group's first (the last group's
    # leader is the fourth's) copies all of it but the last token and the whole blocks that vLLM's
    # prefix cache shares; unless that leader stopped at its first token, in the step that computed
    # the prompt, leaving the rest to compute theirs. The engine without sharing copies nothing.
    lens, led, block = res["prompt_lens"], [len(plain[f"g{i}/0"][0]) > 1 for i in range(12)], res["block"]
    copied = [(n - 1) % block for n in lens]
    assert block == 32 and copied[10] == 8
    expected = sum(5 * c for c, ok in zip(copied[:-1], led[:-1], strict=True) if ok)
    expected += 6 * copied[-1] if led[3] else 0
    assert sum(led) >= 9 and res["copied"] == [0, expected]
    # One-token completions: the leader finishes as its prompt is computed, the rest compute theirs.
    assert sorted(res["one"]) == [f"one0/{j}" for j in range(6)]
    assert all(len(t) == len(lp) == 1 for t, lp in res["one"].values())
    assert res["one_copied"] == 0 and res["one_steps"] == 2
    assert res["leaders_left"] == 0  # every finished leader was let go
