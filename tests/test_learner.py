"""The learner's batching, shared-prompt log-probs and PPO mini-batch updates, on tiny models in-process.

The shared-prompt forward must give the log-probs and gradients of separate sequences; skipping
zero-advantage sequences must not change the update; mini-batch updates must record the proximal
policy before the first update, for every mini-batch, so that the ratio moves and the clip acts from
the second update on.
"""

from __future__ import annotations

import gc
import os
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from dph_async.config import CriticConfig, LearnerConfig, LossConfig
from dph_async.learner.batching import MiniBatch, Sequence, pack, prepare
from dph_async.learner.logprobs import response_logprobs
from dph_async.protocol import Batch, Completion, ReferenceSample, RolloutGroup, SamplingInfo
from dph_async.rewards.result import RewardResult
from dph_async.tasks.tiny_model import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]
V = 24


def tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    model = LlamaForCausalLM(LlamaConfig(**common)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**common))
    return model.eval()


def random_units(seed: int, groups: int = 4, n: int = 5) -> list[list[Sequence]]:
    rng = np.random.default_rng(seed)
    units = []
    for _ in range(groups):
        prompt = rng.integers(3, V, size=rng.integers(3, 9)).astype(np.int32)
        units.append([Sequence(prompt, rng.integers(3, V, size=rng.integers(1, 7)).astype(np.int32),
                               np.zeros(0, np.float32), float(rng.normal())) for _ in range(n)])
    for u in units:
        for s in u:
            s.old_logprobs = np.zeros(len(s.response_ids), np.float32)
    return units


def weighted_logprob_sum(model, units, share: bool) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """Per-sequence log-probs and the gradient of sum_seq advantage * sum_t logp."""
    model.zero_grad()
    total, per_seq = 0, {}
    for mb in pack(units, "fresh", token_budget=60, pad_id=0, share_prompts=share):
        logp, _ = response_logprobs(model, mb, temperature=0.7)
        total = total + (logp.sum(1) * mb.advantages).sum()
        for row, s in enumerate(mb.sequences):
            per_seq[id(s)] = logp[row, : len(s.response_ids)].detach()
    total.backward()
    return per_seq, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_shared_prompt_forward_equals_separate_sequences(kind):
    model = tiny(kind)
    units = random_units(seed=1)
    shared, g_shared = weighted_logprob_sum(model, units, share=True)
    flat, g_flat = weighted_logprob_sum(model, units, share=False)
    # The prompts really were shared: fewer prompt rows than responses in some micro-batch.
    assert any(mb.shares_prompts for mb in pack(units, "fresh", 60, 0, True))
    for key, value in flat.items():
        torch.testing.assert_close(shared[key], value, atol=2e-5, rtol=1e-5)
    for a, b in zip(g_shared, g_flat, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    # And both equal an independent computation: the full logits of each sequence on its own.
    with torch.no_grad():
        for u in units:
            for s in u:
                ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]), dtype=torch.long)[None]
                logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1] / 0.7
                want = torch.log_softmax(logits, -1).gather(1, ids[0, len(s.prompt_ids):, None])[:, 0]
                torch.testing.assert_close(shared[id(s)], want, atol=2e-5, rtol=1e-5)


def test_pack_respects_the_budget_and_keeps_every_sequence_once():
    units = random_units(seed=2, groups=7, n=6)
    for budget, share in ((40, True), (40, False), (1000, True)):
        micro = pack(units, "fresh", budget, 0, share)
        seen = [id(s) for mb in micro for s in mb.sequences]
        assert sorted(seen) == sorted(id(s) for u in units for s in u)
        for mb in micro:
            p, lp = mb.prompt_ids.shape
            cost = p * (lp + mb.packed_ids.shape[1])
            assert cost <= budget or p == 1
            assert bool(mb.mask.any(1).all())
            # Every response token sits in its prompt's packed row, at its start offset.
            for i, s in enumerate(mb.sequences):
                n = len(s.response_ids)
                got = mb.packed_ids[mb.row[i], mb.start[i]:mb.start[i] + n]
                assert got.tolist() == list(s.response_ids) and (mb.segment[mb.row[i], mb.start[i]:][:n] == i).all()
        if not share:
            assert not any(mb.shares_prompts for mb in micro)


