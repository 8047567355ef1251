"""The Ray cluster a run's processes live in: a local one by default, or `launcher.address`'s."""

from __future__ import annotations

import contextlib
import glob
import logging
import os
from collections.abc import Iterator

import ray

from dph_async.config import RunConfig
from dph_async.runtime import reuse
from dph_async.runtime.actor_process import prestart_actors
from dph_async.runtime.learner_process import start_learner
from dph_async.runtime.process_env import cache_dir
from dph_async.weights_shm import remove_stale as remove_stale_segments


@contextlib.contextmanager
def _environ(**values: str) -> Iterator[None]:
    """These environment variables set for the block, then as they were."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def ray_cluster(cfg: RunConfig, prestart: bool = False) -> Iterator[None]:
    """A local Ray cluster (or a connection to `launcher.address`), shut down cleanly on exit. Inside
    one this process already holds, that one is used and left running: its owner shuts it down.
    `prestart` (a command that goes on to an RL run): on a local cluster started here, the first run's
    learner and actor processes start at once and import torch, DeepSpeed and vLLM while the driver
    goes on (`start_learner`, `prestart_actors`), instead of after its own imports and preparation."""
    owned = not ray.is_initialized()
    lc = cfg.launcher
    if owned:
        if lc.address:
            ray.init(address=lc.address, logging_level=logging.ERROR, log_to_driver=False,
                     runtime_env={"env_vars": {"DPH_CACHE_DIR": str(cache_dir())}})
        else:
            cpus = lc.num_cpus or max(os.cpu_count() or 1, cfg.actors.num_actors + cfg.learner.ranks + 1)
            # Ray runs its workers at niceness 15 so that idle pools yield the CPU; here the workers
            # (actors, learner) are the job, and at 15 they lose the cores to any other process.
            os.environ.setdefault("RAY_worker_niceness", "0")
            # "local": a new cluster even where Ray's record of a cluster started on this machine
            # (`ray start`) remains after that cluster stopped, which would make ray.init join it
            # and fail. RAY_ADDRESS, where set, still says which cluster to join.
            address = None if os.environ.get("RAY_ADDRESS") else "local"
            # The workers inherit the variable from the raylet started here. A runtime_env would say
            # the same, but Ray then cannot hand out its prestarted workers: every actor process,
            # the first RL run's actor and each run's learner among them, took 0.7 s longer to start.
            with _environ(DPH_CACHE_DIR=str(cache_dir())):
                ray.init(address=address, num_cpus=cpus, include_dashboard=False, logging_level=logging.ERROR,
                         log_to_driver=False)
            if prestart:
                start_learner(cfg)
                prestart_actors(cfg)
    try:
        yield
    finally:
        reuse.release()
        if owned:
            ray.shutdown()
        if owned and not lc.address:
            # DeepSpeed's CPU all-reduce leaves shared-memory buffers behind when ranks exit. Only a
            # cluster of our own is known to be done with them: another job may share the others.
            for f in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
                with contextlib.suppress(OSError):
                    os.remove(f)
        # A learner stopped without closing (Ctrl-C, a kill) leaves its weight segments: no process
        # holds them now.
        remove_stale_segments()
