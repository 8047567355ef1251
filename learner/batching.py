"""From a replay `Batch` to mini-batches (one optimizer step each) and padded micro-batches.

    prepared = prepare(batch, ...)                    # sequences with GRPO advantages, per group
    for mini in prepared.mini_batches(M, rng):        # groups split M ways, reference samples spread
        for mb in pack(mini.fresh_units(...), ...):   # micro-batches within a token budget

A micro-batch holds one sample type, fresh rollouts or reference (D_pef) samples, as the DPH-RL
reference implementation does. Its rows are prompts [P, Lp]; each prompt's responses sit back to
back in one packed row [P, R] (no padding between them), so the completions of a prompt share its
forward pass and no compute goes to padding (`learner/logprobs.py`). The targets are also laid out
per response, [B, T], for the loss. A piece whose row would pass `row_tokens` starts a new row
(repeating the prompt): long responses get a row each, as in the plain layout.
The learner trains on exactly the token ids the actor generated.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from dph_async.learner.losses import grpo_advantages, zero_spread_groups
from dph_async.protocol import Batch, RolloutGroup

Kind = Literal["fresh", "reference"]


@dataclass(frozen=True)
class Counts:
    """The denominators of one (mini-)batch: samples and tokens of each type, skipped ones included."""

    n_fresh: int
    fresh_tokens: int
    n_reference: int
    reference_tokens: int

    def fresh_denominator(self, aggregation: str) -> int:
        return self.fresh_tokens if aggregation == "token-mean" else self.n_fresh

    def reference_denominator(self, aggregation: str) -> int:
        return self.reference_tokens if aggregation == "token-mean" else self.n_reference

    @property
    def fresh_weight(self) -> float:
        return self.n_fresh / max(self.n_fresh + self.n_reference, 1)

    @property
    def reference_weight(self) -> float:
        return self.n_reference / max(self.n_fresh + self.n_reference, 1)



@dataclass(eq=False)
class Sequence:
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    old_logprobs: np.ndarray  # behaviour log-probs (fresh) or pi_0 log-probs (reference)
    advantage: float = 0.0
    reward: float = 0.0
    policy_weight: float = 1.0  # which distribution sampled it (Completion.policy_weight)
    # log pi_prox of each response token, recorded before the batch's first update (None until then).
    prox: torch.Tensor | None = field(default=None, repr=False)
    # With a learned critic (learner/critic.py): the per-token advantages that replace `advantage`.
    token_advantages: torch.Tensor | None = field(default=None, repr=False)


# A unit of packing: the sequences of one prompt (a GRPO group, or one reference sample).
Unit = list[Sequence]


@dataclass
class MicroBatch:
    kind: Kind
    prompt_ids: torch.Tensor  # [P, Lp] right-padded
    prompt_lens: torch.Tensor  # [P]
    packed_ids: torch.Tensor  # [P, R] each row: its prompt's responses back to back, right-padded
    segment: torch.Tensor  # [P, R] which response (0..B-1) each packed token belongs to, -1 for padding
    response_ids: torch.Tensor  # [B, T] right-padded (the targets)
    mask: torch.Tensor  # [B, T] bool, True on real response tokens
    row: torch.Tensor  # [B] the prompt row of each response
    start: torch.Tensor  # [B] where each response starts in its packed row
    old_logprobs: torch.Tensor  # [B, T]
    advantages: torch.Tensor  # [B]
    sequences: list[Sequence]  # the B sequences, in order

    @property
    def shares_prompts(self) -> bool:
        return self.prompt_ids.shape[0] < self.response_ids.shape[0]

    def prox(self) -> torch.Tensor | None:
        """[B, T] log pi_prox if every sequence has it recorded, else None."""
        return self.token_field("prox")

    def token_field(self, name: str) -> torch.Tensor | None:
        """[B, T] of a per-token field of the sequences (0 on padding), None unless all have it."""
        parts = [getattr(s, name) for s in self.sequences]
        if any(p is None for p in parts):
            return None
        out = torch.zeros(self.mask.shape, dtype=parts[0].dtype)
        for i, p in enumerate(parts):
            out[i, : len(p)] = p
        return out

    def record_prox(self, logp: torch.Tensor) -> None:
        for i, s in enumerate(self.sequences):
            s.prox = logp[i, : len(s.response_ids)].detach().clone()


@dataclass
class MiniBatch:
    """One optimizer step's share of a batch, with the denominators its objective divides by."""

    groups: list[Unit]
    reference: list[Sequence]
    counts: Counts

    def fresh_units(self, skip_zero_advantage: bool) -> list[Unit]:
        """The fresh sequences to run through the model, per prompt. Zero-advantage sequences give the
        policy loss no gradient (the PPO loss is -A r w); with skip they stay only in `counts`."""
        if not skip_zero_advantage:
            return self.groups
        kept = [[s for s in g if s.advantage != 0.0] for g in self.groups]
        return [g for g in kept if g]


