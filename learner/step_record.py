"""What one batch's updates saw, gathered on each rank and merged over the ranks (learner/data_parallel.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dph_async.learner.losses import PolicyLoss


@dataclass
class StepRecord:
    """What one batch's updates saw: the fresh tokens' per-token outputs (flattened, detached), the
    objective's parts summed per mini-batch, and the time in each phase."""

    tokens: list[tuple[PolicyLoss, torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    parts: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    loss: list[torch.Tensor] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    trained_tokens: int = 0
    skipped: int = 0  # updates skipped for a non-finite loss or gradient
    # Gradient of each part of the first mini-batch's objective (fresh, reference), when diagnosed.
    grads: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def add_parts(self, parts: dict[str, torch.Tensor]) -> None:
        for k, v in parts.items():
            self.parts.setdefault(k, []).append(v)

    def time(self, phase: str, start: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - start
        return now
