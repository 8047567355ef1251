"""Data-parallel learner ranks: R = 2 ranks (two processes over gloo) take the step one rank takes.

On the same batch, the gradients at each optimizer step, the parameters after the step and the
batch's metrics must match a single rank's within fp32 tolerance: with one mini-batch, with two
mini-batches over two epochs (the proximal policy recorded across ranks), at ZeRO-2 (gradients
reduced during every backward, so the ranks' uneven micro-batch counts are padded), and at ZeRO-3
(every forward a collective: the proximal passes padded too, and the KL monitor sampling from
weights gathered from both ranks, against a single ZeRO-3 rank's own forward). Gradients are
compared as well as parameters because Adam's update hardly sees a gradient's scale: a rank
averaging instead of summing the shares changes the gradient by 1/R and the parameters barely.
"""

from __future__ import annotations

import faulthandler
import ipaddress
import json
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_learner import V, group, recording_gradients, tiny
from test_zero3 import end_rank, recording

from dph_async.config import LearnerConfig, LossConfig
from dph_async.learner.batching import Sequence
from dph_async.learner.data_parallel import Ranks, Rendezvous
from dph_async.learner.trainer import follow
from dph_async.protocol import Batch, ReferenceSample
from dph_async.tasks.tiny_model import build_tokenizer

ROOT = Path(__file__).resolve().parents[1]

# name -> learner settings; each runs one batch from the same initial weights.
CASES = {
    "one_update": {"zero_stage": 0},
    "two_minis_two_epochs": {"zero_stage": 0, "mini_batches": 2, "epochs": 2, "loss": {"correction": "decoupled"}},
    "zero2": {"zero_stage": 2, "mini_batches": 2},
    # A budget of 16 tokens gives the ranks uneven proximal passes (unpadded, they deadlock).
    "zero3": {"zero_stage": 3, "mini_batches": 2, "epochs": 2, "loss": {"correction": "decoupled"},
              "kl_every": 1, "kl_samples": 4, "micro_token_budget": 16, "zero3_persist_below": 0},
}
# Metrics that are timings, not results of the step.
TIMING = ("time/", "learner/step_seconds", "learner/tokens_per_s")


def the_batch() -> Batch:
    """Groups of uneven lengths and reference samples: the ranks get different micro-batch counts."""
    rng = np.random.default_rng(21)
    rewards = [[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0],
               [1.0, 0.0, 0.0, 0.0]]
    refs = [ReferenceSample(f"r{i}", rng.integers(3, V, size=4 + i).astype(np.int32),
                            rng.integers(3, V, size=2 + i).astype(np.int32), -np.ones(2 + i, np.float32), 1.0, "t")
            for i in range(3)]
    return Batch(0, [group(i, r, rng) for i, r in enumerate(rewards)], refs, {})


def make_trainer(model_dir: str, settings: dict, rendezvous: Rendezvous | None = None):
    from dph_async.learner.trainer import Trainer

    settings = dict(settings)
    loss = LossConfig(**{"objective": "forward", "coeff": 0.5, **settings.pop("loss", {})})
    cfg = LearnerConfig(**{"lr": 3e-2, "micro_token_budget": 40, **settings},
                        ranks=rendezvous.world if rendezvous else 1, loss=loss)
    return Trainer(model_dir, cfg, temperature=1.0, dtype="float32", pad_id=0, max_response_tokens=8, seed=0,
                   rendezvous=rendezvous)


def run_case(model_dir: str, settings: dict, rendezvous: Rendezvous | None = None) -> dict:
    """Rank 0 (or the only rank) trains on the batch; another rank follows it until released."""
    t = make_trainer(model_dir, settings, rendezvous)
    stage = settings["zero_stage"]
    # Under ZeRO-2 and 3 each rank holds part of the gradients: both record them, gathered whole.
    grads = recording(t)[0] if stage >= 2 else recording_gradients(t) if t.ranks.main else []
    if not t.ranks.main:
        assert follow(t, Path(model_dir) / "checkpoints") == 1
        return {}
    metrics = t.train_step(the_batch())
    params = [x.detach().clone() for x in t.whole_state().values()]
    t.close()
    return {"metrics": metrics, "grads": grads, "params": params}


