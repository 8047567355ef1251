"""Actor processes kept from one RL run for the next, so that a later run skips vLLM's import and
engine build (about 12 s of one core here; docs/decisions.md, "Actors kept between runs").

Within an invocation (`launcher.reuse_actors`) the driver remembers the processes it kept
(`dph_async.runtime.reuse`, the one place that holds what is kept). With
`launcher.keep_actors_s` on a cluster that outlives the invocation (`launcher.address`), a kept
process also outlives it: it is a detached Ray actor named after its engine settings, in the
`POOL_NAMESPACE` namespace, and the next invocation with the same settings finds it by that name.
A process serves one driver at a time (`ActorProcess.take` answers yes once, until the process is
kept again) and ends itself once no driver has called it for `keep_actors_s` seconds: an idle one
after the last run that used it, a running one whose driver died.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import ray
from ray.exceptions import RayActorError

from dph_async.config import RunConfig
from dph_async.runtime import reuse

POOL_NAMESPACE = "dph-async"
# A driver calls each running actor this often (`touch`), so the shortest keep_actors_s is a few times it.
TOUCH_EVERY_S = 2.0


def engine_settings(cfg: RunConfig, model_dir: Path) -> tuple:
    """Everything an actor's process and engine were made from, but its id and its weights: a run that
    differs in any of it gets new processes. The model directory counts by the bytes of its files
    other than the weights (config, tokenizer), not by its path: another run directory's copy of the
    same model fits, and a model rewritten under the same path does not. The weights are what a reset
    loads from the run's own directory."""
    m, a = cfg.model, cfg.actors
    files = hashlib.sha256()
    for f in sorted(model_dir.iterdir()) if model_dir.is_dir() else ():
        if f.is_file() and f.suffix not in (".safetensors", ".bin"):  # the weights: a reset reloads them
            files.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return (files.hexdigest(), m.dtype, m.max_model_len, cfg.seed, a.sampler, a.kv_cache_gib,
            a.threads, a.cpu_gemm, a.compile, a.share_prefill, cfg.launcher.max_actor_restarts)


def _prefix(key: tuple) -> str:
    return f"dph-actor-{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}-"


def new_actor_options(key: tuple, keep_s: float) -> dict:
    """Ray options for a new actor process for `key`: named and detached when it may outlive the
    invocation (a unique name: several drivers may make processes of the same settings)."""
    if keep_s <= 0:
        return {}
    return {"name": f"{_prefix(key)}{uuid.uuid4().hex[:8]}", "namespace": POOL_NAMESPACE, "lifetime": "detached"}


def _taken(actor: ray.actor.ActorHandle, keep_s: float) -> bool:
    """Whether `actor` is now this driver's: it answered and no other driver holds it."""
    try:
        return ray.get(actor.take.remote(keep_s), timeout=30)
    except (RayActorError, ray.exceptions.GetTimeoutError):  # died while kept: a new one instead
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
        return False


def take(key: tuple, keep_s: float) -> ray.actor.ActorHandle | None:
    """A kept actor process for `key` that still answers and is free, or None: first one this driver
    kept, then (keep_s > 0) one that an earlier invocation left on the cluster."""
    kept = reuse.take_actor(key)
    if kept is not None and _taken(kept, keep_s):
        return kept
    if keep_s <= 0:
        return None
    prefix = _prefix(key)
    for name, actor in _pool():
        if name.startswith(prefix) and _taken(actor, keep_s):
            return actor
    return None


def _pool() -> list[tuple[str, ray.actor.ActorHandle]]:
    """(name, handle) of every kept actor process on the cluster that still exists."""
    found = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == POOL_NAMESPACE and entry["name"].startswith("dph-actor-"):
            with contextlib.suppress(ValueError):  # ended since it was listed
                found.append((entry["name"], ray.get_actor(entry["name"], namespace=POOL_NAMESPACE)))
    return found


def describe_pool() -> list[dict]:
    """Every process the pool holds (`ActorProcess.describe`, plus its name), for an operator."""
    rows = []
    for name, actor in _pool():
        with contextlib.suppress(RayActorError, ray.exceptions.GetTimeoutError):
            rows.append({"name": name, **ray.get(actor.describe.remote(), timeout=30)})
    return rows


def end_idle() -> list[str]:
    """End the pool's processes that no run holds; returns their names. Each is taken first, as a
    driver would take it, so that one a run takes meanwhile is left alone."""
    ended = []
    for name, actor in _pool():
        if _taken(actor, 0.0):
            ray.kill(actor, no_restart=True)
            ended.append(name)
    return ended


def keep(actor: ray.actor.ActorHandle, key: tuple, outlives: bool) -> bool:
    """Close the actor's run and keep its process for the next run; False if it did not answer."""
    try:
        ray.get(actor.unbind.remote(), timeout=60)
    except (RayActorError, ray.exceptions.GetTimeoutError):
        return False
    reuse.put_actor(key, actor, outlives)
    return True


@contextlib.contextmanager
def holding(actors: list[ray.actor.ActorHandle], keep_s: float) -> Iterator[None]:
    """While the block runs, tell `actors` every TOUCH_EVERY_S that their driver is alive: a process
    that outlives the invocation ends itself keep_s after the calls stop (its driver died, or the run
    ended and no one took it)."""
    if keep_s <= 0:
        yield
        return
    done = threading.Event()

    def touch() -> None:
        while not done.wait(TOUCH_EVERY_S):
            for actor in actors:
                actor.touch.remote()

    toucher = threading.Thread(target=touch, name="actor-touch", daemon=True)
    toucher.start()
    try:
        yield
    finally:
        done.set()
        toucher.join()
