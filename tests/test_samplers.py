"""The DPO samplers in the actor: every response records which distribution sampled it and its
log-probs under that distribution, equal to the learner's own log-probs of pi_theta (online),
of pi_ref (ref) and to the mixtures of docs/losses.md computed here in float64 from both models'
full logits (gshf, mixp), before and after a weight update; the tokens are drawn from that
distribution; the record survives the wire and the replay's columns.

The expected policy weights are written out here from docs/losses.md, not read from the engine's
table: a wrong weight there must fail these tests."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dph_async import protocol as P
from dph_async.actors.mixture import MixtureEngine
from dph_async.actors.sampling import SamplingSpec
from dph_async.learner.batching import Sequence, pack
from dph_async.learner.logprobs import response_logprobs
from dph_async.protocol import Completion, RolloutGroup, SamplingInfo
from dph_async.replay.records import group_columns, groups_from
from dph_async.rewards.result import RewardResult
from dph_async.samplers import SAMPLERS, sampler
from dph_async.tasks.tiny_model import build_tokenizer

TAU = 0.8
PROMPT = [3, 7, 5, 9]
# docs/losses.md, Samplers: completion j of a group samples from softmax((a_j z_theta + (1 - a_j) z_ref) / tau),
# that is pi_theta^a_j pi_ref^(1 - a_j) normalised, each model's distribution taken at tau.
DOC_WEIGHTS = {"online": [1.0] * 4, "ref": [0.0] * 4, "gshf": [1.0, 0.0, 1.0, 0.0], "mixp": [1.5, 0.5, 1.5, 0.5]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    out = tmp_path_factory.mktemp("sampler_model")
    LlamaForCausalLM(cfg).save_pretrained(out)
    build_tokenizer("abcdefghijklmnopqrstu").save_pretrained(out)
    return str(out)


def _learner_logprobs(model, response: list[int]) -> torch.Tensor:
    """The learner's log-probs (fused kernel path) of one response at TAU."""
    unit = [Sequence(np.array(PROMPT), np.array(response), np.zeros(len(response), np.float32))]
    (mb,) = pack([unit], "fresh", 1000, 0)
    with torch.no_grad():
        return response_logprobs(model, mb, TAU, impl="torch")[0][0, : len(response)]


def doc_distribution(policy, ref, weight: float, ids: list[int], tau: float = TAU) -> torch.Tensor:
    """[len(ids), V] log pi_a(. | ids[:t+1]) of docs/losses.md in float64: pi_theta^a pi_ref^(1 - a),
    each at temperature tau, normalised over the vocabulary."""
    x = torch.tensor([ids])
    with torch.no_grad():
        log_theta = torch.log_softmax(policy(input_ids=x).logits[0].double() / tau, -1)
        log_ref = torch.log_softmax(ref(input_ids=x).logits[0].double() / tau, -1)
    unnormalised = weight * log_theta + (1 - weight) * log_ref
    return unnormalised - torch.logsumexp(unnormalised, -1, keepdim=True)


def _mixture_logprobs(policy, ref, weight: float, response: list[int]) -> torch.Tensor:
    """The docs' log pi_a of each response token."""
    logp = doc_distribution(policy, ref, weight, PROMPT + response)[len(PROMPT) - 1: -1]
    return logp[torch.arange(len(response)), torch.tensor(response)].float()


def _check(engine: MixtureEngine, sampler: str) -> None:
    (samples,) = engine.generate([PROMPT], SamplingSpec(temperature=TAU, max_tokens=6, n=4))
    assert [s.policy_weight for s in samples] == DOC_WEIGHTS[sampler]
    for s, weight in zip(samples, DOC_WEIGHTS[sampler], strict=True):
        got = torch.tensor(s.logprobs)
        assert len(got) == len(s.token_ids) == len(s.versions) and set(s.versions) == {engine.version}
        torch.testing.assert_close(got, _mixture_logprobs(engine.policy, engine.ref, weight, s.token_ids),
                                   atol=2e-5, rtol=1e-5)
        if weight in (0.0, 1.0):  # a pure model: the learner's own log-probs of it
            model = engine.policy if s.policy_weight == 1.0 else engine.ref
            torch.testing.assert_close(got, _learner_logprobs(model, s.token_ids), atol=2e-5, rtol=1e-5)


def test_every_sampler_of_the_docs_and_no_other():
    assert set(SAMPLERS) == set(DOC_WEIGHTS)
    for name, weights in DOC_WEIGHTS.items():
        assert SAMPLERS[name].weights(4) == weights


