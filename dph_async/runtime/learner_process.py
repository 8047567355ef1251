"""The learner's Ray processes: rank 0 (`LearnerProcess`, hosting the replay service and the weight
server in threads of the same process) and the other data-parallel ranks (`LearnerRank`), and the
one-rank process an invocation keeps from one run for the next (`launcher.reuse_learner`): the next
run builds only its trainer, skipping the import of torch, transformers and DeepSpeed.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import threading
import uuid
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dph_async import net
from dph_async.config import RunConfig
from dph_async.learner.telemetry import LearnerCollector, learner_health
from dph_async.metrics_endpoint import start_endpoint
from dph_async.paths import checkpoint_dir, endpoints_dir
from dph_async.replay.service import ReplayService
from dph_async.replay.telemetry import ReplayCollector, replay_health
from dph_async.replay_stats import ReplayStats
from dph_async.run_stats import LearnerStats
from dph_async.runtime import reuse
from dph_async.runtime.placement import learner_placement
from dph_async.runtime.process_env import bind_address, log_to_file
from dph_async.tasks.model_limits import replay_config

if TYPE_CHECKING:
    from dph_async.runtime.model_shipping import Shipment


def _learner_endpoints(cfg: RunConfig, loop, replay, rl_dir: Path) -> list:
    """/health and /metrics of the replay and of the learner (two endpoints, one process)."""
    out = endpoints_dir(rl_dir)
    endpoints = [start_endpoint("replay", [ReplayCollector(replay)], lambda: replay_health(replay), cfg.net, 0, out),
                 start_endpoint("learner", [LearnerCollector(loop)], lambda: learner_health(loop), cfg.net, 1, out)]
    return [e for e in endpoints if e is not None]


def _worker_side() -> ModuleType:
    """The half of a learner process that needs torch but no trainer (the weight server, the
    rendezvous: dph_async/runtime/learner_worker.py), imported by the process's __init__ (`_import_heavy`)."""
    # heavy (torch, about 1.5 CPU-s): the driver imports this module to start the processes and never loads it
    from dph_async.runtime import learner_worker
    return learner_worker


def _trainer_side() -> ModuleType:
    """The trainer's half of a learner process (dph_async/runtime/learner_trainer.py), imported by the
    process's __init__ (`_import_heavy`)."""
    # heavy (transformers, DeepSpeed: about 4 CPU-s more): the learner's trainer only, never the driver's
    from dph_async.runtime import learner_trainer
    return learner_trainer


def _import_heavy() -> None:
    """Import every heavy module the process's calls use, on the thread Ray runs __init__ on: Ray runs
    no call before __init__ returns, so no two threads import at once (transformers' lazy module
    fails an import that another thread has begun)."""
    _worker_side()
    _trainer_side()
    # The first ZeRO engine's build imports DeepSpeed's Muon optimizer, to check whether ours is one
    # ZeRO supports, and with it torch's compiler: about 2 s, spent here instead (ZeRO's optimizers
    # alone import it, so learner_trainer.py, which a stage-0 learner imports too, does not).
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401


