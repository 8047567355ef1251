"""From a replay `Batch` to padded micro-batches packed by a token budget.

Each micro-batch holds one sample type, fresh rollouts or reference (D_pef) samples, as the DPH-RL
reference implementation does. The learner trains on exactly the token ids the actor generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from dph_async.protocol import Batch, RolloutGroup
from learner.losses import grpo_advantages, zero_spread_groups

Kind = Literal["fresh", "reference"]


@dataclass
class Sequence:
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    old_logprobs: np.ndarray  # behaviour log-probs (fresh) or pi_0 log-probs (reference)
    advantage: float = 0.0


@dataclass
class MicroBatch:
    kind: Kind
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, T] index of the hidden state that predicts each response token
    targets: torch.Tensor  # [B, T] response token ids
    mask: torch.Tensor  # [B, T] bool, True on real response tokens
    old_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]

    @property
    def num_sequences(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class PreparedBatch:
    fresh: list[MicroBatch]
    reference: list[MicroBatch]
    n_fresh: int  # fresh samples (completions) trained on
    n_reference: int
    fresh_tokens: int
    reference_tokens: int
    filtered_groups: int  # zero-spread groups dropped by dynamic filtering


def group_sequences(groups: list[RolloutGroup], use_std: bool, eps: float, filter_zero_spread: bool
                    ) -> tuple[list[Sequence], int]:
    """Fresh sequences with their GRPO advantages; drops zero-spread groups if asked (DAPO)."""
    seqs: list[Sequence] = []
    filtered = 0
    for g in groups:
        rewards = torch.tensor([[c.reward.score for c in g.completions]], dtype=torch.float64)
        if filter_zero_spread and bool(zero_spread_groups(rewards)[0]):
            filtered += 1
            continue
        adv = grpo_advantages(rewards, use_std=use_std, eps=eps)[0]
        for c, a in zip(g.completions, adv.tolist(), strict=True):
            if len(c.token_ids):
                seqs.append(Sequence(g.prompt_ids, c.token_ids, c.logprobs, a))
    return seqs, filtered


def pack(seqs: list[Sequence], kind: Kind, token_budget: int, pad_id: int) -> list[MicroBatch]:
    """Longest first; a micro-batch grows while (sequences x padded length) stays within the budget."""
    order = sorted(seqs, key=lambda s: len(s.prompt_ids) + len(s.response_ids), reverse=True)
    batches: list[list[Sequence]] = []
    for s in order:
        length = len(s.prompt_ids) + len(s.response_ids)
        if batches and (len(batches[-1]) + 1) * max(length, _width(batches[-1])) <= token_budget:
            batches[-1].append(s)
        else:
            batches.append([s])
    return [_collate(b, kind, pad_id) for b in batches]


def _width(seqs: list[Sequence]) -> int:
    return max(len(s.prompt_ids) + len(s.response_ids) for s in seqs)


def _collate(seqs: list[Sequence], kind: Kind, pad_id: int) -> MicroBatch:
    b, width = len(seqs), _width(seqs)
    t = max(len(s.response_ids) for s in seqs)
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    positions = torch.zeros((b, t), dtype=torch.long)
    targets = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    old = torch.zeros((b, t), dtype=torch.float32)
    for i, s in enumerate(seqs):
        p, r = len(s.prompt_ids), len(s.response_ids)
        input_ids[i, :p] = torch.from_numpy(np.asarray(s.prompt_ids, dtype=np.int64))
        input_ids[i, p:p + r] = torch.from_numpy(np.asarray(s.response_ids, dtype=np.int64))
        attention[i, :p + r] = 1
        # The hidden state at position j predicts token j + 1.
        positions[i, :r] = torch.arange(p - 1, p + r - 1)
        targets[i, :r] = input_ids[i, p:p + r]
        mask[i, :r] = True
        old[i, :r] = torch.from_numpy(np.asarray(s.old_logprobs, dtype=np.float32))
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    return MicroBatch(kind, input_ids, attention, positions, targets, mask, old, adv)


def prepare(batch: Batch, *, use_std: bool, eps: float, filter_zero_spread: bool, token_budget: int,
            pad_id: int) -> PreparedBatch:
    fresh, filtered = group_sequences(batch.groups, use_std, eps, filter_zero_spread)
    reference = [Sequence(r.prompt_ids, r.response_ids, r.ref_logprobs) for r in batch.reference if len(r.response_ids)]
    return PreparedBatch(
        fresh=pack(fresh, "fresh", token_budget, pad_id),
        reference=pack(reference, "reference", token_budget, pad_id),
        n_fresh=len(fresh),
        n_reference=len(reference),
        fresh_tokens=sum(len(s.response_ids) for s in fresh),
        reference_tokens=sum(len(s.response_ids) for s in reference),
        filtered_groups=filtered,
    )
