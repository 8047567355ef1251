"""What every engine shares (actors/engine.py's vLLM engine, actors/mixture.py's): the sampling
spec, the samples, the interface the rollout drives, and the clock of the model's forward passes.
Light (no torch, no vLLM at import): the rollout, the evaluation and the driver use these types
without loading an engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class Sample:
    """One completion; `versions[i]` is the policy version that produced `token_ids[i]`."""

    key: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""
    text: str = ""
    policy_weight: float = 1.0  # which distribution sampled it (actors/mixture.py); 1: the policy


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    n: int = 1
    seed: int | None = None
    # Each token's log-prob in the samples. Evaluation needs none, and without them vLLM builds no
    # log-prob objects: about a fifth of an evaluation's CPU on the embedded default.
    logprobs: bool = True


class Engine(Protocol):
    version: int
    shares_weights: bool  # whether load_weights(keep=True) may keep views of the tensors it is given
    forward_seconds: float  # CPU-seconds in the model's forward passes; the rest of a step is bookkeeping

    def add(self, key: str, prompt_ids: Sequence[int], spec: SamplingSpec, n: int = 1) -> None: ...
    def step(self) -> list[Sample]: ...
    def has_unfinished(self) -> bool: ...
    def abort(self, keys: Sequence[str]) -> None: ...
    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int, keep: bool = False) -> bool:
        """Load `tensors` as version `version`; returns whether the engine now runs on views of them."""
    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec) -> list[list[Sample]]: ...



class ForwardClock:
    """CPU-seconds of the calling thread inside the hooked modules' forward passes.

    What separates an engine step's arithmetic from its bookkeeping (scheduling, sampling, output
    objects): the split that says how far a cheaper engine could take a step (docs/benchmarks.md).
    Thread time, as the engine runs its model on the thread that steps it.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def hook(self, *modules: torch.nn.Module) -> None:
        for m in modules:
            m.register_forward_pre_hook(self._enter)
            m.register_forward_hook(self._exit)

    def _enter(self, *_: object) -> None:
        self._start = time.thread_time()

    def _exit(self, *_: object) -> None:
        self.seconds += time.thread_time() - self._start
