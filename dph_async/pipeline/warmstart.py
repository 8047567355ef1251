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

from dph_async.config import RunConfig
from dph_async.progress import progress
from dph_async.tasks.catalog import ALPHABETS, TaskProblem
from dph_async.tasks.tiny_model import build_tiny_llama, build_tokenizer

WARMUP_FROM = 20  # steps from which the lr follows one cycle
# Padded tokens one forward pass of the warm start takes: 64 rows of 128. The digit tasks' batches
# (64 x at most 26) are one pass; the stride task's reach 64 x 411.
PIECE_TOKENS = 8192


def _encoder(tok: PreTrainedTokenizerFast) -> Callable[[str], list[int]]:
    """`tok.encode` without special tokens, remembered: the warm start encodes the same prompts and
    answers thousands of times, which took about a tenth of its step."""
    return functools.cache(functools.partial(tok.encode, add_special_tokens=False))


def _batch(problems: list[TaskProblem], tok: PreTrainedTokenizerFast, encode: Callable[[str], list[int]],
           rng: random.Random, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    seqs, masks = [], []
    for p in problems:
        answer = p.wrong_answer(rng) if rng.random() < noise else rng.choice(p.solutions())
        prompt = [tok.bos_token_id, *encode(p.prompt)]
        target = [*encode(answer), tok.eos_token_id]
        seqs.append(prompt + target)
        masks.append([0] * len(prompt) + [1] * len(target))
    width = max(map(len, seqs))
    ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
    return ids, loss_mask


def pieces(ids: torch.Tensor, mask: torch.Tensor, budget: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch in pieces of at most `budget` padded tokens a forward pass: whole when it fits (the
    digit tasks' batches always do), else its rows longest first, each piece cut to its longest row,
    so a batch of long-tailed lengths is not padded to its longest row (a row over the budget goes
    alone). Dropping trailing pads changes no logit before them: the model is causal."""
    n, width = ids.shape
    if n * width <= budget:
        return [(ids, mask)]
    lengths = [int(row.nonzero()[-1]) + 1 for row in mask]  # every row ends in its EOS target
    groups: list[list[int]] = []
    for i in sorted(range(n), key=lambda i: -lengths[i]):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [(ids[g, :lengths[g[0]]], mask[g, :lengths[g[0]]]) for g in groups]


def warm_start(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, problems: list[TaskProblem],
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
            opt.zero_grad(set_to_none=True)
            targets, loss = mask[:, 1:].sum(), 0.0
            for part_ids, part_mask in pieces(ids, mask, PIECE_TOKENS):
                logits = model(input_ids=part_ids).logits[:, :-1]
                nll = F.cross_entropy(logits.transpose(1, 2), part_ids[:, 1:], reduction="none")
                part = (nll * part_mask[:, 1:]).sum() / targets  # the batch's masked mean, a piece's share
                part.backward()
                loss += part.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if sched is not None:
                sched.step()
            losses.append(loss)
            bar.update(task, advance=1, description=f"warm start (SFT) loss {loss:.3f}")
    model.eval()
    transformers.utils.logging.disable_progress_bar()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return losses


def warm_start_tiny(cfg: RunConfig, problems: list[TaskProblem], out: Path) -> list[float]:
    """pi_0 of an embedded task: the tiny Llama of `cfg.model` (dph_async/tasks/tiny_model.py) on the
    alphabet of `task.name`, warm-started on `problems` (`warm_start`) into `out`; returns the losses."""
    torch.set_num_threads(max(1, cfg.learner.threads * 2))
    tok = build_tokenizer(ALPHABETS[cfg.task.name])
    model = build_tiny_llama(cfg.model, len(tok), cfg.seed)
    return warm_start(model, tok, problems, cfg, out)
