"""`dph-async bench peer` and `bench weights`: the single-process loop's pieces against brute force,
the summaries against their closed forms, a short run of the loop on a tiny model. A short bench of
dph-async's real processes beside the loop is the cell of tests/test_bench_scale.py's tiny grid."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from dph_async.tools.bench.peer import PeerRun, ensure_trl, intervals, summarise
from dph_async.tools.bench.peer_limit import limit_lines, limit_of, parts_of
from dph_async.tools.bench.peer_loop import completion_mask, response_logprobs
from dph_async.tools.bench.peer_spec import PeerSpec
from dph_async.tools.bench.weights import Round, _summary


def test_completion_mask_keeps_tokens_up_to_the_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 2, 3, 4]])
    expected = [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert completion_mask(ids, eos=2).tolist() == expected


def _tiny_llama(vocab: int = 11):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config).double().eval()


def test_loop_logprobs_match_each_sequence_alone():
    """Left-padded prompts and right-padded completions in one batch give every token the log-prob of
    its sequence run alone, unpadded (float64, at temperature 0.7)."""
    model = _tiny_llama()
    prompts = [[1, 5, 6, 7], [1, 8]]
    completions = [[3, 4, 2], [9]]
    width, t = 4, 3
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    ids = torch.tensor([c + [0] * (t - len(c)) for c in completions])
    mask = torch.tensor([[i < len(c) for i in range(t)] for c in completions])
    with torch.no_grad():
        got = response_logprobs(model, prompt_ids, prompt_mask, ids, mask, 0.7)
        for b, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            logits = model(input_ids=torch.tensor([p + c])).logits[0, len(p) - 1:-1] / 0.7
            alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
            torch.testing.assert_close(got[b, :len(c)], alone, rtol=0, atol=1e-12)


def _run(system: str, repeat: int, step_s: float, completions_per_s: float, detail: dict | None = None) -> PeerRun:
    return PeerRun(system, repeat, 10, step_s, completions_per_s, 4 * completions_per_s, {"generate": step_s / 2},
                   1.0, (1.0, 1.0), 0.0, 0.5, 2 * step_s, detail or {})


def test_summary_takes_medians_and_the_ratio_of_medians():
    runs = [_run("dph-async", 1, 0.5, 256), _run("dph-async", 2, 0.4, 320), _run("dph-async", 3, 0.9, 142),
            _run("loop", 1, 0.2, 640), _run("loop", 2, 0.3, 427), _run("trl", 1, 0.25, 512)]
    medians, ratios = summarise(runs)
    assert medians["dph-async"]["completions_per_s"] == 256
    assert medians["dph-async"]["phase generate"] == 0.25
    assert medians["loop"]["step_s"] == pytest.approx(0.25)
    assert ratios == {"loop": pytest.approx(256 / 533.5), "trl": pytest.approx(0.5)}


def test_ratio_intervals_pair_the_runs_of_one_repeat():
    # repeat 3's dph-async run has no loop partner; trl's single pair gives no interval
    runs = [_run("dph-async", 1, 0.5, 256), _run("dph-async", 2, 0.4, 320), _run("dph-async", 3, 0.9, 142),
            _run("loop", 1, 0.2, 640), _run("loop", 2, 0.3, 400), _run("trl", 1, 0.25, 512)]
    ci = intervals(runs)
    assert set(ci) == {"loop"} and ci["loop"].n == 2
    assert ci["loop"].ratio == pytest.approx(math.sqrt(256 / 640 * 320 / 400))


def _dph_detail(rng: random.Random) -> dict:
    return {"cpu_cores": {"learner": rng.uniform(0.6, 1), "actors": rng.uniform(0.95, 1), "ray": rng.uniform(0, 0.1)},
            "learner_phase_s": {"forward": rng.uniform(0.01, 0.03), "loss": rng.uniform(0, 0.01),
                                "backward": rng.uniform(0.02, 0.05), "optimizer": rng.uniform(0, 0.01),
                                "batching": rng.uniform(0, 0.02)},
            "tokens_per_step": rng.uniform(300, 900), "engine_cpu_per_token": rng.uniform(1e-4, 2e-4),
            "forward_cpu_per_token": rng.uniform(2e-5, 8e-5), "actors": (a := rng.choice([1, 2])),
            "actor_cpu_s": [_actor_cpu(rng) for _ in range(a)]}


def _actor_cpu(rng: random.Random) -> dict[str, float]:
    """One actor's thread, engine steps within it, forward within those: CPU-seconds per step."""
    thread = rng.uniform(0.05, 0.09)
    engine = thread * rng.uniform(0.6, 0.9)
    return {"thread": thread, "engine": engine, "forward": engine * rng.uniform(0.3, 0.6)}


