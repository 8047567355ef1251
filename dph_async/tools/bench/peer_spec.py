"""What every system of `dph-async bench peer` is asked to do: light, so the command line can
import it without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PeerSpec:
    """The work every system of `dph-async bench peer` does (written as JSON for the peers)."""

    model: str  # a Hugging Face causal-LM directory (fp32)
    data: str  # verl-format parquet
    steps: int
    prompts_per_step: int
    n: int
    max_tokens: int
    lr: float
    temperature: float
    grad_clip: float
    weight_decay: float
    seed: int
    max_prompt_tokens: int
    # `bench tta`: keep the weights every this many steps and at the last (0: never), each as a model
    # directory `<save_dir>/v<step>` (the model's files with the step's weights), for the project's
    # evaluator; the time the writing takes is left out of the run's clock.
    save_every: int = 0
    save_dir: str = ""
