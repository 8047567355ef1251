"""The trainer's half of a learner process (dph_async/runtime/learner_process.py): the trainer and the
learner loop, with torch, transformers and DeepSpeed imported at the top. A learner process imports
this module in its __init__, before any call (its `setup` builds the trainer), and so does
`dph-async rerun`, which trains in its own process; the driver, which imports learner_process.py to
start the processes, never does.
"""

from __future__ import annotations

import os

from dph_async.paths import torch_extensions_dir

# DeepSpeed reads TORCH_EXTENSIONS_DIR (where its compiled ops are) when imported: set before it is.
os.environ["TORCH_EXTENSIONS_DIR"] = torch_extensions_dir()

import deepspeed  # noqa: F401  (with this module, ahead of the trainer's build)
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dph_async.config import RunConfig
from dph_async.learner.data_parallel import Rendezvous
from dph_async.learner.loop import LearnerLoop
from dph_async.learner.recording import write_run_info
from dph_async.learner.trainer import Trainer, follow

# What the learner's processes build a run's trainer and loop from.
__all__ = ["LearnerLoop", "build_trainer", "follow", "write_run_info"]


def build_trainer(cfg: RunConfig, model_dir: str, rendezvous: Rendezvous | None
                  ) -> tuple[Trainer, PreTrainedTokenizerBase]:
    """The learner's trainer (model, DeepSpeed engine) as rank `rendezvous.rank` (None: the only
    rank), and the model's tokenizer."""
    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(model_dir, cfg.learner, temperature=cfg.sampling.temperature, dtype=cfg.model.dtype,
                      pad_id=pad, max_response_tokens=cfg.sampling.max_tokens, seed=cfg.seed, rendezvous=rendezvous)
    return trainer, tokenizer
