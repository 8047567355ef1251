"""KL(pi_theta || pi_base) at the sampling temperature, estimated on fresh samples of pi_theta.

For responses y ~ pi_theta^tau (softmax(logits / tau) of the current weights, full support), with
per-token log-probs of both models at the same tau and r_t = pi_base(y_t | .) / pi_theta(y_t | .):

    k1(y) = sum_t -log r_t                  unbiased for KL over sequences, can be negative
    k3(y) = sum_t (r_t - 1 - log r_t)       unbiased too (each term's expectation given the prefix is
                                            that step's KL), never negative, lower variance near 0

The estimate is the mean over prompts of each prompt's mean over its sequences, with the standard
error over prompts (s / sqrt(prompts), s the standard deviation of the prompts' means): the KL
differs from prompt to prompt, and responses to one prompt are not independent draws from the
prompt distribution. With a single prompt it is the KL given that prompt, with the standard error
over its sequences. Why fresh samples: the batch's own responses come from the
behaviour policies (stale actors, or the ref / mixp samplers), not from pi_theta. Why one
temperature throughout: sampling at tau but scoring log-probs at 1 (as the samplers paper's KL script
does) estimates neither KL at tau nor KL at 1 (tests/test_kl_monitor.py shows the gap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from dph_async.learner.batching import Sequence, pack
from dph_async.learner.logprobs import response_logprobs


@dataclass(frozen=True)
class KLEstimate:
    k1: float
    k1_se: float
    k3: float
    k3_se: float
    sequences: int

    def metrics(self) -> dict[str, float]:
        return {"kl/k1": self.k1, "kl/k1_se": self.k1_se, "kl/k3": self.k3, "kl/k3_se": self.k3_se,
                "kl/sequences": float(self.sequences)}


def sequence_terms(logp: Tensor, logp_base: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sequence k1 and k3 sums [B] (float64) from per-token log-probs [B, T] of y ~ pi_theta."""
    log_r = (logp_base.double() - logp.double()) * mask
    k1 = -log_r.sum(1)
    k3 = ((log_r.exp() - 1.0 - log_r) * mask).sum(1)
    return k1, k3


def mean_and_se(x: Tensor) -> tuple[float, float]:
    """Sample mean and its standard error s / sqrt(n); the error is nan for fewer than 2 samples."""
    n = x.numel()
    se = float(x.std(correction=1)) / math.sqrt(n) if n > 1 else float("nan")
    return float(x.mean()), se


def estimate(k1: Tensor, k3: Tensor, prompt: Tensor | None = None) -> KLEstimate:
    """Mean and standard error of k1 and k3 over sequences, or, given each sequence's prompt index and
    more than one prompt, over the prompts' means."""
    if prompt is not None and prompt.unique().numel() > 1:
        _, idx = prompt.unique(return_inverse=True)
        count = torch.bincount(idx).double()
        k1 = torch.bincount(idx, weights=k1) / count
        k3 = torch.bincount(idx, weights=k3) / count
        n = int(count.sum())
    else:
        n = k1.numel()
    (m1, s1), (m3, s3) = mean_and_se(k1), mean_and_se(k3)
    return KLEstimate(m1, s1, m3, s3, n)


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: np.ndarray, n: int, temperature: float, max_tokens: int,
           eos_id: int | None, gen: torch.Generator) -> list[np.ndarray]:
    """n responses to one prompt from softmax(logits / temperature), ancestral, full support; a
    response ends after eos_id or at max_tokens."""
    ids = torch.as_tensor(np.asarray(prompt, dtype=np.int64)).expand(n, -1)
    out = torch.empty(n, 0, dtype=torch.long)
    done = torch.zeros(n, dtype=torch.bool)
    length = torch.full((n,), max_tokens)
    for t in range(max_tokens):
        logits = model(input_ids=torch.cat([ids, out], 1)).logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
        out = torch.cat([out, nxt[:, None]], 1)
        if eos_id is not None:
            ended = ~done & (nxt == eos_id)
            length[ended] = t + 1
            done |= ended
            if bool(done.all()):
                break
    return [out[i, : int(length[i])].numpy() for i in range(n)]


class KLMonitor:
    """Every `every` versions: `samples` fresh responses of pi_theta to the batch's first prompts,
    scored by pi_theta and the frozen base at the sampling temperature."""

    def __init__(self, base: torch.nn.Module, *, every: int, samples: int, per_prompt: int, temperature: float,
                 max_tokens: int, eos_id: int | None, pad_id: int, seed: int = 0) -> None:
        self.base, self.every, self.samples, self.per_prompt = base, every, samples, per_prompt
        self.temperature, self.max_tokens, self.eos_id, self.pad_id = temperature, max_tokens, eos_id, pad_id
        self.seed = seed

    def due(self, version: int) -> bool:
        return self.every > 0 and version % self.every == 0

    def measure(self, model: torch.nn.Module, prompts: list[np.ndarray], version: int = 0) -> KLEstimate:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + version)
        was_training = model.training
        model.eval()
        units, left = [], self.samples
        for prompt in prompts:
            if left <= 0:
                break
            n = min(self.per_prompt, left)
            left -= n
            responses = sample(model, prompt, n, self.temperature, self.max_tokens, self.eos_id, gen)
            units.append([Sequence(np.asarray(prompt), r, np.zeros(len(r), np.float32)) for r in responses if len(r)])
        prompt_of = {id(s): i for i, u in enumerate(units) for s in u}
        k1s, k3s, which = [], [], []
        with torch.no_grad():
            for mb in pack([u for u in units if u], "fresh", 1 << 16, self.pad_id):
                logp, _ = response_logprobs(model, mb, self.temperature, impl="torch")
                logp_base, _ = response_logprobs(self.base, mb, self.temperature, impl="torch")
                k1, k3 = sequence_terms(logp, logp_base, mb.mask)
                k1s.append(k1)
                k3s.append(k3)
                which.append(torch.tensor([prompt_of[id(s)] for s in mb.sequences]))
        model.train(was_training)
        return estimate(torch.cat(k1s), torch.cat(k3s), torch.cat(which))
