"""Ray starts and watches the processes of an RL run: one learner (hosting the replay service and
the weight server) and N vLLM actors, each a Ray actor in its own process. With `learner.ranks` = R
the learner is rank 0 of R data-parallel ranks, the others a Ray actor each in the learner's
placement group (`learner.data_parallel`).

A local Ray cluster is started by default; `launcher.address` joins an existing one. An actor that
dies is restarted by Ray (up to `launcher.max_actor_restarts` times) and resumes its prompt stream
from the replay's record of what it already delivered; the run goes on. Ctrl-C stops everything.
The actors' processes outlive a run for the next one of the same invocation when its engine settings
match (`launcher.reuse_actors`): the engine is reset to pi_0 instead of being imported and built again.
So does a one-rank learner's process (`launcher.reuse_learner`): the next run builds only its trainer.
On a cluster the learner stays on the driver's node and the actors go to the worker nodes
(dph_async/runtime/placement.py); an actor on another node gets the model, the prompts and the weights
from the learner (dph_async/runtime/model_shipping.py), and one whose node is lost restarts elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dph_async.config import RunConfig
from dph_async.paths import final_model
from dph_async.progress import progress
from dph_async.replay_stats import ReplayStats
from dph_async.run_stats import ActorStats, LearnerStats, RLResult
from dph_async.runtime import reuse
from dph_async.runtime.actor_pool import holding, keep, take
from dph_async.runtime.actor_process import actor_key, new_actor, wait_restarted
from dph_async.runtime.cpu_claims import Claim, claim_cores, release_cores
from dph_async.runtime.cpu_cores import host_cores, pin, plan_cores
from dph_async.runtime.learner_process import LearnerRank, acquire_learner, keep_learner
from dph_async.runtime.placement import actor_placement, home_node

log = logging.getLogger(__name__)


@dataclass
class _Pinning:
    """Where the processes of the driver's host were pinned, and what the run claimed for that."""

    cores: dict[str, list[int]] = field(default_factory=dict)  # by name ("learner": every rank)
    local: dict[str, int] = field(default_factory=dict)  # pids of the run's processes on the driver's host
    claim: Claim | None = None  # released when the run ends (cpu_claims.py)
    shared_with: list[str] = field(default_factory=list)  # other invocations' claims, where they left too few


def _pin_cores(cfg: RunConfig, pids: dict[str, int], nodes: dict[str, list[tuple[str, str]]]) -> _Pinning:
    """Pin the run's processes on the driver's host (`pids`: actor{i}, learner, learner{r}) to cores of
    their own (dph_async/runtime/cpu_cores.py) among those no other invocation on the host has claimed, and
    claim them. Where the plan leaves the OS to place them (too few cores, or too few left by the
    others: then the run says with whom it shares), they get every core (a kept process may come
    pinned from an earlier run)."""
    if not cfg.launcher.pin_cores:
        return _Pinning()
    home = home_node()
    local = {name: pid for name, pid in pids.items() if not name.startswith("actor") or nodes[name][-1][1] == home}
    actors = [name for name in local if name.startswith("actor")]
    threads, learner = cfg.actors.threads, max(1, cfg.learner.ranks * cfg.learner.threads)
    taken = claim_cores(host_cores(), lambda free: plan_cores(free, len(actors), threads, learner),
                 lambda plan: [c for cores in plan.actors for c in cores] + plan.learner)
    plan, shared = taken.plan, []
    if plan is None and taken.others and plan_cores(host_cores(), len(actors), threads, learner) is not None:
        shared = [c.describe() for c in taken.others]
        log.warning("cores: other invocations on this host hold the cores this run would pin (%s): it shares "
                    "them, its processes placed by the OS", "; ".join(shared))
    cores = {} if plan is None else dict(zip(actors, plan.actors, strict=True)) | {"learner": plan.learner}
    for name, pid in local.items():
        pin(pid, cores.get(name) or cores.get("learner") or host_cores())
    if cores:
        log.info("cores: %s", cores)
    return _Pinning(cores, local, taken.claim, shared)