def group(seq: int, rewards: list[float], rng: np.random.Generator, version: int = 0) -> RolloutGroup:
    prompt = rng.integers(3, V, size=6).astype(np.int32)
    comps = []
    for r in rewards:
        n = int(rng.integers(1, 5))
        comps.append(Completion(rng.integers(3, V, size=n).astype(np.int32), -rng.random(n).astype(np.float32),
                                np.full(n, version, np.int32), RewardResult(r, r > 0), "stop"))
    return RolloutGroup(0, seq, f"p{seq}", "x", prompt, comps, SamplingInfo(1.0, 1.0, -1, 8), 0.0, 0.0)


def test_mini_batches_split_groups_and_spread_reference_samples():
    rng = np.random.default_rng(3)
    groups = [group(i, [1.0, 0.0, 1.0, 0.0], rng) for i in range(6)]
    refs = [ReferenceSample(f"r{i}", np.arange(3, 7, dtype=np.int32), np.arange(4, 6, dtype=np.int32),
                            -np.ones(2, np.float32), 1.0, "t") for i in range(5)]
    p = prepare(Batch(0, groups, refs, {}), use_std=True, eps=1e-6, filter_zero_spread=False)
    minis = p.mini_batches(3)
    assert [len(m.groups) for m in minis] == [2, 2, 2]
    assert sorted(len(m.reference) for m in minis) == [1, 2, 2]
    assert sum(m.counts.fresh_tokens for m in minis) == p.counts.fresh_tokens
    assert sum(m.counts.n_reference for m in minis) == 5
    assert p.mini_batches(10)[0].counts.n_fresh == 4  # never more mini-batches than groups


def test_zero_advantage_sequences_are_skipped_but_counted():
    rng = np.random.default_rng(4)
    groups = [group(0, [1.0, 1.0, 1.0], rng), group(1, [1.0, 0.0, 0.0], rng)]
    mini = prepare(Batch(0, groups, [], {}), use_std=True, eps=1e-6, filter_zero_spread=False).mini_batches(1)[0]
    assert isinstance(mini, MiniBatch) and mini.counts.n_fresh == 6
    assert [len(u) for u in mini.fresh_units(skip_zero_advantage=True)] == [3]
    assert [len(u) for u in mini.fresh_units(skip_zero_advantage=False)] == [3, 3]


# --- The trainer (DeepSpeed, one rank, in this process) ----------------------------------------------


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    out = tmp_path_factory.mktemp("model")
    model = tiny("llama")
    model.save_pretrained(out)
    build_tokenizer("abcdefghijklmnopqrstu").save_pretrained(out)
    return str(out)


def trainer(model_dir: str, lr: float = 3e-2, **learner):
    """A one-rank trainer on the tiny model (ZeRO stage 0: gradients stay on the parameters)."""
    from dph_async.learner.trainer import Trainer

    loss = learner.pop("loss", {})
    critic = learner.pop("critic", {})
    cfg = LearnerConfig(lr=lr, **{"zero_stage": 0, "micro_token_budget": 64, **learner},
                        loss=LossConfig(**{"objective": "grpo", **loss}), critic=CriticConfig(**critic))
    return Trainer(model_dir, cfg, temperature=1.0, dtype="float32", pad_id=0, max_response_tokens=8, seed=0)