def rank_main(rank: int, world: int, store: str, model_dir: str, out: str) -> None:
    """One rank of the data-parallel run: every case in turn, rank 0 saving what it saw."""
    faulthandler.enable()  # a rank that dies of a signal shows where
    torch.set_num_threads(1)
    os.environ["TORCH_EXTENSIONS_DIR"] = str(ROOT / ".cache" / "torch_extensions")
    results = {name: run_case(model_dir, settings, Rendezvous(rank, world, store)) for name, settings in CASES.items()}
    if rank == 0:
        torch.save(results, out)
    end_rank()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    out = tmp_path_factory.mktemp("model")
    tiny("llama").save_pretrained(out)
    build_tokenizer("abcdefghijklmnopqrstu").save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory) -> dict:
    out = str(tmp_path_factory.mktemp("dp") / "rank0.pt")
    ctx = mp.get_context("spawn")
    store = str(tmp_path_factory.mktemp("rendezvous") / "store")
    procs = [ctx.Process(target=rank_main, args=(r, 2, store, model_dir, out)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    for p in procs:
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_take_the_step_of_one(model_dir, two_ranks, case):
    one, two = run_case(model_dir, CASES[case]), two_ranks[case]
    assert len(one["grads"]) == len(two["grads"]) > 0
    for step_one, step_two in zip(one["grads"], two["grads"], strict=True):
        assert any(bool(g.abs().max() > 1e-3) for g in step_one)
        for a, b in zip(step_one, step_two, strict=True):
            torch.testing.assert_close(b, a, atol=2e-6, rtol=1e-4)
    start = tiny("llama").state_dict().values()
    with torch.no_grad():
        moved = max(float((a - b).abs().max()) for a, b in zip(one["params"], start, strict=True))
    assert moved > 1e-3
    # Adam divides each element's step by that element's own gradient: where the gradient is near
    # Adam's eps (1e-8), float noise in it moves the parameter by a visible share of a step. Within 1%
    # of one step (lr = 3e-2) here; a missing or doubled share moves most elements by far more.
    for a, b in zip(one["params"], two["params"], strict=True):
        torch.testing.assert_close(b, a, atol=3e-4, rtol=0)
    results = {k: v for k, v in one["metrics"].items() if not k.startswith(TIMING)}
    assert results.keys() == {k for k in two["metrics"] if not k.startswith(TIMING)}
    for k, v in results.items():
        assert two["metrics"][k] == pytest.approx(v, rel=1e-4, abs=1e-6), k


def listening(rank: int, world: int, store: str, out: str) -> None:
    """Join a learner group (one rank: without a rendezvous) and write where this process listens."""
    import psutil
    import torch.distributed as dist

    from dph_async.learner.data_parallel import init_distributed

    init_distributed(Rendezvous(rank, world, store) if world > 1 else None)
    if world > 1:
        dist.barrier()  # both ranks have met: every socket of the group is open
    conns = psutil.Process().net_connections("inet")
    Path(f"{out}.{world}.{rank}").write_text(json.dumps([c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN]))
    if world > 1:
        dist.barrier()  # neither leaves before the other has looked
    end_rank()


@pytest.mark.slow
def test_learner_ranks_listen_on_loopback_only(tmp_path):
    """A learner, alone or with another rank, opens no port beyond loopback: DeepSpeed's default
    rendezvous, a TCP store, would listen on every interface for the life of the process."""
    ctx = mp.get_context("spawn")
    jobs = [(0, 1), (0, 2), (1, 2)]
    out = str(tmp_path / "listening")
    procs = [ctx.Process(target=listening, args=(r, w, str(tmp_path / "store"), out)) for r, w in jobs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        if p.is_alive():
            p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    for rank, world in jobs:
        addresses = json.loads(Path(f"{out}.{world}.{rank}").read_text())
        # gloo's own listener at least: the process's sockets were seen
        assert addresses and all(ipaddress.ip_address(a).is_loopback for a in addresses), (rank, world, addresses)


def test_units_are_shared_out_once_and_balanced():
    rng = np.random.default_rng(0)
    units = [[Sequence(np.zeros(3, np.int32), np.zeros(int(rng.integers(1, 20)), np.int32), np.zeros(0))
              for _ in range(4)] for _ in range(9)]
    refs = [[Sequence(np.zeros(2, np.int32), np.zeros(5, np.int32), np.zeros(0))] for _ in range(4)]
    shares = [Ranks(r, 3).share(units, refs) for r in range(3)]
    for kind, whole in enumerate((units, refs)):
        got = [id(u) for s in shares for u in s[kind]]
        assert sorted(got) == sorted(id(u) for u in whole)
    tokens = [sum(len(u[0].prompt_ids) + sum(len(x.response_ids) for x in u) for k in s for u in k) for s in shares]
    assert max(tokens) - min(tokens) <= max(3 + sum(len(x.response_ids) for x in u) for u in units)
    assert Ranks().share(units, refs) == [units, refs]