def _repin(name: str, pids: dict[str, int], nodes: dict[str, list[tuple[str, str]]], cores: dict[str, list[int]],
           local: dict[str, int]) -> None:
    """A restarted actor of the driver's host back on its cores, or out of `local` if Ray restarted it
    on another node."""
    if nodes[name][-1][1] == home_node():
        local[name] = pids[name]
        pin(pids[name], cores.get(name) or host_cores())
    else:
        del local[name]


def _spare_cores(cfg: RunConfig, cores: dict[str, list[int]], local: dict[str, int], name: str) -> list[int] | None:
    """Where pinned actor `name`'s other threads go at the start of its run (cpu_cores.offload_threads), so
    that its rollout loop keeps its cores to itself: the learner's. None for an actor not pinned here,
    and for engines of several threads (their OpenMP workers would be among the others)."""
    return cores["learner"] if name in cores and name in local and cfg.actors.threads == 1 else None


@dataclass
class _Run:
    """The processes of one RL run as the driver holds them, and what it learns of them on the way."""

    cfg: RunConfig
    learner: ray.actor.ActorHandle
    pg: PlacementGroup
    learner_name: str
    actors: list[ray.actor.ActorHandle]
    keys: list[tuple]
    ranks: list[ray.actor.ActorHandle]
    start: float
    bind_args: tuple = ()
    reusable: list[bool] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)
    nodes: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    pinning: _Pinning = field(default_factory=_Pinning)
    phases: dict[str, float] = field(default_factory=dict)
    follows: dict[ray.ObjectRef, int] = field(default_factory=dict)  # the other ranks' `follow` -> rank
    runs: dict[int, ray.ObjectRef] = field(default_factory=dict)  # each actor's `run`
    restarts: int = 0

    def since_start(self) -> float:
        return time.time() - self.start

    def spare(self, i: int) -> list[int] | None:
        return _spare_cores(self.cfg, self.pinning.cores, self.pinning.local, f"actor{i}")


def _launch(cfg: RunConfig, rl_dir: Path, model_dir: Path, prompts_path: Path, reference_path: Path | None,
            resume_tag: str | None, start: float) -> _Run:
    """The learner process bound (its replay and weight server listening), the actor processes and the
    other ranks started: new ones import torch and vLLM meanwhile."""
    learner, pg, learner_name = acquire_learner(cfg)
    bound = learner.bind.remote(cfg, str(model_dir), str(rl_dir),
                                str(reference_path.resolve()) if reference_path else None, resume_tag)
    keep_s = cfg.launcher.keep_actors_s
    keys = [actor_key(cfg, model_dir, i) for i in range(cfg.actors.num_actors)]
    placement = actor_placement()
    actors = [take(key, keep_s) or new_actor(cfg, key, placement) for key in keys]
    reuse.release(spares=False, learner=False)  # actors kept for runs unlike this one
    ingest, weights, actor_token = ray.get(bound)
    store = ray.get(learner.rendezvous_store.remote())
    ranks = [LearnerRank.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r)).remote(
        cfg, str(model_dir), str(rl_dir), r, store) for r in range(1, cfg.learner.ranks)]
    run = _Run(cfg, learner, pg, learner_name, actors, keys, ranks, start)
    run.bind_args = (cfg, str(model_dir), str(prompts_path), ingest, weights, str(rl_dir / "logs"), home_node(),
                     (learner_name, ray.get_runtime_context().namespace), actor_token)
    return run


