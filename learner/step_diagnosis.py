"""What drove one learner step: each group's part of the gradient, and the tokens of highest weight.

Taken before the step trains, at the weights it starts from, on the batch's first mini-batch (the
first update; with one mini-batch, the whole step):

- per group (and the reference samples as one part): its share of the mini-batch objective, the
  norm of that share's gradient, and its contribution to the norm of the whole gradient g, the
  projection <g_i, g> / |g|. The contributions add up to |g| (the shares add up to the objective);
  a group with a large contribution drove the step, one with a negative contribution pulled against
  the others.
- the fresh tokens with the largest importance weights w = pi_theta / pi_mu (at the step's start
  pi_theta is pi_prox, so this is the weight every correction mode starts from), with their group,
  completion, position, token id, policy version and both log-probs.

The gradient of each part costs one more forward and backward pass per group, twice (once for the
whole gradient, once for the projections: no per-group gradient is held), and the update is not
taken: the trainer's weights and optimizer state are left as they were.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dph_async.errors import UserError
from dph_async.learner.batching import MicroBatch, MiniBatch, Sequence, Unit
from dph_async.learner.guard import screen
from dph_async.learner.step_record import StepRecord
from dph_async.learner.trainer import Trainer
from dph_async.protocol import Batch


@dataclass
class PartContribution:
    part: str  # "group actor/seq", or "reference"
    sequences: int
    tokens: int
    loss: float  # its share of the mini-batch objective
    grad_norm: float
    contribution: float  # <g_part, g> / |g|


@dataclass
class TokenWeight:
    actor: int
    seq: int
    completion: int
    position: int
    token_id: int
    version: int  # the policy version that sampled it
    logp_learner: float
    logp_behaviour: float
    weight: float  # pi_theta / pi_mu


@dataclass
class StepDiagnosis:
    version: int
    mini_batch_loss: float
    grad_norm: float
    parts: list[PartContribution] = field(default_factory=list)
    top_tokens: list[TokenWeight] = field(default_factory=list)


def _part_loss(trainer: Trainer, micro: list[MicroBatch], mini: MiniBatch) -> torch.Tensor:
    record = StepRecord()
    return sum((trainer.share_loss(mb, mini, record) for mb in micro), torch.zeros(()))


def _flat_grad(loss: torch.Tensor, params: list[torch.nn.Parameter]) -> torch.Tensor:
    if not loss.requires_grad:  # a part with no gradient (a zero-advantage group)
        return torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).double()
                      for p, g in zip(params, grads, strict=True)])


def _parts(trainer: Trainer, mini: MiniBatch, names: dict[int, str]) -> list[tuple[str, list[Unit], list[MicroBatch]]]:
    """(name, units, micro-batches) of each group of the mini-batch, and of its reference samples."""
    out = [(names.get(id(u[0].prompt_ids), "group ?"), [u], trainer.pack_fresh([u])) for u in mini.groups]
    if mini.reference:
        refs = [[s] for s in mini.reference]
        out.append(("reference", refs, trainer.pack_reference(refs)))
    return out


def _top_tokens(trainer: Trainer, mini: MiniBatch, batch: Batch, top: int) -> list[TokenWeight]:
    where: dict[int, tuple[int, int, int, object]] = {}
    for g in batch.groups:
        for i, c in enumerate(g.completions):
            where[id(c.token_ids)] = (g.actor_id, g.seq, i, c.versions)
    found: list[TokenWeight] = []
    for mb in trainer.pack_fresh(mini.groups):
        logp = trainer.logprobs(mb)
        for row, s in enumerate(mb.sequences):
            found += _sequence_tokens(s, logp[row, : len(s.response_ids)], where)
        found = sorted(found, key=lambda t: -t.weight)[:top]
    return found


def _sequence_tokens(s: Sequence, logp: torch.Tensor, where: dict) -> list[TokenWeight]:
    actor, seq, completion, versions = where.get(id(s.response_ids), (-1, -1, -1, None))
    mu = torch.as_tensor(s.old_logprobs, dtype=torch.float64)
    weights = (logp.double() - mu).exp()
    return [TokenWeight(actor, seq, completion, t, int(s.response_ids[t]),
                        int(versions[t]) if versions is not None else -1, float(logp[t]), float(mu[t]),
                        float(weights[t])) for t in range(len(s.response_ids))]


def _contributions(trainer: Trainer, mini: MiniBatch, parts: list[tuple[str, list[Unit], list[MicroBatch]]]
                   ) -> tuple[list[PartContribution], float]:
    """Each part's loss, gradient norm and projection on the whole gradient; the whole gradient's norm."""
    params = [q for q in trainer.module.parameters() if q.requires_grad]
    total = torch.zeros(sum(q.numel() for q in params), dtype=torch.float64)
    out = []
    for name, units, micro in parts:
        loss = _part_loss(trainer, micro, mini)
        g = _flat_grad(loss, params)
        total += g
        tokens = sum(len(s.response_ids) for u in units for s in u)
        out.append(PartContribution(name, sum(len(u) for u in units), tokens, float(loss.detach()), float(g.norm()),
                                    0.0))
    norm = float(total.norm())
    for part, (_, _, micro) in zip(out, parts, strict=True):  # again: no part's gradient was kept
        g = _flat_grad(_part_loss(trainer, micro, mini), params)
        part.contribution = float(g @ total) / norm if norm > 0 else 0.0
    return out, norm


def diagnose_step(trainer: Trainer, batch: Batch, top_tokens: int = 20) -> StepDiagnosis:
    """The diagnosis of the step `trainer` is about to take on `batch` (module docstring)."""
    if trainer.critic is not None:
        raise UserError("a step of a run with a learned critic cannot be diagnosed: its per-token advantages "
                        "come from the critic's update inside the step")
    batch, _ = screen(batch, trainer.vocab)  # as train_step takes it
    mini = trainer.prepared(batch).mini_batches(trainer.cfg.mini_batches)[0]
    names = {id(g.prompt_ids): f"group {g.actor_id}/{g.seq}" for g in batch.groups}
    trainer.engine.train()
    parts, norm = _contributions(trainer, mini, _parts(trainer, mini, names))
    return StepDiagnosis(trainer.version, sum(p.loss for p in parts), norm, parts,
                         _top_tokens(trainer, mini, batch, top_tokens))