def test_limit_splits_the_cpu_of_a_step_and_bounds_the_ratio_by_the_cores():
    rng = random.Random()
    step_s = [rng.uniform(0.2, 0.3) for _ in range(3)]
    details = [_dph_detail(rng) for _ in step_s]
    runs = [_run("dph-async", i, s, 128 / s, d) for i, (s, d) in enumerate(zip(step_s, details, strict=True))]
    runs += [_run("loop", 1, 0.15, 853), _run("loop", 2, 0.19, 673), _run("trl", 1, 0.1, 1280)]
    lim = limit_of(runs, cores=2)
    assert set(lim.peers) == {"loop", "trl"}
    loop = lim.peers["loop"]
    assert loop.step_s == pytest.approx(0.17) and loop.cpu_s == pytest.approx(0.34)
    assert loop.allowed_cpu_s == pytest.approx(2 * 0.17 / 1.5)
    assert lim.peers["trl"].allowed_cpu_s == pytest.approx(2 * 0.1 / 1.5)
    # Each part is the median over the runs of its definition (these inputs need no clamping).
    for part, value in [
        ("learner: training", lambda s, d: sum(d["learner_phase_s"][k] for k in ("forward", "loss", "backward",
                                                                                 "optimizer"))),
        ("actors: the model's forward", lambda s, d: sum(a["forward"] for a in d["actor_cpu_s"])),
        ("actors: vLLM's bookkeeping", lambda s, d: sum(a["engine"] - a["forward"] for a in d["actor_cpu_s"])),
        ("Ray", lambda s, d: d["cpu_cores"]["ray"] * s),
    ]:
        assert lim.parts[part] == pytest.approx(statistics.median(value(s, d) for s, d in zip(step_s, details,
                                                                                             strict=True)))
    for s, d in zip(step_s, details, strict=True):  # the parts of one run add up to its processes' CPU
        parts = parts_of(_run("dph-async", 0, s, 1.0, d))
        assert sum(parts.values()) == pytest.approx(sum(d["cpu_cores"][k] for k in ("learner", "actors", "ray")) * s)
    total = sum(lim.parts.values())
    arithmetic = lim.parts["learner: training"] + lim.parts["actors: the model's forward"]
    for name, peer_step in (("loop", 0.17), ("trl", 0.1)):
        ceilings = lim.peers[name].ceilings
        assert ceilings["every part, as measured"] == pytest.approx(2 * peer_step / total)
        assert ceilings["training and vLLM's engine steps"] == pytest.approx(
            2 * peer_step / (arithmetic + lim.parts["actors: vLLM's bookkeeping"]))
        assert ceilings["training and the model's forward alone"] == pytest.approx(2 * peer_step / arithmetic)
    # The busiest actor's thread, all of it and its engine steps alone: medians over the runs, and the
    # peer's s/step over them (one thread spends no more CPU than wall time, whatever the cores).
    assert len(lim.threads) == 2
    for name, key in (("the busiest actor's thread, as measured", "thread"),
                      ("the busiest actor's thread, its engine steps alone", "engine")):
        t = statistics.median(max(a[key] for a in d["actor_cpu_s"]) for d in details)
        assert lim.threads[name] == pytest.approx(t)
        for peer, peer_step in (("loop", 0.17), ("trl", 0.1)):
            assert lim.peers[peer].ceilings[name] == pytest.approx(peer_step / t)
    report = "\n".join(limit_lines(lim))
    assert all(f"| {name} | {t:.3f} |" in report for name, t in lim.threads.items())
    # Runs from before the actors marked their clocks: the engine's per-token figures over the whole
    # run, and no thread bound.
    for r in runs[:3]:
        del r.detail["actor_cpu_s"]
    old = limit_of(runs, cores=2)
    assert old.parts["actors: the model's forward"] == pytest.approx(
        statistics.median(d["forward_cpu_per_token"] * d["tokens_per_step"] for d in details))
    assert old.threads == {} and "busiest" not in "\n".join(limit_lines(old))
    assert limit_of([r for r in runs if r.system == "dph-async"], cores=2) is None


