"""What a driver keeps between its runs, in one place: processes already started, so that a later run
skips their imports and engine builds (docs/decisions.md, "Actors kept between runs, and the learner
and pre-sampling with them").

    spares   actor processes started with a local cluster, before the first run's model is known
             (`actor_process.prestart_actors`), by `spare_key`: the first new actor of that id and
             those options takes one
    actors   actor processes a run closed and kept for the next run of the same engine settings, by
             `actor_process.actor_key`, each with whether it outlives the invocation
             (`launcher.keep_actors_s`: named and detached; `actor_pool` finds those on the cluster)
    learner  the learner process the last run kept, or one started ahead for the next

Taking a process removes it from here; `release` ends what is left, and its memory goes back. Only the
driver's thread calls these (its stages run one after another), so nothing here is locked.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from dph_async.config import RunConfig


@dataclass(frozen=True)
class KeptLearner:
    handle: ray.actor.ActorHandle
    group: PlacementGroup
    name: str  # actors find the learner by it


@dataclass
class Kept:
    spares: dict[tuple, ray.actor.ActorHandle] = field(default_factory=dict)
    actors: dict[tuple, tuple[ray.actor.ActorHandle, bool]] = field(default_factory=dict)
    learner: KeptLearner | None = None


KEPT = Kept()


def spare_key(cfg: RunConfig, actor_id: int) -> tuple:
    """What a spare must match besides the node: the options its process was started with."""
    return actor_id, cfg.launcher.max_actor_restarts, cfg.actors.threads


def has_spare(key: tuple) -> bool:
    return key in KEPT.spares


def put_spare(key: tuple, handle: ray.actor.ActorHandle) -> None:
    KEPT.spares[key] = handle


def take_spare(key: tuple) -> ray.actor.ActorHandle | None:
    return KEPT.spares.pop(key, None)


def put_actor(key: tuple, handle: ray.actor.ActorHandle, outlives: bool) -> None:
    KEPT.actors[key] = (handle, outlives)


def take_actor(key: tuple) -> ray.actor.ActorHandle | None:
    kept = KEPT.actors.pop(key, None)
    return None if kept is None else kept[0]


def put_learner(learner: KeptLearner) -> None:
    KEPT.learner = learner


def has_learner() -> bool:
    return KEPT.learner is not None


def take_learner() -> KeptLearner | None:
    learner, KEPT.learner = KEPT.learner, None
    return learner


def end_learner(learner: KeptLearner) -> None:
    with contextlib.suppress(Exception):  # already gone with its cluster
        ray.kill(learner.handle, no_restart=True)
        remove_placement_group(learner.group)


def release(spares: bool = True, actors: bool = True, learner: bool = True) -> None:
    """End what is kept of the kinds asked: spares no run took, the actor processes kept for this
    invocation only (those that outlive it are only forgotten: they stay for a later invocation until
    their idle time runs out), the kept learner."""
    ending = [*(KEPT.spares.values() if spares else ()),
              *(h for h, outlives in (KEPT.actors.values() if actors else ()) if not outlives)]
    for handle in ending:
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)
    if spares:
        KEPT.spares.clear()
    if actors:
        KEPT.actors.clear()
    if learner and (kept := take_learner()) is not None:
        end_learner(kept)