@pytest.mark.parametrize("sampler", DOC_WEIGHTS)
def test_recorded_logprobs_are_those_of_the_distribution_sampled(model_dir, sampler):
    engine = MixtureEngine(model_dir, sampler, seed=1)
    _check(engine, sampler)
    # New weights for pi_theta only: pi_ref stays pi_0, and the records follow.
    g = torch.Generator().manual_seed(2)
    new = [(k, v + 0.05 * torch.randn(v.shape, generator=g)) for k, v in engine.policy.state_dict().items()]
    ref_before = [p.clone() for p in engine.ref.parameters()]
    engine.load_weights(new, version=3)
    assert all(torch.equal(a, b) for a, b in zip(ref_before, engine.ref.parameters(), strict=True))
    _check(engine, sampler)


@pytest.mark.parametrize("sampler", ["gshf", "mixp"])
def test_first_tokens_are_drawn_from_the_docs_distribution(model_dir, sampler):
    """4,000 one-token completions per policy weight: their frequencies against pi_a of the docs
    (float64, the whole vocabulary). The total variation of 4,000 draws from 24 outcomes is about
    0.02-0.03 here; the other weight's distribution is 0.27 or more away."""
    engine = MixtureEngine(model_dir, sampler, seed=5)
    g = torch.Generator().manual_seed(6)  # pi_theta far from pi_ref (both start as the same weights)
    engine.load_weights([(k, (8 if k == "lm_head.weight" else 1) * v + 0.1 * torch.randn(v.shape, generator=g))
                         for k, v in engine.policy.state_dict().items()], version=1)
    n, weights = 4000, DOC_WEIGHTS[sampler][:2]
    (samples,) = engine.generate([PROMPT], SamplingSpec(temperature=TAU, max_tokens=1, n=2 * n))
    for j, weight in enumerate(weights):
        drawn = torch.tensor([s.token_ids[0] for s in samples[j::2]])
        assert {s.policy_weight for s in samples[j::2]} == {weight}
        freq = torch.bincount(drawn, minlength=engine.policy.config.vocab_size).double() / n
        expected = doc_distribution(engine.policy, engine.ref, weight, PROMPT)[-1].exp()
        other = doc_distribution(engine.policy, engine.ref, weights[1 - j], PROMPT)[-1].exp()
        assert 0.5 * float((expected - other).abs().sum()) > 0.15  # the test tells the two apart
        assert 0.5 * float((freq - expected).abs().sum()) < 0.06, (sampler, weight)


def test_weights_loaded_mid_response_mark_the_later_tokens(model_dir):
    engine = MixtureEngine(model_dir, "mixp", seed=4)
    engine.add("0", PROMPT, SamplingSpec(temperature=TAU, max_tokens=6), n=2)
    first = engine.step()
    engine.load_weights(list(engine.policy.state_dict().items()), version=1)
    done = first
    while engine.has_unfinished():
        done += engine.step()
    long = [s for s in done if len(s.token_ids) > 1]
    assert all(s.versions[0] == 0 and set(s.versions[1:]) == {1} for s in long)


def test_unknown_sampler_and_narrow_sampling_are_refused(model_dir):
    with pytest.raises(ValueError, match="unknown sampler 'mix'"):
        sampler("mix")
    engine = MixtureEngine(model_dir, "gshf")
    with pytest.raises(ValueError, match="full support"):
        engine.add("0", PROMPT, SamplingSpec(temperature=TAU, top_p=0.9), n=2)


def test_policy_weight_survives_the_wire_and_the_replay_columns():
    comps = [Completion(np.array([4, 5], np.int32), np.array([-1.0, -2.0], np.float32), np.array([2, 2], np.int32),
                        RewardResult(1.0, True), "stop", w) for w in (1.5, 0.5)]
    group = RolloutGroup(0, 7, "p", "x", np.array(PROMPT, np.int32), comps, SamplingInfo(TAU, 1.0, -1, 6), 0.0, 1.0)
    back = P.decode(P.encode(group))
    assert [c.policy_weight for c in back.completions] == [1.5, 0.5]
    import pyarrow as pa

    table = pa.table(group_columns([group]))
    assert [c.policy_weight for c in groups_from(table)[0].completions] == [1.5, 0.5]
    comps[0].policy_weight = float("nan")
    with pytest.raises(ValueError, match="policy_weight"):
        comps[0].validate()


def test_samplers_sweep_has_one_cell_per_sampler_and_seed():
    from dph_async.cli.main import build_parser
    from dph_async.tools.ablate.cells import samplers_sweep

    sweep = samplers_sweep(["online", "mixp"], [0, 1], "dpo")
    assert [c.key for c in sweep.cells] == ["online-seed0", "online-seed1", "mixp-seed0", "mixp-seed1"]
    assert sweep.cells[3].overrides == ("actors.sampler=mixp", "seed=1") and sweep.cells[3].group == "mixp"
    assert sweep.x == "sampler" and all(c.mode == "dpo" for c in sweep.cells)
    with pytest.raises(ValueError, match="sampler 'mix'"):
        samplers_sweep(["mix"], [0], "dpo")
    args = build_parser().parse_args(["ablate", "samplers", "--samplers", "ref", "gshf"])
    assert args.preset == "dpo" and args.samplers == ["ref", "gshf"]