def _set_up(run: _Run) -> None:
    """Actors bound to the run (engines built or reset) while the learner builds its trainer; the
    other ranks joined; every process of the driver's host pinned."""
    learner, actors = run.learner, run.actors
    binds = [a.bind.remote(*run.bind_args) for a in actors]
    setups = [learner.setup.remote(), *(r.setup.remote() for r in run.ranks)]
    rank_pids = [r.pid.remote() for r in run.ranks]  # asked before `follow`, which holds a rank until the end
    run.follows = {r.follow.remote(): i + 1 for i, r in enumerate(run.ranks)}
    run.reusable = ray.get(binds)
    run.pids = {f"actor{i}": ray.get(a.pid.remote()) for i, a in enumerate(actors)} | {
        "learner": ray.get(learner.pid.remote())}
    run.nodes = {f"actor{i}": [ray.get(a.node.remote())] for i, a in enumerate(actors)}
    run.phases["actors_ready"] = run.since_start()
    while setups:  # a rank that fails to start fails the run, rather than leave rank 0 waiting for it
        done, setups = ray.wait(setups, num_returns=1)
        ray.get(done)
    run.phases["learner_ready"] = run.since_start()
    ranks = {f"learner{r + 1}": pid for r, pid in enumerate(ray.get(rank_pids))}
    run.pinning = _pin_cores(run.cfg, run.pids | ranks, run.nodes)


def _restart_actor(run: _Run, i: int, error: RayActorError) -> None:
    """Actor i died: Ray restarts its process; bind it to the run again, where it resumes its stream."""
    run.restarts += 1
    if run.restarts > run.cfg.launcher.max_actor_restarts * run.cfg.actors.num_actors:
        raise RuntimeError(f"actor {i} keeps dying; giving up") from error
    log.warning("actor %d died (%s); Ray restarts it and it resumes", i, type(error).__name__)
    name, actor = f"actor{i}", run.actors[i]
    run.pids[name] = wait_restarted(actor)
    ray.get(actor.bind.remote(*run.bind_args))
    run.reusable[i] = False  # not kept: Ray's restart budget is per process, and this one spent some
    run.nodes[name].append(ray.get(actor.node.remote()))
    if name in run.pinning.local:  # on the driver's host: pinned again, if it still is
        _repin(name, run.pids, run.nodes, run.pinning.cores, run.pinning.local)


def _supervise(run: _Run, name: str, read: int, metrics: list[dict[str, float]] | None,
               on_metrics: Callable[[dict[str, float]], None] | None, stop: threading.Event | None
               ) -> LearnerStats:
    """Pass the learner's metrics on and restart dead actors until the learner is done; its stats."""
    learner, cfg = run.learner, run.cfg
    learner_run = learner.run.remote()
    with progress() as bar:
        task = bar.add_task(f"RL [{name}]", total=cfg.learner.steps, completed=ray.get(learner.version.remote()))
        while True:
            done, _ = ray.wait([learner_run, *run.runs.values(), *run.follows], num_returns=1, timeout=0.5)
            for m in ray.get(learner.metrics_since.remote(read)):
                read += 1
                if metrics is not None:
                    metrics.append(m)
                if on_metrics:
                    on_metrics(m)
                run.phases.setdefault("first_step", run.since_start())
                bar.update(task, completed=int(m["learner/version"]), description=(
                    f"RL [{name}] reward {m['reward/mean']:.2f} acc {m['reward/accuracy']:.2f}"))
            if stop is not None and stop.is_set():
                learner.stop.remote()
            for ref in run.follows:
                if ref in done and learner_run not in done:
                    ray.get(ref)  # raises what stopped the rank
                    raise RuntimeError(f"learner rank {run.follows[ref]} stopped before rank 0")
            if learner_run in done:
                run.phases["last_step"] = run.since_start()
                return ray.get(learner_run)
            for i, ref in list(run.runs.items()):
                if ref in done:
                    try:
                        ray.get(ref)
                    except RayActorError as e:
                        _restart_actor(run, i, e)
                    run.runs[i] = run.actors[i].run.remote(spare_cores=run.spare(i))


def _stop(run: _Run) -> None:
    for a in run.actors:
        with contextlib.suppress(RayActorError):
            a.stop.remote()
    run.learner.stop.remote()


