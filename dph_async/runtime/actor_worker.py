"""The half of an actor's Ray process (`ActorProcess`, dph_async/runtime/actor_process.py) that needs torch:
the rollout worker, the weight client, the engines, and the model shipped from the learner. The
process imports this module in its __init__, before any call; the driver, which imports
actor_process.py to start the processes, never does. vLLM loads with an online sampler's engine only
(`vllm_engine`): a mixture sampler's process never imports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dph_async.actors.mixture import MixtureEngine
from dph_async.actors.rollout import RolloutWorker
from dph_async.actors.weight_client import WeightClient
from dph_async.config import RunConfig
from dph_async.runtime.model_shipping import first_weights, materialize

if TYPE_CHECKING:
    from dph_async.actors.engine import VLLMEngine

# What ActorProcess builds its run's parts from.
__all__ = ["MixtureEngine", "RolloutWorker", "WeightClient", "first_weights", "materialize", "online_engine",
           "vllm_engine"]


def vllm_engine() -> type[VLLMEngine]:
    """vLLM's engine class, vLLM imported with it (by an online sampler's process, in its __init__)."""
    # heavy (vLLM, about 8 CPU-s): an online sampler's process only; a mixture sampler's never loads it
    from dph_async.actors.engine import VLLMEngine

    return VLLMEngine


def online_engine(cfg: RunConfig, model_dir: str, actor_id: int, version: int = 0) -> VLLMEngine:
    """Actor `actor_id`'s vLLM engine of `model_dir`'s weights (an online sampler's)."""
    return vllm_engine()(model_dir, dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
                         seed=cfg.seed + 1000 * actor_id, kv_cache_gib=cfg.actors.kv_cache_gib,
                         threads=cfg.actors.threads, version=version, cpu_gemm=cfg.actors.cpu_gemm,
                         compile_model=cfg.actors.compile, share_prefill=cfg.actors.share_prefill)
