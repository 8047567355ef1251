"""The half of a learner process (dph_async/runtime/learner_process.py) that needs torch but no trainer:
the weight server and the ranks' rendezvous, which `bind` opens before the actors start, and the
model shipped to actors on other nodes. The process imports this module in its __init__, then the
trainer's (learner_trainer.py), before any call, while the new actor processes import vLLM. The
driver never imports it.
"""

from __future__ import annotations

import torch

from dph_async.learner.data_parallel import Rendezvous, private_dir
from dph_async.learner.publish import WeightServer
from dph_async.runtime.model_shipping import pack

# What the learner's processes open a run's services from.
__all__ = ["Rendezvous", "WeightServer", "empty_gpu_cache", "pack", "private_dir"]


def empty_gpu_cache() -> None:
    """Hand the GPU's cached blocks back: an idle kept process must not hold memory an engine could use."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
