"""ZeRO-3 against ZeRO-1: the same gradients and weights, and whole weights wherever they leave the learner.

Under ZeRO-3 the fused kernel reads a partitioned LM head (learner/zero3.py). Every test sets
learner.zero3_persist_below (DeepSpeed's persistence threshold) to 0: by default parameters under
100k elements (all of these tiny models') stay whole on every rank, and nothing would be
partitioned. Gradients are compared at each optimizer step (Adam's first step, lr * g / |g|, would
magnify float noise in a gradient near 0), the weights after the run within a looser tolerance.
Updates have a fresh and a reference-pool micro-batch each, so gradient accumulation across micro-
batches is part of what is compared.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_learner import V, batch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dph_async.config import LearnerConfig, LossConfig
from dph_async.learner.zero3 import full_state_dict
from dph_async.net import NetSecurity
from dph_async.paths import checkpoint_weights, is_learner_checkpoint
from dph_async.protocol import Batch, ReferenceSample
from dph_async.state_file import load_state, save_state
from dph_async.tasks.tiny_model import build_tokenizer
from dph_async.tools.analyze.checkpoints import expand

ROOT = Path(__file__).resolve().parents[1]
UPDATE = dict(mini_batches=2, micro_token_budget=16,
              loss={"objective": "forward", "coeff": 0.5, "correction": "decoupled"})


def save_tiny(out: Path, tied: bool) -> str:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=tied))
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.save_pretrained(out)
    build_tokenizer("abcdefghijklmnopqrstu").save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[bool, str]:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return {tied: save_tiny(tmp_path_factory.mktemp(f"tied{tied}"), tied) for tied in (False, True)}


def trainer(model_dir: str, stage: int, lr: float = 1e-2, **learner):
    from dph_async.learner.trainer import Trainer

    settings = {**UPDATE, **learner}
    cfg = LearnerConfig(lr=lr, zero_stage=stage, zero3_persist_below=0,
                        **{**settings, "loss": LossConfig(**settings["loss"])})
    return Trainer(model_dir, cfg, temperature=1.0, dtype="float32", pad_id=0, max_response_tokens=8, seed=0)


def with_reference(seed: int, rank: int = 0) -> Batch:
    """`test_learner.batch(seed)` plus reference samples. Another rank's batch has the same tokens
    (so every rank runs the same forwards, as ZeRO-3's collective gathers need) with the rewards of
    each group reversed and other reference log-probs, so that its gradient differs."""
    rng = np.random.default_rng(seed)
    b = batch(seed)
    b.reference = [ReferenceSample(f"r{i}", rng.integers(3, V, size=5).astype(np.int32),
                                   rng.integers(3, V, size=3).astype(np.int32),
                                   -np.full(3, 3.0 - rank, np.float32), 1.0, "t") for i in range(4)]
    if rank:
        for g in b.groups:
            for c, r in zip(g.completions, [c.reward for c in g.completions][::-1], strict=True):
                c.reward = r
    return b


def recording(t) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Each optimizer step's whole gradients (every stage keeps them differently: DeepSpeed's
    safe_get_full_grad gathers them), and the number of backward passes before each step."""
    from deepspeed.utils import safe_get_full_grad

    grads: list[list[torch.Tensor]] = []
    backwards = [0]
    step, backward = t.engine.step, t.engine.backward

    def observed_backward(*args, **kwargs):
        backwards[-1] += 1
        return backward(*args, **kwargs)

    def observed_step(*args, **kwargs):
        grads.append([safe_get_full_grad(p).clone() for p in t.module.parameters()])
        backwards.append(0)
        return step(*args, **kwargs)

    t.engine.backward, t.engine.step = observed_backward, observed_step
    return grads, backwards


def full_weights(t) -> list[torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return [safe_get_full_fp32_param(p).clone() for p in t.module.parameters()]


def train(model_dir: str, stage: int, rank: int = 0, **learner):
    """A trainer after two batches, (each step's gradients, backward passes per step, the weights),
    and the last batch's metrics."""
    t = trainer(model_dir, stage, **learner)
    if stage == 3:  # really partitioned: outside a forward the LM head is an empty placeholder
        assert t.module.lm_head.weight.numel() == 0
    grads, backwards = recording(t)
    for seed in (5, 6):
        metrics = t.train_step(with_reference(seed, rank))
    return t, (grads, backwards[:-1], full_weights(t)), metrics


def assert_same_training(ref, got) -> None:
    (g1, b1, w1), (g3, b3, w3) = ref, got
    assert len(g1) == len(g3) == 4 and b1 == b3 and min(b1) >= 2  # 2 batches x 2 mini-batches, >= 2 micro each
    for step1, step3 in zip(g1, g3, strict=True):
        assert any(bool(g.abs().max() > 1e-3) for g in step1)
        for x, y in zip(step1, step3, strict=True):
            torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-4)
    for x, y in zip(w1, w3, strict=True):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [False, True], ids=["lm_head", "tied_embeddings"])
def test_zero3_trains_as_zero1(model_dirs, tied):
    assert_same_training(train(model_dirs[tied], 1)[1], train(model_dirs[tied], 3)[1])