def batch(seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    rewards = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    return Batch(0, [group(i, r, rng) for i, r in enumerate(rewards)], [], {})


def recording_gradients(t) -> list[list[torch.Tensor]]:
    """Record the accumulated gradients each time the trainer's engine steps (ZeRO stage 0 keeps
    them on the parameters). Gradients, not updated parameters, are compared: Adam's first step,
    lr * g / |g|, turns float noise in a gradient that is ~0 into a full step."""
    seen: list[list[torch.Tensor]] = []
    step = t.engine.step

    def observed_step(*args, **kwargs):
        seen.append([p.grad.detach().clone() for p in t.module.parameters()])
        return step(*args, **kwargs)

    t.engine.step = observed_step
    return seen


def test_skipping_zero_advantage_sequences_leaves_the_update_unchanged(model_dir):
    a = trainer(model_dir, skip_zero_advantage=True)
    b = trainer(model_dir, skip_zero_advantage=False)
    ga, gb = recording_gradients(a), recording_gradients(b)
    ma, mb = a.train_step(batch(5)), b.train_step(batch(5))
    assert ma["batch/trained_fresh_tokens"] < mb["batch/trained_fresh_tokens"] == mb["batch/fresh_tokens"]
    assert len(ga) == len(gb) == 1 and any(bool(g.abs().max() > 1e-3) for g in ga[0])
    for x, y in zip(ga[0], gb[0], strict=True):
        torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_closed_trainer_is_garbage(model_dir, stage):
    """A kept learner process (launcher.reuse_learner) builds a trainer per run: once closed, the last
    one (engine, model, optimizer state) must be collectable, or every run adds its own to the process.
    (Under ZeRO the optimizer's gradient hooks hold the engine until it is destroyed.)"""
    t = trainer(model_dir, zero_stage=stage)
    t.train_step(batch(3))
    held = [weakref.ref(x) for x in (t, t.engine, t.module, t.engine.optimizer)]
    t.close()
    del t
    gc.collect()
    assert [r() for r in held] == [None] * len(held)


def test_a_trainer_frozen_with_the_heap_is_garbage_once_thawed(model_dir):
    """The learner process freezes its heap once a run's trainer is built, so that full collections
    no longer walk it, and thaws it when the run closes: a kept process then frees that trainer as
    before (the test above). Without the thaw the closed trainer would stay, frozen, for good."""
    from dph_async.runtime.learner_process import freeze_heap, thaw_heap

    t = trainer(model_dir)
    try:
        freeze_heap()
        assert gc.get_freeze_count() > 0
        t.train_step(batch(3))
        held = [weakref.ref(x) for x in (t, t.engine, t.module, t.engine.optimizer)]
        t.close()
        del t
        gc.collect()
        assert any(r() is not None for r in held)  # frozen: a collection leaves it
        thaw_heap()
        assert gc.get_freeze_count() == 0
        assert [r() for r in held] == [None] * len(held)
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("stage", [0, 1])
def test_the_optimizer_is_torchs_fused_adamw_on_the_cpu(model_dir, stage):
    """One kernel over each tensor, not torch's loop over them: at 52 M parameters 0.025 s of a core
    against 0.24 s a step. Under ZeRO-1 DeepSpeed's optimizer holds torch's, stepping its flat copy."""
    t = trainer(model_dir, zero_stage=stage)
    inner = getattr(t.engine.optimizer, "optimizer", t.engine.optimizer)
    assert type(inner) is torch.optim.AdamW and inner.defaults["fused"] is True
    before = [p.detach().clone() for p in t.module.parameters()]
    t.train_step(batch(6))
    assert any(not torch.equal(a, p) for a, p in zip(before, t.module.parameters(), strict=True))


def test_mini_batches_count_optimizer_steps_and_move_the_ratio(model_dir):
    one = trainer(model_dir, loss={"correction": "decoupled"})
    m = one.train_step(batch(6))
    assert one.version == 1 and m["learner/optimizer_steps"] == 1
    assert m["policy/ratio_dev"] == 0  # one update: pi_theta = pi_prox on every token

    many = trainer(model_dir, mini_batches=2, epochs=2, loss={"correction": "decoupled"})
    m = many.train_step(batch(6))
    assert many.version == 1 and m["learner/optimizer_steps"] == 4
    # From the second update on, pi_theta has moved away from the recorded proximal policy.
    assert m["policy/ratio_dev"] > 1e-4
    m = many.train_step(batch(7))
    assert many.version == 2 and m["learner/optimizer_steps"] == 8


def test_the_proximal_policy_is_the_batchs_start_for_every_mini_batch(model_dir):
    """AReaL's rule: pi_prox is the policy before the batch's first update, recorded once for every
    sequence of the batch. Each mini-batch's ratio is taken against it, so after the first update
    the second mini-batch's ratio has moved and the clip acts (a pi_prox recorded at each
    mini-batch's own start would make that ratio 1 and the clip idle)."""
    t = trainer(model_dir, mini_batches=2, loss={"correction": "decoupled"})
    start = tiny("llama")  # the weights model_dir holds
    seen: list[tuple[MiniBatch, torch.Tensor | None]] = []
    share = t._fresh_share

    def recording_prox(mb, mini, record):
        loss = share(mb, mini, record)
        seen.append((mb, mb.prox()))
        return loss

    t._fresh_share = recording_prox
    m = t.train_step(batch(6))
    assert m["learner/optimizer_steps"] == 2
    assert len(seen) >= 2 and all(prox is not None for _, prox in seen)
    with torch.no_grad():
        for mb, prox in seen:
            want = response_logprobs(start, mb, 1.0)[0]
            torch.testing.assert_close(prox[mb.mask], want[mb.mask], atol=1e-5, rtol=1e-5)
    assert m["policy/clip_frac"] > 0 and m["policy/ratio_dev"] > 1e-3


def test_gradient_parts_norms_and_cosine():
    from dph_async.learner.trainer import gradient_parts

    fresh = [torch.tensor([3.0, 0.0]), torch.tensor([[4.0]])]
    ref = [torch.tensor([0.0, 2.0]), torch.tensor([[0.0]])]
    out = gradient_parts({"fresh": fresh, "reference": ref})
    assert out == pytest.approx({"grad/fresh_norm": 5.0, "grad/reference_norm": 2.0, "grad/cosine": 0.0})
    out = gradient_parts({"fresh": fresh, "reference": [-2 * g for g in fresh]})
    assert out["grad/cosine"] == pytest.approx(-1.0)


def test_diagnosing_gradient_parts_leaves_the_update_unchanged(model_dir):
    rng = np.random.default_rng(8)
    refs = [ReferenceSample(f"r{i}", rng.integers(3, V, size=5).astype(np.int32),
                            rng.integers(3, V, size=3).astype(np.int32), -np.ones(3, np.float32) * 3, 1.0, "t")
            for i in range(3)]
    b = batch(9)
    b.reference = refs
    plain = trainer(model_dir, loss={"objective": "forward", "coeff": 0.5})
    diag = trainer(model_dir, diagnose_every=1, loss={"objective": "forward", "coeff": 0.5})
    g_plain, g_diag = recording_gradients(plain), recording_gradients(diag)
    assert "grad/cosine" not in plain.train_step(b)
    m = diag.train_step(b)
    assert m["grad/fresh_norm"] > 0 and m["grad/reference_norm"] > 0 and -1 <= m["grad/cosine"] <= 1
    assert m["batch/reference_samples"] == 3
    for x, y in zip(g_plain[0], g_diag[0], strict=True):
        torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-5)