@dataclass
class PreparedBatch:
    groups: list[Unit]  # fresh sequences with their advantages, one list per prompt
    reference: list[Sequence]
    filtered_groups: int  # zero-spread groups dropped by dynamic filtering
    scorer_failed: int = 0  # completions left out because their reward is the scorer's failure, not a 0
    skipped_groups: int = 0  # groups the objective formed no unit from (DPO's ties)

    @property
    def counts(self) -> Counts:
        return counts_of(self.groups, self.reference)

    def mini_batches(self, n: int, rng: random.Random | None = None) -> list[MiniBatch]:
        """Split into `n` mini-batches: the groups in order (shuffled with `rng`), as evenly as their
        number allows, and the reference samples spread the same way; each with its own counts."""
        groups, reference = list(self.groups), list(self.reference)
        if rng is not None:
            rng.shuffle(groups)
            rng.shuffle(reference)
        n = max(1, min(n, len(groups) or 1))
        parts = [groups[len(groups) * i // n: len(groups) * (i + 1) // n] for i in range(n)]
        refs = [reference[len(reference) * i // n: len(reference) * (i + 1) // n] for i in range(n)]
        return [MiniBatch(g, r, counts_of(g, r)) for g, r in zip(parts, refs, strict=True)]


def counts_of(groups: list[Unit], reference: list[Sequence]) -> Counts:
    fresh = [s for g in groups for s in g]
    return Counts(n_fresh=len(fresh), fresh_tokens=sum(len(s.response_ids) for s in fresh),
                  n_reference=len(reference), reference_tokens=sum(len(s.response_ids) for s in reference))


def group_sequences(groups: list[RolloutGroup], use_std: bool, eps: float, filter_zero_spread: bool
                    ) -> tuple[list[Unit], int, int]:
    """Fresh sequences with their GRPO advantages, one list per group; drops zero-spread groups if
    asked (DAPO's dynamic filtering). Completions whose reward is a scorer failure (a dead worker, an
    unreachable service, a bad ground truth: `RewardResult.scorer_failed`) say nothing about the
    response: they are left out before the group's mean and spread are taken, and counted.
    Returns (units, filtered groups, completions left out)."""
    units: list[Unit] = []
    filtered = failed = 0
    for g in groups:
        scored = [c for c in g.completions if not c.reward.scorer_failed]
        failed += len(g.completions) - len(scored)
        if not scored:
            continue
        rewards = torch.tensor([[c.reward.score for c in scored]], dtype=torch.float64)
        if filter_zero_spread and bool(zero_spread_groups(rewards)[0]):
            filtered += 1
            continue
        adv = grpo_advantages(rewards, use_std=use_std, eps=eps)[0]
        unit = [Sequence(g.prompt_ids, c.token_ids, c.logprobs, a, reward=c.reward.score, policy_weight=c.policy_weight)
                for c, a in zip(scored, adv.tolist(), strict=True) if len(c.token_ids)]
        if unit:
            units.append(unit)
    return units, filtered, failed


def prepare(batch: Batch, *, use_std: bool, eps: float, filter_zero_spread: bool,
            reference_pg_share: float = 0.0) -> PreparedBatch:
    """The batch as the updates take it. With `reference_pg_share` p, the first k reference samples
    get advantage +1, marking them for the policy gradient of the official script's mixed
    micro-batches (`losses.reference_pg`): k = floor(p n + u) with u the fractional part of the
    version times the golden ratio, so the share is p over steps without a random number a rerun
    would have to repeat."""
    groups, filtered, failed = group_sequences(batch.groups, use_std, eps, filter_zero_spread)
    reference = [Sequence(r.prompt_ids, r.response_ids, r.ref_logprobs) for r in batch.reference if len(r.response_ids)]
    as_pg = math.floor(reference_pg_share * len(reference) + (batch.version * _GOLDEN) % 1.0)
    for s in reference[:as_pg]:
        s.advantage = 1.0
    return PreparedBatch(groups, reference, filtered, failed)


_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def pack(units: list[Unit], kind: Kind, token_budget: int, pad_id: int, share_prompts: bool = True,
         row_tokens: int = 256) -> list[MicroBatch]:
    """Micro-batches of rows, longest first, each within `token_budget` tokens (rows x (longest
    prompt + longest packed row)). A unit's responses share one row up to `row_tokens` response
    tokens, then continue in another row that repeats the prompt; without `share_prompts` every
    response has a row of its own."""
    if share_prompts:
        pieces = [piece for u in units for piece in _cut(u, row_tokens)]
    else:
        pieces = [[s] for u in units for s in u]
    pieces.sort(key=lambda u: (len(u[0].prompt_ids) + _packed_len(u), len(u)), reverse=True)
    batches: list[list[Unit]] = []
    for u in pieces:
        if batches and _cost([*batches[-1], u]) <= token_budget:
            batches[-1].append(u)
        else:
            batches.append([u])
    return [_collate(b, kind, pad_id) for b in batches]


def _packed_len(unit: Unit) -> int:
    return sum(len(s.response_ids) for s in unit)


def _cost(units: list[Unit]) -> int:
    return len(units) * (max(len(u[0].prompt_ids) for u in units) + max(_packed_len(u) for u in units))


def _cut(unit: Unit, row_tokens: int) -> list[Unit]:
    """Consecutive runs of the unit's sequences whose responses fit `row_tokens` (at least one each)."""
    pieces: list[Unit] = []
    for s in unit:
        if pieces and _packed_len(pieces[-1]) + len(s.response_ids) <= row_tokens:
            pieces[-1].append(s)
        else:
            pieces.append([s])
    return pieces


def _collate(units: list[Unit], kind: Kind, pad_id: int) -> MicroBatch:
    seqs = [s for u in units for s in u]
    p, b = len(units), len(seqs)
    lp = max(len(u[0].prompt_ids) for u in units)
    r = max(_packed_len(u) for u in units)
    t = max(len(s.response_ids) for s in seqs)
    prompt_ids = torch.full((p, lp), pad_id, dtype=torch.long)
    prompt_lens = torch.tensor([len(u[0].prompt_ids) for u in units], dtype=torch.long)
    packed_ids = torch.full((p, r), pad_id, dtype=torch.long)
    segment = torch.full((p, r), -1, dtype=torch.long)
    response_ids = torch.full((b, t), pad_id, dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.bool)
    old = torch.zeros((b, t), dtype=torch.float32)
    row = torch.zeros(b, dtype=torch.long)
    start = torch.zeros(b, dtype=torch.long)
    i = 0
    for j, u in enumerate(units):
        prompt_ids[j, : len(u[0].prompt_ids)] = torch.from_numpy(np.asarray(u[0].prompt_ids, dtype=np.int64))
        offset = 0
        for s in u:
            n = len(s.response_ids)
            ids = torch.from_numpy(np.asarray(s.response_ids, dtype=np.int64))
            packed_ids[j, offset:offset + n] = ids
            segment[j, offset:offset + n] = i
            response_ids[i, :n] = ids
            mask[i, :n] = True
            old[i, :n] = torch.from_numpy(np.asarray(s.old_logprobs, dtype=np.float32))
            row[i], start[i] = j, offset
            offset += n
            i += 1
    adv = torch.tensor([s.advantage for s in seqs], dtype=torch.float32)
    return MicroBatch(kind, prompt_ids, prompt_lens, packed_ids, segment, response_ids, mask, row, start, old, adv,
                      seqs)
