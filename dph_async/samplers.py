"""The actors' sampling distributions (`actors.sampler`): one registered object per sampler.

A sampler gives completion j of a group the policy weight a_j, cycling through its
`policy_weights`; the completion samples each token from

    pi_a(. | x, y_<t) = softmax((a z_theta + (1 - a) z_ref) / temperature)

(z_theta: the current weights' logits, z_ref: pi_0's) and records log pi_a(y_t | .) as its behaviour
log-prob (actors/mixture.py). What a sampler needs follows from its weights: one that mixes in pi_0
(any a != 1) runs the mixture engine on the driver's node, which holds pi_0, and its process cannot
be reset for a later run; the policy alone (a = 1) runs on vLLM anywhere. The config's allowed
values, the launcher's choice of engine and the bandit simulation (dph_async/tools/sampler_bandit.py)
all come from `SAMPLERS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Sampler:
    name: str
    policy_weights: tuple[float, ...]
    summary: str

    @property
    def uses_reference(self) -> bool:
        """Mixes pi_0's logits in: the mixture engine, on the driver's node (the only one holding pi_0)."""
        return any(a != 1.0 for a in self.policy_weights)

    @property
    def engine(self) -> Literal["vllm", "mixture"]:
        return "mixture" if self.uses_reference else "vllm"

    def weights(self, n: int) -> list[float]:
        """The policy weight of each of a group's n completions (the sampler's weights, in turn)."""
        return [self.policy_weights[j % len(self.policy_weights)] for j in range(n)]


SAMPLERS: dict[str, Sampler] = {s.name: s for s in (
    Sampler("online", (1.0,), "pi_theta itself (on-policy DPO; GRPO's sampler)"),
    Sampler("ref", (0.0,), "the frozen pi_0 (vanilla DPO on reference samples)"),
    Sampler("gshf", (1.0, 0.0), "half the completions from each"),
    Sampler("mixp", (1.5, 0.5), "the samplers paper's mixture: pi_theta^1.5 pi_0^-0.5 and pi_theta^0.5 pi_0^0.5"),
)}


def sampler(name: str) -> Sampler:
    try:
        return SAMPLERS[name]
    except KeyError:
        raise ValueError(f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}") from None