def test_dpo_trains_on_whole_pairs_with_the_pair_gradient(model_dir):
    """Online DPO through the trainer: one pair per group with a reward spread (ties skipped and
    counted), pairs kept whole under a budget that splits groups, and at pi_theta = pi_ref (h = 0) a
    loss of log 2 and the gradient of mean_pairs softplus(-beta h) from separate forwards."""
    beta = 0.5
    t = trainer(model_dir, micro_token_budget=24, share_prompts=False, loss={"objective": "dpo", "coeff": beta})
    seen = recording_gradients(t)
    b = batch(10)
    m = t.train_step(b)
    assert m["batch/skipped_groups"] == 2 and m["batch/fresh_samples"] == 4
    assert m["loss/dpo"] == pytest.approx(np.log(2), rel=1e-6) and m["loss/dpo_accuracy"] == 0

    model = tiny("llama")
    model.zero_grad()
    total = 0
    for g in (b.groups[0], b.groups[2]):  # the groups with a spread: first best against first worst
        rewards = [c.reward.score for c in g.completions]
        seqs = {}
        for k in (rewards.index(max(rewards)), rewards.index(min(rewards))):
            c = g.completions[k]
            unit = [Sequence(g.prompt_ids, c.token_ids, np.zeros(len(c.token_ids), np.float32))]
            (mb,) = pack([unit], "fresh", token_budget=1000, pad_id=0, share_prompts=False)
            seqs[k] = response_logprobs(model, mb, temperature=1.0)[0].sum()
        w, lo = seqs[rewards.index(max(rewards))], seqs[rewards.index(min(rewards))]
        h = (w - w.detach()) - (lo - lo.detach())  # pi_ref = pi_theta at the start: h = 0, grad of h
        total = total + torch.nn.functional.softplus(-beta * h) / 2
    total.backward()
    for got, p in zip(seen[0], model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=1e-4)


