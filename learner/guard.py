"""The learner's own guard: no batch, step or published weights with a non-finite number in them.

The replay refuses what the learner must not see (replay/validation.py); this is the defence behind
it, for whatever still gets through (a bug upstream, a replay without the model's vocabulary):

- `screen`: groups and reference samples with an id outside the vocabulary or a non-finite reward
  or log-prob leave the batch before anything is computed on them, each with its reason.
- `StepGuard`: an update whose loss or gradient is not finite is skipped (weights and optimizer
  state unchanged) and counted; `max_skipped` skipped batches in a row stop the run with one error
  naming the groups and actors that fed them.
- `check_finite`: weights with a non-finite value are never published.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch

from dph_async.errors import UserError
from dph_async.protocol import Batch, ReferenceSample, RolloutGroup

log = logging.getLogger(__name__)


class NonFiniteTraining(UserError):
    """Training kept meeting non-finite numbers (a reward function's NaN, a poisoned peer): the run
    stops rather than publish or keep weights built from them."""


def _ids_problem(ids: np.ndarray, vocab: int) -> str | None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return f"token ids span [{ids.min()}, {ids.max()}], outside the vocabulary [0, {vocab})"
    return None


def _logprobs_problem(logprobs: np.ndarray) -> str | None:
    if logprobs.size and not np.isfinite(logprobs).all():
        return "a non-finite log-prob"
    return None


def group_problem(group: RolloutGroup, vocab: int) -> str | None:
    if (problem := _ids_problem(group.prompt_ids, vocab)) is not None:
        return problem
    for c in group.completions:
        if not math.isfinite(c.reward.score):
            return f"reward {c.reward.score}"
        if (problem := _ids_problem(c.token_ids, vocab) or _logprobs_problem(c.logprobs)) is not None:
            return problem
    return None


def reference_problem(sample: ReferenceSample, vocab: int) -> str | None:
    ids = (_ids_problem(sample.prompt_ids, vocab) or _ids_problem(sample.response_ids, vocab))
    return ids or _logprobs_problem(sample.ref_logprobs)


def screen(batch: Batch, vocab: int) -> tuple[Batch, dict[str, str]]:
    """The batch without what the learner cannot train on, and {what: why} for what was taken out
    (groups as "actor/seq", reference samples by id)."""
    removed: dict[str, str] = {}
    groups, reference = [], []
    for g in batch.groups:
        if (problem := group_problem(g, vocab)) is None:
            groups.append(g)
        else:
            removed[f"{g.actor_id}/{g.seq}"] = problem
    for r in batch.reference:
        if (problem := reference_problem(r, vocab)) is None:
            reference.append(r)
        else:
            removed[r.sample_id] = problem
    if not removed:
        return batch, removed
    log.error("learner: took %d records out of batch %d: %s", len(removed), batch.version,
              "; ".join(f"{k}: {v}" for k, v in list(removed.items())[:5]))
    return msgspec.structs.replace(batch, groups=groups, reference=reference), removed


def all_finite(tensors: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def check_finite(state: dict[str, torch.Tensor], version: int) -> None:
    """Raise rather than let weights with a NaN or an infinity leave the learner."""
    bad = [name for name, t in state.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        names = ", ".join(bad[:3]) + (", ..." if len(bad) > 3 else "")
        raise NonFiniteTraining(f"learner: the weights of version {version} hold non-finite values in {len(bad)} "
                                f"tensors ({names}); they are not published, the run stops")


@dataclass
class StepGuard:
    """Counts skipped updates; stops the run after `max_skipped` batches in a row had one."""

    max_skipped: int
    skipped_updates: int = 0
    in_a_row: int = 0
    sources: Counter[int] = field(default_factory=Counter)  # actor id -> groups in the skipped batches
    groups: list[str] = field(default_factory=list)

    def after_batch(self, batch: Batch, skipped: int, version: int) -> None:
        """Account one batch whose updates were `skipped` of all (0: a healthy batch)."""
        if not skipped:
            self.in_a_row, self.groups = 0, []
            self.sources.clear()
            return
        self.skipped_updates += skipped
        self.in_a_row += 1
        self.sources.update(g.actor_id for g in batch.groups)
        self.groups += [f"{g.actor_id}/{g.seq}" for g in batch.groups]
        log.error("learner: batch %d: %d updates skipped (non-finite loss or gradient); groups %s", version,
                  skipped, ", ".join(f"{g.actor_id}/{g.seq}" for g in batch.groups))
        if self.max_skipped and self.in_a_row >= self.max_skipped:
            actors = ", ".join(f"actor {a} ({n} groups)" for a, n in self.sources.most_common())
            raise NonFiniteTraining(
                f"learner: {self.in_a_row} batches in a row (up to version {version}) had a non-finite loss or "
                f"gradient; they came from {actors}: groups {', '.join(self.groups[:12])}"
                f"{' ...' if len(self.groups) > 12 else ''}. Check the reward function and those actors; "
                "learner.max_skipped_steps sets how many in a row stop the run")