@ray.remote
class LearnerProcess:
    """The learner, with the replay service and the weight server in threads of the same process. It
    serves one run at a time, from `bind` to `close`; kept (`launcher.reuse_learner`), the next run of
    the invocation binds it again and skips the import of torch, transformers and DeepSpeed, which a
    new process makes in its __init__."""

    def __init__(self) -> None:
        _import_heavy()
        self.loop = self.rendezvous = None
        self.endpoints: list = []

    def pid(self) -> int:
        return os.getpid()

    def bind(self, cfg: RunConfig, model_dir: str, rl_dir: str, reference_path: str | None,
             resume_tag: str | None) -> tuple[str, str, bytes]:
        """Binds the replay and the weight server only, so that the actors can be started (their
        engines built) while `setup` builds the trainer: the two slowest parts of start-up overlap.
        Returns where actors connect (`addresses`) and the replay's actor token, which marks the
        run's own actors' ticket requests (without CURVE, loopback peers are otherwise anonymous)."""
        log_to_file(Path(rl_dir) / "logs" / "learner.log")
        w = _worker_side()
        self.cfg, self.model_dir, self.resume_tag = cfg, model_dir, resume_tag
        self.security = net.NetSecurity.from_config(cfg.net)
        self.rl_dir = Path(rl_dir)
        self.rl_dir.mkdir(parents=True, exist_ok=True)
        wal = str(self.rl_dir / cfg.replay.wal_dir) if cfg.replay.wal_dir else None
        self.replay = ReplayService(replay_config(cfg, model_dir), bind_address(cfg), "tcp://127.0.0.1:0",
                                    cfg.learner.groups_per_step,
                                    reference_path=reference_path, wal_dir=wal, security=self.security,
                                    seed=cfg.seed, data_dir=rl_dir)
        self.replay.start_in_thread()
        self.server = w.WeightServer(bind_address(cfg), self.security, int(cfg.learner.weight_bucket_mb * 2**20),
                                   cfg.learner.weight_transport)
        self._stop = threading.Event()
        self.endpoints, self.loop = [], None
        # Where the other learner ranks meet this one (all ranks share the driver's node).
        ranks = cfg.learner.ranks
        self.rendezvous = w.Rendezvous(0, ranks, str(w.private_dir() / "store")) if ranks > 1 else None
        return (*self.addresses(), self.replay.actor_token)

    def rendezvous_store(self) -> str | None:
        """Where the other ranks meet this one: a path, which the driver (it never imports torch) passes on."""
        return self.rendezvous.store if self.rendezvous else None

    def setup(self) -> None:
        """Build the trainer (model, DeepSpeed engine) and the learner loop; resume if asked. With
        several ranks, returns once the others have joined (they are set up at the same time)."""
        t = _trainer_side()
        cfg = self.cfg
        trainer, self.tokenizer = t.build_trainer(cfg, self.model_dir, self.rendezvous)
        # The learner alone holds the control token (or, with CURVE, the control key): actors cannot
        # take batches or send commands. It takes them on the replay's local socket, in this process.
        # Snapshots go under rl_dir, the replay's data directory.
        client = self.replay.local_client()
        try:
            self.loop = t.LearnerLoop(cfg, trainer, client, self.server, self.rl_dir)
        except BaseException:
            client.close()  # the replay's context would wait for it at close
            raise
        t.write_run_info(self.rl_dir, cfg, self.model_dir)  # what `dph-async rerun` builds the trainer from
        if self.resume_tag:
            self.loop.resume(self.resume_tag)
        self.loop.publish()  # actors on other nodes build their engines from these weights
        self.endpoints = _learner_endpoints(cfg, self.loop, self.replay, self.rl_dir)
        freeze_heap()

    def addresses(self) -> tuple[str, str]:
        """Where actors connect; a wildcard bind is advertised as this node's address."""
        node = ray.util.get_node_ip_address()
        return tuple(a.replace("0.0.0.0", node).replace("//*:", f"//{node}:")
                     for a in (self.replay.ingest_endpoint, self.server.address))

    def version(self) -> int:
        return self.loop.trainer.version

    def shipment(self, prompts_path: str) -> Shipment:
        """The model's files other than weights, and the prompts, for an actor on another node."""
        return _worker_side().pack(Path(self.model_dir), Path(prompts_path))

    def run(self) -> LearnerStats:
        return self.loop.run(self._stop)

    def stop(self) -> None:
        self._stop.set()

    def metrics_since(self, index: int) -> list[dict[str, float]]:
        return self.loop.metrics_since(index)

    def steps_logged(self) -> int:
        return self.loop.logged

    def replay_stats(self) -> ReplayStats:
        return self.replay.stats()

    def checkpoint(self) -> str:
        return str(self.loop.checkpoint())

    def save_model(self, out_dir: str) -> str:
        self.loop.trainer.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        return out_dir

    def close(self) -> None:
        """End the run: every socket, thread and segment it opened, and the trainer's memory, which the
        next run's trainer would otherwise find still held."""
        if self.loop is not None:
            self.loop.trainer.close()  # releases the other learner ranks
            self.loop.replay.close()
        for endpoint in self.endpoints:
            endpoint.close()
        self.replay.stop()
        self.server.close()
        if self.rendezvous is not None:
            shutil.rmtree(Path(self.rendezvous.store).parent, ignore_errors=True)
        self.loop = self.tokenizer = self.rendezvous = None
        self.endpoints = []
        thaw_heap()
        _worker_side().empty_gpu_cache()


