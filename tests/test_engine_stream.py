"""The actor's streamed generation reads vLLM's engine core directly (actors/engine.py), without vLLM's
output processor: the samples it returns are vLLM's own, and abort leaves nothing behind.

In one child process (vLLM engines live in processes of their own, as in an actor), a tiny Llama
generates seeded groups twice: through `LLM.generate` (vLLM's output path) and through `add`/`step`,
with a further group added beside them and aborted after one step. Every streamed sample equals
vLLM's (tokens, bit-identical log-probs, finish reason, text); the aborted group never comes back and
leaves no request in the engine core; its key can be used again; a batch `generate` is refused
while streamed requests are in flight, as it would drop their outputs; and the sampler's token ranks,
counted op by op in place of vLLM's compiled helper, leave the samples as they were.
"""

from __future__ import annotations

import pytest
from conftest import run_child, save_tiny_llama

pytestmark = pytest.mark.slow

CHILD = """
import json, sys
from dph_async.actors.engine import VLLMEngine, count_at_least
from dph_async.actors.sampling import SamplingSpec

def finished(engine):
    done = {}
    while engine.has_unfinished():
        done.update({s.key: s for s in engine.step()})
    return done

def main():
    out, model = sys.argv[1:]
    spec = SamplingSpec(temperature=1.0, max_tokens=12, n=4, seed=7)
    prompts = [[1, 5, 6, 7, 8], [1, 9, 3], [1, 4, 4, 4, 4, 4, 4, 2, 3]]
    # oneDNN's kernels give a sequence the same log-probs whatever else is in its batch, which the
    # regenerated group below is checked on bit for bit; F.linear's differ at float rounding.
    engine = VLLMEngine(model, max_model_len=32, cpu_gemm="onednn")
    vllm_path = engine.generate(prompts, spec)
    for i, p in enumerate(prompts):
        engine.add(f"g{i}", p, spec, n=spec.n)
    engine.add("x", prompts[0], spec, n=spec.n)
    try:
        engine.generate(prompts, spec)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    first = {s.key: s for s in engine.step()}
    engine.abort(["x"])
    core = engine.engine.engine_core.engine_core.scheduler
    in_core = [core.get_num_unfinished_requests(), sum(len(g) for g in engine._live.values())]
    streamed = {**first, **finished(engine)}
    left = core.get_num_unfinished_requests()
    engine.add("x", prompts[0], spec, n=spec.n)
    again = finished(engine)
    # The engine ranks sampled tokens op by op; with vLLM's compiled helper back, it samples the same.
    from vllm.v1.sample import sampler
    from vllm.v1.sample.ops import logprobs
    op_by_op = sampler.batched_count_greater_than is count_at_least
    sampler.batched_count_greater_than = logprobs.batched_count_greater_than
    compiled = engine.generate(prompts, spec)
    row = lambda s: [s.token_ids, s.logprobs, s.finish_reason, s.text, sorted(set(s.versions))]
    json.dump({"vllm": [[row(s) for s in g] for g in vllm_path],
               "streamed": {k: row(s) for k, s in streamed.items()},
               "again": {k: row(s) for k, s in again.items()},
               "compiled_ranks": [[row(s) for s in g] for g in compiled], "op_by_op": op_by_op,
               "left": left, "in_core": in_core, "refused": refused}, open(out, "w"))

if __name__ == "__main__":
    main()
"""


def test_streamed_samples_are_vllms_and_abort_leaves_nothing(tmp_path, engine_zygote):
    model = save_tiny_llama(tmp_path / "model")
    res = run_child(CHILD, tmp_path, str(model), timeout=600, zygote=engine_zygote)

    expected = {f"g{i}/{j}": s for i, group in enumerate(res["vllm"]) for j, s in enumerate(group)}
    assert res["streamed"] == expected  # same tokens, bit-identical log-probs, finish reasons, texts
    reasons = {s[2] for s in expected.values()}
    assert reasons <= {"stop", "length"} and len(reasons) == 2, reasons  # both ways of finishing were seen
    assert all(len(s[0]) == len(s[1]) > 0 and s[4] == [0] for s in expected.values())
    # The aborted group left the engine core at once: it holds only the unfinished streamed samples,
    # and nothing once they are done.
    assert res["in_core"][0] == res["in_core"][1] > 0 and res["left"] == 0, res["in_core"]
    # Its key serves again, and the same seed draws what vLLM drew for that prompt.
    assert res["again"] == {f"x/{j}": s for j, s in enumerate(res["vllm"][0])}
    assert "4 streamed requests in flight" in res["refused"]
    # vLLM's CPU sampler ranked tokens op by op, and its own compiled helper draws the same samples.
    assert res["op_by_op"] and res["compiled_ranks"] == res["vllm"]