def test_weights_summary_is_bytes_over_median_seconds():
    cpu = {"memcpy": 0.1, "snapshot": 1.0, "transfer": 0.5, "checksum": 0.1, "load": 0.4}
    rounds = [Round("inplace", 0.1, 2.0, 1.0, 0.2, s, 4.0, cpu) for s in (0.8, 0.3, 1.8)]
    s = _summary(rounds, nbytes=10**9)["inplace"]
    assert s["load"] == pytest.approx(1 / 0.8)
    assert s["actor"] == pytest.approx(1 / 2.0)  # 1.0 + 0.2 + 0.8, the median round
    assert s["actor_of_memcpy"] == pytest.approx(0.1 / 2.0)
    assert s["cpu_actor_of_memcpy"] == pytest.approx(0.1 / 1.0)


def test_trl_install_failure_is_reported_not_raised(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the environment's folder should go")
    python, why = ensure_trl(blocker, log=lambda m: None)
    assert python is None and "could not be installed" in why


@pytest.mark.slow
def test_loop_runs_the_work_and_times_its_phases(tmp_path):
    """Two steps of the loop on a random tiny Llama and the embedded task's prompts."""
    from dph_async.tasks.dataset import verl_row, write_rows
    from dph_async.tasks.embedded import ALPHABET, make_splits
    from dph_async.tasks.tiny_model import build_tokenizer

    model = _tiny_llama(vocab=16).float()
    model.save_pretrained(tmp_path / "model")
    build_tokenizer(ALPHABET).save_pretrained(tmp_path / "model")
    train = make_splits(0, 16, 8)["train"]
    data = write_rows([verl_row(p.prompt, p.data_source, p.ground_truth, i, "train") for i, p in enumerate(train)],
                      tmp_path / "train.parquet")
    spec = PeerSpec(model=str(tmp_path / "model"), data=str(data), steps=2, prompts_per_step=4, n=3, max_tokens=5,
                    lr=1e-3, temperature=1.0, grad_clip=1.0, weight_decay=0.0, seed=0, max_prompt_tokens=48)
    (tmp_path / "spec.json").write_text(json.dumps(asdict(spec)))
    subprocess.run([sys.executable, "-m", "dph_async.tools.bench.peer_loop", str(tmp_path / "spec.json"),
                    str(tmp_path / "out.json")], check=True, cwd=Path(__file__).resolve().parents[1], timeout=300)
    out = json.loads((tmp_path / "out.json").read_text())
    assert len(out["steps"]) == 2
    for s in out["steps"]:
        assert s["completions"] == 12 and 12 <= s["tokens"] <= 60
        phases = sum(s[p] for p in ("generate", "reward", "forward", "backward", "optimizer"))
        assert 0 < phases <= s["step_s"] + 1e-9
        assert 0 < s["cpu_s"] <= out["threads"] * s["step_s"] + 0.05  # torch's threads, busy at most


@pytest.mark.slow
def test_weights_bench_runs_every_variant_through_its_own_transport(tmp_path):
    import os

    from dph_async.protocol import SHM_PREFIX
    from dph_async.tools.bench.weights import VARIANTS, ModelShape, markdown, run

    before = {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    shape = ModelShape(hidden=128, layers=1, heads=2, intermediate=320, vocab=1000)
    res = run(shape, tmp_path, rounds=3, bucket_mb=0.25, machine={"cores": 2})
    # A round that took another path than its variant asks for fails inside run(); here: each variant
    # once after its warm-up, each in the summary and the report.
    assert [r.path for r in res.rounds] == list(VARIANTS)
    assert set(res.summary) == set(VARIANTS)
    assert res.rounds[0].transfer_s < res.rounds[1].transfer_s  # shm: nothing crosses the socket
    assert all(f"| {v} |" in markdown(res) for v in VARIANTS)
    assert {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)} == before