def test_zero3_with_the_frozen_reference_model_and_the_kl_monitor(model_dirs):
    """Reverse KL scores fresh tokens with the frozen reference copy (whole, made before DeepSpeed
    partitions the model), and the KL monitor samples through the model's own forward between
    updates: both as under ZeRO-1."""
    settings = dict(kl_every=1, kl_samples=4, loss={"objective": "reverse_kl", "coeff": 0.5})
    (_, ref, m1), (_, got, m3) = (train(model_dirs[False], stage, **settings) for stage in (1, 3))
    assert_same_training(ref, got)
    assert m1["kl/k3"] > 0 and m3["kl/k3"] == pytest.approx(m1["kl/k3"], rel=1e-4)


def test_zero3_publishes_saves_and_resumes_whole_weights(model_dirs, tmp_path):
    from dph_async.learner.publish import WeightServer

    one, three = trainer(model_dirs[False], 1), trainer(model_dirs[False], 3)
    for t in (one, three):
        t.train_step(with_reference(5))
    expected = one.module.state_dict()
    got = full_state_dict(three.module)
    assert list(got) == list(expected)
    for name, x in expected.items():
        torch.testing.assert_close(got[name], x, atol=1e-4, rtol=1e-4)

    server = WeightServer("tcp://127.0.0.1:0", NetSecurity(), bucket_bytes=4 << 10)
    try:
        server.publish(three.module, three.version)
        published = {n: a for info, arrays in server._versions[three.version]
                     for n, a in zip(info.names, arrays, strict=True)}
    finally:
        server.close()
    assert {n: a.shape for n, a in published.items()} == {n: tuple(x.shape) for n, x in expected.items()}
    assert all(np.array_equal(published[n], got[n].numpy()) for n in got)

    three.save_pretrained(str(tmp_path / "final_model"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model").state_dict()
    assert all(torch.equal(saved[n], got[n]) for n in got)

    three.save(tmp_path / "ckpt", {})
    assert is_learner_checkpoint(tmp_path / "ckpt" / "v1")
    stored = checkpoint_weights(tmp_path / "ckpt" / "v1")  # what `dph-async analyze` and the ablation read
    assert all(torch.equal(stored[n], got[n]) and not stored[n].requires_grad for n in got)
    assert [c.deepspeed for c in expand(tmp_path / "ckpt" / "v1")] == [True]

    resumed = trainer(model_dirs[False], 3)
    assert resumed.load(tmp_path / "ckpt", "v1")["version"] == 1
    for t in (three, resumed):
        t.train_step(with_reference(6))
    for x, y in zip(full_weights(three), full_weights(resumed), strict=True):
        assert torch.equal(x, y)


# --- Two ranks: the partitions really split -------------------------------------------------------


def end_rank() -> None:
    """End a rank's process, its work done, as a run ends a learner rank's (Ray kills it), without
    the interpreter's teardown of its DeepSpeed engines and gloo groups while the other rank exits:
    that is where a rank once aborted in CI (SIGABRT), after the other had completed every collective
    with it and saved the results."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank(rank: int, port: int, model_dir: str, out: str) -> None:
    """One of two ranks: ZeRO-1 then ZeRO-3 on this rank's batches, then ZeRO-3's whole weights, a
    checkpoint of both partitions and a trainer resumed from it; rank 0 saves what it saw."""
    import deepspeed

    import dph_async.learner.trainer
    from dph_async.learner.data_parallel import Ranks

    def init_distributed(rendezvous: object = None) -> Ranks:
        """Each rank trains its own batch as a plain DeepSpeed rank: to the trainer it is the only one
        (no split of the batch, no control group), so DeepSpeed averages the two ranks' gradients."""
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
        deepspeed.init_distributed(dist_backend="gloo")
        return Ranks()

    faulthandler.enable()  # a rank that dies of a signal shows where
    torch.set_num_threads(1)
    dph_async.learner.trainer.init_distributed = init_distributed
    one, ref, _ = train(model_dir, 1, rank)
    three, got, _ = train(model_dir, 3, rank)
    whole = full_state_dict(three.module)  # collective: both ranks gather
    ckpt = Path(out).parent / "ckpt"
    three.save(ckpt, {})
    resumed = trainer(model_dir, 3)
    resumed.load(ckpt, f"v{three.version}")
    if rank == 0:
        save_state({"runs": (ref, got), "zero1": one.module.state_dict(), "whole": whole,
                    "resumed": full_state_dict(resumed.module), "tag": f"v{three.version}"}, Path(out))
    else:
        full_state_dict(resumed.module)
    end_rank()


@pytest.mark.slow
def test_zero3_on_two_ranks_trains_as_zero1(model_dirs, tmp_path):
    """Two gloo ranks, each holding half of every parameter under ZeRO-3 and training on its own
    batch: the gradients (reduce-scattered into the partitions) and weights equal ZeRO-1's; the
    gathered weights, the checkpoint's (put together from both ranks' files) and those of a trainer
    resumed from it are whole and the same."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "runs.safetensors"
    ctx = mp.start_processes(_rank, args=(port, model_dirs[False], str(out)), nprocs=2, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 240
    try:
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the two ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    seen = load_state(out)
    assert_same_training(*seen["runs"])
    whole = seen["whole"]
    assert list(whole) == list(seen["zero1"])
    for name, x in seen["zero1"].items():
        torch.testing.assert_close(whole[name], x, atol=1e-4, rtol=1e-4)
    stored = checkpoint_weights(tmp_path / "ckpt" / seen["tag"])
    assert all(torch.equal(stored[n], whole[n]) and torch.equal(seen["resumed"][n], whole[n]) for n in whole)