def freeze_heap() -> None:
    """Keep the collector off what the imports and the trainer made: half a million objects that
    live as long as the run. A full collection walks them all (0.35-0.44 s on 2 cores) holding the
    GIL, stalling the training, the replay's thread and the weight server at once, and the actor
    waits for tickets meanwhile: five stalls of 0.16-0.30 s in 300 steps of the embedded default,
    none once frozen (docs/benchmarks.md). vLLM does the same in the actors. Garbage frozen with them
    waits for `thaw_heap` or the process's end (a collection first would add 0.3 s to every run's
    start)."""
    gc.freeze()


def thaw_heap() -> None:
    """Hand the collector back what `freeze_heap` kept from it, and collect: a closed run's trainer
    is garbage now, and a kept learner process must not hold every earlier run's."""
    gc.unfreeze()
    gc.collect()


@ray.remote
class LearnerRank:
    """A learner rank other than 0: the same trainer, training its share of each batch rank 0 sends,
    and writing its part of each checkpoint, until rank 0 releases it."""

    def __init__(self, cfg: RunConfig, model_dir: str, rl_dir: str, rank: int, store: str) -> None:
        _import_heavy()
        log_to_file(Path(rl_dir) / "logs" / f"learner{rank}.log")
        self.cfg, self.model_dir, self.rl_dir, self.rank, self.store = cfg, model_dir, Path(rl_dir), rank, store

    def setup(self) -> None:
        rdv = _worker_side().Rendezvous(self.rank, self.cfg.learner.ranks, self.store)
        self.trainer, _ = _trainer_side().build_trainer(self.cfg, self.model_dir, rdv)
        freeze_heap()

    def pid(self) -> int:
        return os.getpid()

    def follow(self) -> int:
        """Batches trained, once rank 0 says stop."""
        return _trainer_side().follow(self.trainer, checkpoint_dir(self.rl_dir))



def acquire_learner(cfg: RunConfig) -> tuple[ray.actor.ActorHandle, PlacementGroup, str]:
    """The learner process for a run: the one the last run kept (`reuse`), if it still answers and may
    serve this run, or a new one, in a new placement group. One `start_learner` just started answers
    once its __init__ has made its imports: tens of seconds on a busy machine."""
    kept = reuse.take_learner()
    if kept is not None:
        with contextlib.suppress(RayActorError, GetTimeoutError):
            if _reusable_learner(cfg) and ray.get(kept.handle.pid.remote(), timeout=300):
                return kept.handle, kept.group, kept.name
        reuse.end_learner(kept)
    return _new_learner(learner_placement(cfg.learner.ranks))


def _new_learner(pg: PlacementGroup) -> tuple[ray.actor.ActorHandle, PlacementGroup, str]:
    # Actors find the learner by its name: a handle among a restartable actor's arguments is kept in
    # the object store, which Ray warns about on every start.
    name = f"dph-learner-{uuid.uuid4().hex[:12]}"
    learner = LearnerProcess.options(num_cpus=1, max_concurrency=4, name=name,
                                     scheduling_strategy=PlacementGroupSchedulingStrategy(pg, 0)).remote()
    return learner, pg, name


def start_learner(cfg: RunConfig) -> None:
    """Start the next RL run's learner process now, kept for that run (`launcher.reuse_learner`), so
    that its imports (its __init__'s) run beside the stage before it (pre-sampling, pi_0's evaluation:
    one core of an actor) instead of on the run's critical path. Nothing is started where one is kept already,
    where the run could not take it, or where no CPU is free for it within a few seconds."""
    if reuse.has_learner() or not _reusable_learner(cfg):
        return
    try:
        pg = learner_placement(1, timeout_s=5.0)
    except RuntimeError:
        return  # the run makes its own, and waits for its CPU as before
    reuse.put_learner(reuse.KeptLearner(*_new_learner(pg)))


def _reusable_learner(cfg: RunConfig) -> bool:
    """Only a single rank's process is kept: the ranks of a data-parallel learner form a process group
    with the run's other ranks, which end with the run."""
    return cfg.launcher.reuse_learner and cfg.learner.ranks == 1


def keep_learner(cfg: RunConfig, learner: ray.actor.ActorHandle, pg: PlacementGroup, name: str) -> None:
    """At the end of a run (the learner closed): keep the process for the next run, or end it."""
    if _reusable_learner(cfg):
        reuse.put_learner(reuse.KeptLearner(learner, pg, name))
    else:
        reuse.end_learner(reuse.KeptLearner(learner, pg, name))