def test_kl_monitor_logs_every_n_versions_against_the_start(model_dir):
    t = trainer(model_dir, kl_every=2, kl_samples=16, kl_per_prompt=4)
    first, second = t.train_step(batch(11)), t.train_step(batch(12))
    assert "kl/k1" not in first and second["kl/sequences"] == 16
    # two updates away from pi_0: k3 >= 0 per sequence, and both estimate the same positive KL
    assert second["kl/k3"] > 0 and second["kl/k3_se"] > 0 and second["kl/k1_se"] > 0
    assert abs(second["kl/k1"] - second["kl/k3"]) < 4 * (second["kl/k1_se"] + second["kl/k3_se"])


def test_a_batch_without_pairs_still_advances_the_version(model_dir):
    """All ties: no DPO pair, no optimizer step, but the version moves on (the replay admits by it)."""
    t = trainer(model_dir, loss={"objective": "dpo"})
    rng = np.random.default_rng(13)
    m = t.train_step(Batch(0, [group(i, [1.0, 1.0, 1.0], rng) for i in range(3)], [], {}))
    assert t.version == 1 and m["batch/skipped_groups"] == 3 and m["learner/optimizer_steps"] == 0


def test_as_run_trains_the_marked_reference_samples_by_policy_gradient_alone(model_dir):
    """With every reference sample marked (share 1), DPH-JS as run and its control dpef_pg take the
    same gradient: the divergence then acts on no sample. Unmarked (share 0) the gradient differs."""
    rng = np.random.default_rng(3)
    refs = [ReferenceSample(f"r{i}", rng.integers(1, 20, 3).astype(np.int32), rng.integers(1, 20, 4).astype(np.int32),
                            -rng.random(4).astype(np.float32) - 0.5, 1.0, "test") for i in range(3)]

    def grads(objective: str, share: float) -> tuple[list[torch.Tensor], dict[str, float]]:
        t = trainer(model_dir, loss={"objective": objective, "coeff": 0.5, "reference_pg_share": share})
        seen = recording_gradients(t)
        b = batch(5)
        m = t.train_step(Batch(0, b.groups, refs, {}))
        return seen[0], m

    as_run, m_as_run = grads("js_low_var", 1.0)
    control, _ = grads("dpef_pg", 1.0)
    written, m_written = grads("js_low_var", 0.0)
    for x, y in zip(as_run, control, strict=True):
        torch.testing.assert_close(x, y, atol=1e-7, rtol=1e-5)
    assert any(float((x - y).abs().max()) > 1e-4 for x, y in zip(as_run, written, strict=True))
    assert m_as_run["loss/pg_ref"] < 0 and "loss/pg_ref" not in m_written
