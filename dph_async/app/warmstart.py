"""Supervised warm start of the embedded tiny model into a base policy pi_0.

Targets are drawn uniformly from each problem's correct answers, so pi_0 is varied; a share
(`warmstart.noise`) is replaced by well-formed wrong answers and training is short, so pi_0 is right
only sometimes. That leaves RL something to gain and something (diversity, the OOD rule) to lose.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from dph_async.app.progress import progress
from dph_async.config import RunConfig
from dph_async.tasks.embedded import ALPHABET, Problem
from dph_async.tasks.tiny_model import build_tiny_llama, build_tokenizer

WARMUP_FROM = 20  # steps from which the lr follows one cycle


def _wrong_answer(p: Problem, rng: random.Random) -> str:
    k = 2 if p.op == "-" else rng.randint(2, 3)
    return p.op.join(rng.sample(p.digits, k))


def _encoder(tok: PreTrainedTokenizerFast) -> Callable[[str], list[int]]:
    """`tok.encode` without special tokens, remembered: the warm start encodes the same prompts and
    answers thousands of times, which took about a tenth of its step."""
    return functools.cache(functools.partial(tok.encode, add_special_tokens=False))


def _batch(problems: list[Problem], tok: PreTrainedTokenizerFast, encode: Callable[[str], list[int]],
           rng: random.Random, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, masks = [], []
    for p in problems:
        answer = _wrong_answer(p, rng) if rng.random() < noise else rng.choice(p.solutions())
        prompt = [tok.bos_token_id, *encode(p.prompt)]
        target = [*encode(answer), tok.eos_token_id]
        seqs.append(prompt + target)
        masks.append([0] * len(prompt) + [1] * len(target))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    return ids, loss_mask


def warm_start(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, problems: list[Problem],
               cfg: RunConfig, out_dir: Path) -> list[float]:
    """Train `model` in place on the warm-start problems; save it to out_dir; return the loss curve."""
    ws = cfg.warmstart
    rng = random.Random(cfg.seed + 1)
    torch.manual_seed(cfg.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=ws.lr, weight_decay=0.01)
    # One cycle, a tenth of it warming up. Under WARMUP_FROM steps that tenth is under two steps (at
    # exactly one, 10 steps, torch divides by zero): the lr stays constant there.
    sched = (torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=ws.lr, total_steps=ws.steps, pct_start=0.1)
             if ws.steps >= WARMUP_FROM else None)
    losses = []
    encode = _encoder(tok)
    model.train()
    with progress() as bar:
        task = bar.add_task("warm start (SFT)", total=ws.steps)
        for _ in range(ws.steps):
            ids, mask = _batch(rng.sample(problems, ws.batch_size), tok, encode, rng, ws.noise)
            logits = model(input_ids=ids).logits[:, :-1]
            nll = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(loss.item())
            bar.update(task, advance=1, description=f"warm start (SFT) loss {loss.item():.3f}")
    model.eval()
    transformers.utils.logging.disable_progress_bar()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return losses


def warm_start_tiny(cfg: RunConfig, problems: list[Problem], out: Path) -> list[float]:
    """pi_0 of the embedded task: the tiny Llama of `cfg.model` (dph_async/tasks/tiny_model.py) on the
    task's alphabet, warm-started on `problems` (`warm_start`) into `out`; returns the losses."""
    torch.set_num_threads(max(1, cfg.learner.threads * 2))
    tok = build_tokenizer(ALPHABET)
    model = build_tiny_llama(cfg.model, len(tok), cfg.seed)
    return warm_start(model, tok, problems, cfg, out)
