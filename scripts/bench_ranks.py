"""Learner step time with R data-parallel ranks, on the benchmark's batch shape, without actors.

    python scripts/bench_ranks.py --ranks 1 2 --steps 20 -o runs/bench/ranks.json [KEY=VALUE ...]

Each R runs in R fresh processes (rank 0 drives, the others follow, as in a run): the embedded tiny
model, a synthetic batch of learner.groups_per_step groups x sampling.n completions of up to
sampling.max_tokens tokens (and as many reference samples as groups when the objective uses the
pool), the preset's learner settings. Reported per R, over the steps after --warmup: wall seconds
per train_step on rank 0 (median and mean), rank 0's CPU-seconds per step and where its step's
time went (the trainer's time/* phases). This
measures t(R) of the scaling model (docs/scaling.md) directly; on a machine with fewer free cores
than R + 1 the ranks share cores and the measured speed-up is bounded by that, not by the design.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dph_async.config import load_config
from dph_async.learner.data_parallel import Rendezvous
from dph_async.learner.objectives import make_objective
from dph_async.learner.trainer import Trainer, follow
from dph_async.protocol import Batch, Completion, ReferenceSample, RolloutGroup, SamplingInfo
from dph_async.rewards.result import RewardResult
from dph_async.tasks.embedded import ALPHABET
from dph_async.tasks.tiny_model import build_tiny_llama, build_tokenizer, save_model


def synthetic_batch(cfg, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, longest, groups = cfg.sampling.n, cfg.sampling.max_tokens, []
    for g in range(cfg.learner.groups_per_step):
        prompt = rng.integers(3, vocab, size=int(rng.integers(12, 24))).astype(np.int32)
        comps = []
        for _ in range(n):
            k = int(rng.integers(max(1, longest // 3), longest + 1))
            r = float(rng.integers(0, 2))
            comps.append(Completion(rng.integers(3, vocab, size=k).astype(np.int32), -rng.random(k).astype(np.float32),
                                    np.zeros(k, np.int32), RewardResult(r, r > 0), "stop"))
        groups.append(RolloutGroup(0, g, f"p{g}", "x", prompt, comps, SamplingInfo(1.0, 1.0, -1, longest), 0.0, 0.0))
    refs = []
    if make_objective(cfg.learner.loss).uses_pool:
        for i in range(cfg.learner.groups_per_step):
            k = int(rng.integers(max(1, longest // 3), longest + 1))
            refs.append(ReferenceSample(f"r{i}", rng.integers(3, vocab, size=16).astype(np.int32),
                                        rng.integers(3, vocab, size=k).astype(np.int32),
                                        -rng.random(k).astype(np.float32), 1.0, "t"))
    return Batch(0, groups, refs, {})


def rank_main(rank: int, world: int, store: str, model_dir: str, overrides: list[str], steps: int, warmup: int,
              out: str) -> None:
    cfg = load_config("default", [*overrides, f"learner.ranks={world}"])
    torch.set_num_threads(cfg.learner.threads)
    rdv = Rendezvous(rank, world, store) if world > 1 else None
    trainer = Trainer(model_dir, cfg.learner, temperature=cfg.sampling.temperature, dtype=cfg.model.dtype, pad_id=0,
                      max_response_tokens=cfg.sampling.max_tokens, seed=cfg.seed, rendezvous=rdv)
    cpu0 = 0.0
    if rank == 0:
        batch = synthetic_batch(cfg, trainer.module.config.vocab_size)
        wall, phases = [], {}
        for i in range(warmup + steps):
            if i == warmup:
                cpu0 = time.process_time()
            start = time.perf_counter()
            m = trainer.train_step(batch)
            wall.append(time.perf_counter() - start)
            if i >= warmup:
                for k, v in m.items():
                    if k.startswith("time/"):
                        phases[k[5:]] = phases.get(k[5:], 0.0) + v / steps
        trainer.close()
        result = {"wall_s": wall[warmup:], "phases": phases}
    else:
        follow(trainer, Path(model_dir) / "checkpoints")
        return
    result["cpu_s"] = time.process_time() - cpu0
    Path(f"{out}.{rank}").write_text(json.dumps(result))


def measure(world: int, model_dir: str, overrides: list[str], steps: int, warmup: int) -> dict:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:  # mode 0700: the ranks' store as well
        out = os.path.join(tmp, "rank")
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=rank_main, args=(r, world, store, model_dir, overrides, steps, warmup, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise RuntimeError(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
        rank0 = json.loads(Path(f"{out}.0").read_text())
    wall = rank0["wall_s"]
    return {"ranks": world, "steps": steps, "step_s_median": statistics.median(wall),
            "step_s_mean": statistics.fmean(wall), "rank0_cpu_s_per_step": rank0["cpu_s"] / steps,
            "rank0_phase_s": rank0["phases"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("-o", "--output", "--out", dest="out", type=Path)
    p.add_argument("overrides", nargs="*", help="dotted config overrides (learner.*, sampling.*, model.*)")
    args = p.parse_args()
    # Before the ranks start: DeepSpeed, imported when a rank builds its Trainer, reads it.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(".cache/torch_extensions").resolve()))

    cfg = load_config("default", args.overrides)
    tok = build_tokenizer(ALPHABET)
    with tempfile.TemporaryDirectory() as model_dir:
        save_model(build_tiny_llama(cfg.model, len(tok), cfg.seed), tok, Path(model_dir))
        rows = [measure(r, model_dir, args.overrides, args.steps, args.warmup) for r in args.ranks]
    base = rows[0]["step_s_median"]
    for row in rows:
        row["speedup"] = base / row["step_s_median"]
    report = {"cores": os.cpu_count(), "load_average": os.getloadavg(), "overrides": args.overrides, "rows": rows}
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