def _wind_down(run: _Run) -> tuple[list[ActorStats], ReplayStats]:
    """After the learner's last step: the actors' stats, the replay's, and every process closed, kept
    for the next run (`launcher.reuse_actors`, `reuse_learner`) or ended."""
    cfg, keep_s = run.cfg, run.cfg.launcher.keep_actors_s
    actor_stats, ended = [], set()
    for i, ref in run.runs.items():
        with contextlib.suppress(RayActorError, GetTimeoutError):
            actor_stats.append(ray.get(ref, timeout=60))
            ended.add(i)
    replay = ray.get(run.learner.replay_stats.remote())
    ray.get(run.learner.close.remote())
    for pid in run.pinning.local.values():  # every core back to the processes kept for a later stage or run
        pin(pid, host_cores())
    with contextlib.suppress(RayActorError, GetTimeoutError):
        ray.get(list(run.follows), timeout=60)
    for i, a in enumerate(run.actors):
        if not (cfg.launcher.reuse_actors and run.reusable[i] and i in ended and keep(a, run.keys[i], keep_s > 0)):
            ray.kill(a, no_restart=True)
    for handle in run.ranks:
        ray.kill(handle, no_restart=True)
    keep_learner(cfg, run.learner, run.pg, run.learner_name)
    return actor_stats, replay


@contextlib.contextmanager
def _releasing_cores(run: _Run) -> Iterator[None]:
    try:
        yield
    finally:
        release_cores(run.pinning.claim)


def run_rl(cfg: RunConfig, name: str, rl_dir: Path, model_dir: Path, prompts_path: Path,
           reference_path: Path | None, *, resume_tag: str | None = None,
           on_metrics: Callable[[dict[str, float]], None] | None = None,
           on_started: Callable[[dict[str, int]], None] | None = None,
           stop: threading.Event | None = None, keep_metrics: bool = True) -> RLResult:
    """Start the learner and the actors, watch them until the learner has taken `learner.steps` steps
    (or `stop` is set: the learner finishes its step, and the run ends as if those were all), stop
    everything, and return what happened. Must run inside `ray_cluster(cfg)`. Without `keep_metrics`
    the result holds no per-step metrics (a run of days: metrics.jsonl and `on_metrics` have them)."""
    start = time.time()
    # Absolute paths: actors on other nodes are handed them (and ask the learner for what they name).
    model_dir, rl_dir, prompts_path = model_dir.resolve(), rl_dir.resolve(), prompts_path.resolve()
    run = _launch(cfg, rl_dir, model_dir, prompts_path, reference_path, resume_tag, start)
    # Pooled actors end themselves once we stop calling; the cores claimed go back however the run ends.
    with holding(run.actors, cfg.launcher.keep_actors_s), _releasing_cores(run):
        _set_up(run)
        if on_started:
            on_started(run.pids)
        # Steps whose metrics were read from the learner; without keep_metrics a resumed run skips the
        # steps before its checkpoint (the learner drops them at the first read). Asked before the
        # learner runs, so that no new step is skipped.
        read = 0 if keep_metrics else ray.get(run.learner.steps_logged.remote())
        run.runs = {i: a.run.remote(spare_cores=run.spare(i)) for i, a in enumerate(run.actors)}
        metrics: list[dict[str, float]] = []
        try:
            learner_stats = _supervise(run, name, read, metrics if keep_metrics else None, on_metrics, stop)
            out = final_model(rl_dir)
            ray.get(run.learner.save_model.remote(str(out)))
        finally:
            _stop(run)
        actor_stats, replay = _wind_down(run)
    run.phases["end"] = run.since_start()
    return RLResult(name, learner_stats, actor_stats, replay, run.restarts, run.phases["end"], str(out), run.pids,
                    run.phases, run.nodes, run.pinning.cores, run.pinning.shared_with, metrics)
