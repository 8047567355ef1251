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
(dph_async/app/placement.py); an actor on another node gets the model, the prompts and the weights
from the learner (dph_async/app/model_shipping.py), and one whose node is lost restarts elsewhere.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.telemetry import ActorCollector, actor_health
from dph_async import net
from dph_async.app.actor_pool import engine_settings, holding, keep, new_actor_options, release_actors, take
from dph_async.app.cores import host_cores, offload_threads, pin, plan_cores
from dph_async.app.placement import actor_placement, home_node, learner_placement, on_home_node
from dph_async.app.progress import progress
from dph_async.config import RunConfig
from dph_async.paths import checkpoint_dir, endpoints_dir, final_model
from dph_async.replay_client import RolloutSender
from dph_async.replay_stats import ReplayStats
from dph_async.rewards.scorer import make_scorer
from dph_async.tasks.dataset import load_prompts
from dph_async.tasks.model_limits import replay_config
from dph_async.telemetry import start_endpoint
from dph_async.weights_shm import remove_stale as remove_stale_segments
from learner.telemetry import LearnerCollector, learner_health
from replay.service import ReplayService
from replay.telemetry import ReplayCollector, replay_health

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dph_async.app.model_shipping import Shipment
    from dph_async.app.pipeline import EvalJob
    from learner.data_parallel import Rendezvous
    from learner.trainer import Trainer

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Persistent caches (DeepSpeed's compiled ops) live in ./.cache unless DPH_CACHE_DIR says otherwise."""
    return Path(os.environ.get("DPH_CACHE_DIR", ".cache")).resolve()


def _bind(cfg: RunConfig) -> str:
    return f"tcp://{cfg.net.host}:0"


def log_to_file(path: Path) -> None:
    """Send this process's stdout and stderr (engine warnings, progress bars) to `path`: the driver's
    terminal keeps only the run's own progress, and each process's log stays with the run."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


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
def ray_cluster(cfg: RunConfig) -> Iterator[None]:
    """A local Ray cluster (or a connection to `launcher.address`), shut down cleanly on exit. Inside
    one this process already holds, that one is used and left running: its owner shuts it down."""
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
    try:
        yield
    finally:
        release_actors()
        release_learner()
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


def _learner_endpoints(cfg: RunConfig, loop, replay, rl_dir: Path) -> list:
    """/health and /metrics of the replay and of the learner (two endpoints, one process)."""
    out = endpoints_dir(rl_dir)
    endpoints = [start_endpoint("replay", [ReplayCollector(replay)], lambda: replay_health(replay), cfg.net, 0, out),
                 start_endpoint("learner", [LearnerCollector(loop)], lambda: learner_health(loop), cfg.net, 1, out)]
    return [e for e in endpoints if e is not None]


def _import_trainer() -> None:
    """Import what building a trainer needs: torch, transformers and DeepSpeed, which reads
    TORCH_EXTENSIONS_DIR (where its compiled ops are) when imported."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(os.environ.get("DPH_CACHE_DIR", ".cache"))
                                                        / "torch_extensions"))
    import deepspeed  # noqa: F401
    from transformers import AutoTokenizer  # noqa: F401

    import learner.loop
    import learner.trainer  # noqa: F401


def _build_trainer(cfg: RunConfig, model_dir: str, rendezvous: Rendezvous | None
                   ) -> tuple[Trainer, PreTrainedTokenizerBase]:
    """The learner's trainer (model, DeepSpeed engine) as rank `rendezvous.rank` (None: the only
    rank), and the model's tokenizer."""
    _import_trainer()
    import torch
    from transformers import AutoTokenizer

    from learner.trainer import Trainer

    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    trainer = Trainer(model_dir, cfg.learner, temperature=cfg.sampling.temperature, dtype=cfg.model.dtype,
                      pad_id=pad, max_response_tokens=cfg.sampling.max_tokens, seed=cfg.seed, rendezvous=rendezvous)
    return trainer, tokenizer


@ray.remote
class LearnerProcess:
    """The learner, with the replay service and the weight server in threads of the same process. It
    serves one run at a time, from `bind` to `close`; kept (`launcher.reuse_learner`), the next run of
    the invocation binds it again and skips the import of torch, transformers and DeepSpeed."""

    def __init__(self) -> None:
        self.loop = self.rendezvous = None
        self.endpoints: list = []
        # transformers' lazy module fails an import that another thread has begun (`preload`'s):
        # one thread imports at a time.
        self._importing = threading.Lock()

    def pid(self) -> int:
        return os.getpid()

    def preload(self) -> None:
        """Import what a run's trainer needs now, before any run binds this process (`start_learner`)."""
        with self._importing:
            _import_trainer()
            # The first ZeRO engine's build imports DeepSpeed's Muon optimizer, to check whether ours is
            # one ZeRO supports, and with it torch's compiler: about 2 s, spent here instead.
            import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    def bind(self, cfg: RunConfig, model_dir: str, rl_dir: str, reference_path: str | None,
             resume_tag: str | None) -> tuple[str, str]:
        """Binds the replay and the weight server only, so that the actors can be started (their
        engines built) while `setup` builds the trainer: the two slowest parts of start-up overlap.
        Returns where actors connect (`addresses`)."""
        log_to_file(Path(rl_dir) / "logs" / "learner.log")
        # torch (the weight server's tensors), in this Ray worker only: the driver never loads it.
        with self._importing:
            from learner.data_parallel import Rendezvous, private_dir
            from learner.publish import WeightServer

        self.cfg, self.model_dir, self.resume_tag = cfg, model_dir, resume_tag
        self.security = net.NetSecurity.from_config(cfg.net)
        self.rl_dir = Path(rl_dir)
        self.rl_dir.mkdir(parents=True, exist_ok=True)
        wal = str(self.rl_dir / cfg.replay.wal_dir) if cfg.replay.wal_dir else None
        self.replay = ReplayService(replay_config(cfg, model_dir), _bind(cfg), "tcp://127.0.0.1:0",
                                    cfg.learner.groups_per_step,
                                    reference_path=reference_path, wal_dir=wal, security=self.security,
                                    seed=cfg.seed, data_dir=rl_dir)
        self.replay.start_in_thread()
        self.server = WeightServer(_bind(cfg), self.security, int(cfg.learner.weight_bucket_mb * 2**20),
                                   cfg.learner.weight_transport)
        self._stop = threading.Event()
        self.endpoints, self.loop = [], None
        # Where the other learner ranks meet this one (all ranks share the driver's node).
        ranks = cfg.learner.ranks
        self.rendezvous = Rendezvous(0, ranks, str(private_dir() / "store")) if ranks > 1 else None
        return self.addresses()

    def rendezvous_store(self) -> str | None:
        """Where the other ranks meet this one: a path, which the driver (it never imports torch) passes on."""
        return self.rendezvous.store if self.rendezvous else None

    def setup(self) -> None:
        """Build the trainer (model, DeepSpeed engine) and the learner loop; resume if asked. With
        several ranks, returns once the others have joined (they are set up at the same time)."""
        with self._importing:
            _import_trainer()
        from learner.loop import LearnerLoop

        cfg = self.cfg
        trainer, self.tokenizer = _build_trainer(cfg, self.model_dir, self.rendezvous)
        # The learner alone holds the control token (or, with CURVE, the control key): actors cannot
        # take batches or send commands. It takes them on the replay's local socket, in this process.
        # Snapshots go under rl_dir, the replay's data directory.
        client = self.replay.local_client()
        try:
            self.loop = LearnerLoop(cfg, trainer, client, self.server, self.rl_dir)
        except BaseException:
            client.close()  # the replay's context would wait for it at close
            raise
        if self.resume_tag:
            self.loop.resume(self.resume_tag)
        self.loop.publish()  # actors on other nodes build their engines from these weights
        self.endpoints = _learner_endpoints(cfg, self.loop, self.replay, self.rl_dir)
        _freeze_heap()

    def addresses(self) -> tuple[str, str]:
        """Where actors connect; a wildcard bind is advertised as this node's address."""
        node = ray.util.get_node_ip_address()
        return tuple(a.replace("0.0.0.0", node).replace("//*:", f"//{node}:")
                     for a in (self.replay.ingest_endpoint, self.server.address))

    def version(self) -> int:
        return self.loop.trainer.version

    def shipment(self, prompts_path: str) -> Shipment:
        """The model's files other than weights, and the prompts, for an actor on another node."""
        from dph_async.app.model_shipping import pack

        return pack(Path(self.model_dir), Path(prompts_path))

    def run(self) -> dict:
        return asdict(self.loop.run(self._stop))

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
        _thaw_heap()
        import torch

        if torch.cuda.is_available():  # an idle kept process must not hold GPU memory an engine could use
            torch.cuda.empty_cache()


def _freeze_heap() -> None:
    """Keep the collector off what the imports and the trainer made: half a million objects that
    live as long as the run. A full collection walks them all (0.35-0.44 s on 2 cores) holding the
    GIL, stalling the training, the replay's thread and the weight server at once, and the actor
    waits for tickets meanwhile: five stalls of 0.16-0.30 s in 300 steps of the embedded default,
    none once frozen (docs/benchmarks.md). vLLM does the same in the actors. Garbage frozen with them
    waits for `_thaw_heap` or the process's end (a collection first would add 0.3 s to every run's
    start)."""
    gc.freeze()


def _thaw_heap() -> None:
    """Hand the collector back what `_freeze_heap` kept from it, and collect: a closed run's trainer
    is garbage now, and a kept learner process must not hold every earlier run's."""
    gc.unfreeze()
    gc.collect()


@ray.remote
class LearnerRank:
    """A learner rank other than 0: the same trainer, training its share of each batch rank 0 sends,
    and writing its part of each checkpoint, until rank 0 releases it."""

    def __init__(self, cfg: RunConfig, model_dir: str, rl_dir: str, rank: int, store: str) -> None:
        log_to_file(Path(rl_dir) / "logs" / f"learner{rank}.log")
        self.cfg, self.model_dir, self.rl_dir, self.rank, self.store = cfg, model_dir, Path(rl_dir), rank, store

    def setup(self) -> None:
        from learner.data_parallel import Rendezvous

        rdv = Rendezvous(self.rank, self.cfg.learner.ranks, self.store)
        self.trainer, _ = _build_trainer(self.cfg, self.model_dir, rdv)
        _freeze_heap()

    def pid(self) -> int:
        return os.getpid()

    def follow(self) -> int:
        """Batches trained, once rank 0 says stop."""
        from learner.data_parallel import follow

        return follow(self.trainer, checkpoint_dir(self.rl_dir))


def _actor_endpoint(cfg: RunConfig, worker, rl_dir: Path):
    i = worker.actor_id
    return start_endpoint(f"actor{i}", [ActorCollector(worker)], lambda: actor_health(worker), cfg.net, 2 + i,
                          endpoints_dir(rl_dir))


def _prompts(cfg: RunConfig, prompts_path: str, engine) -> list:
    return load_prompts(prompts_path, engine.tokenizer, cfg.model.max_model_len - cfg.sampling.max_tokens)


def _shipment(learner: tuple[str, str], prompts_path: str) -> Shipment:
    """The model's small files and the prompts, from the learner named (name, namespace): the
    driver's namespace, since a pooled actor process lives in the pool's."""
    name, namespace = learner
    return ray.get(ray.get_actor(name, namespace=namespace).shipment.remote(prompts_path))


@ray.remote
class ActorProcess:
    """One vLLM actor process. Its engine is built by the first `bind` and may serve several RL runs
    of one invocation (`launcher.reuse_actors`), or of later invocations on the same cluster
    (`launcher.keep_actors_s`, dph_async/app/actor_pool.py); each `bind` gives it a run's prompt
    stream, reward workers and connections, and `unbind` closes them.

    On the driver's node (`home`) it reads the model and the prompts from their paths; on any other
    node it gets them from the learner and its weight server (dph_async/app/model_shipping.py)."""

    def __init__(self, actor_id: int, keep_s: float = 0.0) -> None:
        self.actor_id = actor_id
        self.engine = None
        self.worker = None
        self.endpoint = None
        self._stop = threading.Event()
        # Outliving the invocation (dph_async/app/actor_pool.py): one driver at a time holds the
        # process (its maker, or after a restart the run it serves), and it ends itself once no
        # driver has called it for keep_s seconds.
        self.keep_s = keep_s
        self._held = True
        self._binding = False
        self._called = time.monotonic()
        if keep_s > 0:
            threading.Thread(target=self._expire, name="actor-expiry", daemon=True).start()

    def take(self, keep_s: float) -> bool:
        """For a driver looking for a kept process: True once, until the process is kept again."""
        self._called = time.monotonic()
        if self._held:
            return False
        self._held, self.keep_s = True, keep_s
        return True

    def touch(self) -> None:
        """The driver holding this process is alive."""
        self._called = time.monotonic()

    def describe(self) -> dict:
        """What `dph-async pool` shows of a kept process."""
        return {"actor_id": self.actor_id, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "held": self._held, "idle_s": round(time.monotonic() - self._called, 1), "keep_s": self.keep_s,
                "engine": self.engine is not None}

    def _expire(self) -> None:
        while self._binding or time.monotonic() - self._called < self.keep_s:
            time.sleep(1.0)
        self._stop.set()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def bind(self, cfg: RunConfig, model_dir: str, prompts_path: str, ingest: str, weights: str, log_dir: str,
             home: str, learner: tuple[str, str]) -> bool:
        """Join a run; returns whether this process may serve a later run (one whose engine a reset can
        bring back to the run's start: not a mixture sampler's, which holds pi_0 as well)."""
        self._binding = True
        try:
            return self._bind(cfg, model_dir, prompts_path, ingest, weights, log_dir, home, learner)
        finally:
            self._binding, self._called = False, time.monotonic()

    def _bind(self, cfg: RunConfig, model_dir: str, prompts_path: str, ingest: str, weights: str, log_dir: str,
              home: str, learner: tuple[str, str]) -> bool:
        log_to_file(Path(log_dir) / f"actor{self.actor_id}.log")
        # vLLM and torch, in this Ray worker only: the driver never loads the engine.
        from actors.rollout import RolloutWorker
        from actors.weights import WeightClient

        actor_id, security = self.actor_id, net.NetSecurity.from_config(cfg.net)
        weight_client = WeightClient(weights, security, actor_id, transport=cfg.learner.weight_transport)
        at_home = home_node() == home
        if self.engine is None:
            prompts = self._build_engine(cfg, model_dir, prompts_path, weight_client, at_home, learner)
        elif at_home:  # the launcher hands a kept process only a run its engine fits
            self.engine.reset(model_dir)
            prompts = _prompts(cfg, prompts_path, self.engine)
        else:
            prompts = self._restart_from_learner(cfg, prompts_path, weight_client, learner)
        self.worker = RolloutWorker(actor_id, cfg, self.engine, prompts, RolloutSender(ingest, actor_id, security),
                                    weight_client, make_scorer(cfg.rewards))
        self.endpoint = _actor_endpoint(cfg, self.worker, Path(log_dir).parent)
        return cfg.actors.sampler == "online"

    def _restart_from_learner(self, cfg: RunConfig, prompts_path: str, weight_client,
                              learner: tuple[str, str]) -> list:
        """Off the driver's node: back to what a new engine here starts from (model_shipping.py), the
        learner's newest weights, and the prompts it ships; return those prompts."""
        from dph_async.app.model_shipping import first_weights

        shipment = _shipment(learner, prompts_path)
        ready = first_weights(weight_client)
        with weight_client.tensors(ready) as named:
            self.engine.restart(named, ready.version)
        with tempfile.TemporaryDirectory(prefix=f"dph-actor{self.actor_id}-") as local:
            prompts_file = Path(local) / shipment.prompts_name
            prompts_file.write_bytes(shipment.prompts)
            return _prompts(cfg, str(prompts_file), self.engine)

    def _build_engine(self, cfg: RunConfig, model_dir: str, prompts_path: str, weight_client, at_home: bool,
                      learner: tuple[str, str]) -> list:
        """Build the engine (self.engine); return the run's prompts, read while a shipped copy exists."""
        from dph_async.app.model_shipping import materialize

        actor_id, version = self.actor_id, 0
        with tempfile.TemporaryDirectory(prefix=f"dph-actor{actor_id}-") as local:  # gone once loaded
            if not at_home:
                if cfg.actors.sampler != "online":  # the shipped model is the newest policy, not pi_0
                    raise RuntimeError(f"actors.sampler={cfg.actors.sampler} mixes in pi_0, which only the "
                                       "driver's node holds: run these actors on that node")
                shipment = _shipment(learner, prompts_path)
                model, prompts_file, version = materialize(shipment, weight_client, Path(local))
                model_dir, prompts_path = str(model), str(prompts_file)
            if cfg.actors.sampler == "online":
                self.engine = _online_engine(cfg, model_dir, actor_id, version)
            else:  # pi_ref is the model the actor starts from: pi_0
                from actors.mixture import MixtureEngine

                self.engine = MixtureEngine(model_dir, cfg.actors.sampler, dtype=cfg.model.dtype,
                                            seed=cfg.seed + 1000 * actor_id, threads=cfg.actors.threads)
            return _prompts(cfg, prompts_path, self.engine)

    def presample(self, cfg: RunConfig, model_dir: str, train: str, out_dir: str) -> None:
        """Pre-sample pi_0 (dph_async/app/presample.py) with this process's engine, built here if it has
        none: the RL run that takes the process next starts on an engine already built."""
        from dph_async.app.presample import presample

        log_to_file(Path(out_dir) / "presample.log")
        self._engine_of(cfg, model_dir)
        presample(cfg, Path(model_dir), Path(train), Path(out_dir), engine=self.engine)

    def evaluate(self, cfg: RunConfig, model_dir: str, jobs: list[EvalJob], test_sets: dict[str, str]) -> None:
        """Evaluate `jobs` (dph_async/app/evaluate.py) with this process's engine, reset to `model_dir`'s
        weights first, or built here if it has none (as for `presample`)."""
        from dph_async.app.evaluate import evaluate_jobs

        log_to_file(jobs[0].out.with_suffix(".log"))
        self._engine_of(cfg, model_dir)
        evaluate_jobs(cfg, Path(model_dir), jobs, {k: Path(v) for k, v in test_sets.items()}, engine=self.engine)

    def _engine_of(self, cfg: RunConfig, model_dir: str) -> None:
        """This process's engine on `model_dir`'s weights: built if there is none, else reset to them."""
        if self.engine is None:
            self.engine = _online_engine(cfg, model_dir, self.actor_id)
        else:
            self.engine.reset(model_dir)

    def unbind(self) -> None:
        """Close the run's connections, reward workers and metrics endpoint; the engine stays."""
        if self.endpoint is not None:  # and its announcement: this process no longer serves that run
            self.endpoint.close()
            if self.endpoint.announced is not None:
                self.endpoint.announced.unlink(missing_ok=True)
        if self.worker is not None:
            self.worker.sender.close()
            self.worker.weights.close()
            self.worker.scorer.close()
        self.worker = self.endpoint = None
        self._held, self._called = False, time.monotonic()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> tuple[str, str]:
        """(address, Ray node id) of the node this actor runs on."""
        return ray.util.get_node_ip_address(), home_node()

    def run(self, max_groups: int | None = None, spare_cores: list[int] | None = None) -> dict:
        """Generate until stopped; first, with `spare_cores`, every other thread of the process but ZMQ's
        goes there, and the calling thread (Ray's choice) keeps the actor's cores (cores.py)."""
        self._stop.clear()
        if spare_cores:
            self.worker.stats.threads_offloaded = offload_threads(spare_cores)
        return asdict(self.worker.run(self._stop, max_groups))

    def stop(self) -> None:
        self._stop.set()


def _online_engine(cfg: RunConfig, model_dir: str, actor_id: int, version: int = 0):
    """Actor `actor_id`'s vLLM engine of `model_dir`'s weights (an online sampler's)."""
    from actors.engine import VLLMEngine

    return VLLMEngine(model_dir, dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
                      seed=cfg.seed + 1000 * actor_id, kv_cache_gib=cfg.actors.kv_cache_gib,
                      threads=cfg.actors.threads, version=version, cpu_gemm=cfg.actors.cpu_gemm,
                      compile_model=cfg.actors.compile, share_prefill=cfg.actors.share_prefill)


def _actor_key(cfg: RunConfig, model_dir: Path, actor_id: int) -> tuple:
    """What a kept process must match to serve as actor `actor_id` of a run (actor_pool.py). Pooled
    processes are named and detached, the others are not: the two never stand in for each other."""
    return (actor_id, home_node(), cfg.launcher.keep_actors_s > 0, *engine_settings(cfg, model_dir))


def _new_actor(cfg: RunConfig, key: tuple, placement: dict) -> ray.actor.ActorHandle:
    """A new actor process for `key`. Ray restarts it if it dies (its __init__ runs again, then the run
    binds it again), on another node if its own is gone."""
    keep_s = cfg.launcher.keep_actors_s
    options = dict(num_cpus=1, max_concurrency=4, max_restarts=cfg.launcher.max_actor_restarts, max_task_retries=0)
    if cfg.actors.threads > 1:
        # OpenMP's thread count is per OS thread, and vLLM fixes torch's after its build; the calls run
        # on Ray's threads, not the one that built the engine, so the count must be every thread's
        # default from the process's start (vLLM's CPU attention checks that its plan and its kernel
        # agree). Ray would set 1, from num_cpus.
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(cfg.actors.threads)}}
    return ActorProcess.options(**options, **placement, **new_actor_options(key, keep_s)).remote(key[0], keep_s)


def _then_keep(actor: ray.actor.ActorHandle, key: tuple, keep_s: float, work: ray.ObjectRef) -> None:
    """Wait for `work` (a call on `actor`), then keep the process for the next run; a process whose
    work failed ends, and the error is raised."""
    try:
        with holding([actor], keep_s):
            ray.get(work)
    except BaseException:
        ray.kill(actor, no_restart=True)
        raise
    if not keep(actor, key, keep_s > 0):
        ray.kill(actor, no_restart=True)


def _keepable(cfg: RunConfig) -> bool:
    """Whether a process made for actor 0 of the next RL run could serve it when kept: not with reuse
    off, under a mixture sampler's engine (it holds pi_0 as well), or with actors confined to labelled
    nodes, which the driver's node may not be."""
    return cfg.launcher.reuse_actors and cfg.actors.sampler == "online" and "label_selector" not in actor_placement()


def presample_on_actor(cfg: RunConfig, model_dir: Path, train: Path, out_dir: Path) -> bool:
    """Pre-sample pi_0 in the process that actor 0 of the next RL run from `model_dir` takes
    (`launcher.reuse_actors`), so that one engine build serves both; False, with nothing done, where a
    kept process could not serve that run (`_keepable`)."""
    if not _keepable(cfg):
        return False
    model_dir = model_dir.resolve()
    keep_s, key = cfg.launcher.keep_actors_s, _actor_key(cfg, model_dir, 0)
    actor = take(key, keep_s) or _new_actor(cfg, key, on_home_node())  # it reads and writes the run directory
    _then_keep(actor, key, keep_s, actor.presample.remote(cfg, str(model_dir), str(train.resolve()),
                                                          str(out_dir.resolve())))
    return True


def evaluate_on_actor(cfg: RunConfig, model_dir: Path, jobs: list[EvalJob], test_sets: dict[str, Path]) -> bool:
    """Evaluate `jobs` in the process that actor 0 of an RL run of `model_dir`'s architecture takes:
    the one a run kept, without building another engine, or else a new one, kept afterwards, so that
    an evaluation before RL (pi_0's, in a sweep) builds the engine the first run then starts on. Every
    other kept process ends first (its memory goes to this one). False, with nothing evaluated, where
    no process is kept on the driver's node and a new one could not be kept (`_keepable`)."""
    keep_s, key = cfg.launcher.keep_actors_s, _actor_key(cfg, model_dir.resolve(), 0)
    actor = take(key, keep_s) if cfg.actors.sampler == "online" else None
    release_actors()
    if actor is not None and ray.get(actor.node.remote())[1] != home_node():  # it reads and writes the run directory
        if not keep(actor, key, keep_s > 0):
            ray.kill(actor, no_restart=True)
        actor = None
    if actor is None:
        if not _keepable(cfg):
            return False
        actor = _new_actor(cfg, key, on_home_node())
    _then_keep(actor, key, keep_s, actor.evaluate.remote(cfg, str(model_dir.resolve()), jobs,
                                                         {k: str(v) for k, v in test_sets.items()}))
    return True


# The learner process the last RL run of this invocation kept for the next (`launcher.reuse_learner`):
# its handle, its placement group and its name, by which actors find it.
_kept_learner: tuple[ray.actor.ActorHandle, PlacementGroup, str] | None = None


def _learner_process(cfg: RunConfig) -> tuple[ray.actor.ActorHandle, PlacementGroup, str]:
    """The learner process for a run: the one the last run kept, if it still answers and may serve
    this run, or a new one, in a new placement group."""
    global _kept_learner
    kept, _kept_learner = _kept_learner, None
    if kept is not None:
        with contextlib.suppress(RayActorError, GetTimeoutError):
            if _reusable_learner(cfg) and ray.get(kept[0].pid.remote(), timeout=30):
                return kept
        _end_learner(kept[0], kept[1])
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
    that its imports run beside the stage before it (pre-sampling, pi_0's evaluation: one core of
    an actor) instead of on the run's critical path. Nothing is started where one is kept already,
    where the run could not take it, or where no CPU is free for it within a few seconds."""
    global _kept_learner
    if _kept_learner is not None or not _reusable_learner(cfg):
        return
    try:
        pg = learner_placement(1, timeout_s=5.0)
    except RuntimeError:
        return  # the run makes its own, and waits for its CPU as before
    _kept_learner = _new_learner(pg)
    _kept_learner[0].preload.remote()


def _reusable_learner(cfg: RunConfig) -> bool:
    """Only a single rank's process is kept: the ranks of a data-parallel learner form a process group
    with the run's other ranks, which end with the run."""
    return cfg.launcher.reuse_learner and cfg.learner.ranks == 1


def _keep_learner(cfg: RunConfig, learner: ray.actor.ActorHandle, pg: PlacementGroup, name: str) -> None:
    """At the end of a run (the learner closed): keep the process for the next run, or end it."""
    global _kept_learner
    if _reusable_learner(cfg):
        _kept_learner = (learner, pg, name)
    else:
        _end_learner(learner, pg)


def _end_learner(learner: ray.actor.ActorHandle, pg: PlacementGroup) -> None:
    with contextlib.suppress(Exception):  # already gone with its cluster
        ray.kill(learner, no_restart=True)
        remove_placement_group(pg)


def release_learner() -> None:
    """End the kept learner process, if any (the cluster is being left)."""
    global _kept_learner
    if _kept_learner is not None:
        _end_learner(_kept_learner[0], _kept_learner[1])
        _kept_learner = None


def _wait_restarted(actor: ray.actor.ActorHandle, timeout_s: float = 600.0) -> int:
    """Block until Ray has brought a dead actor back (its __init__ ran again); return its new pid.
    Calls to an actor that is restarting fail fast as unavailable, so keep asking."""
    deadline = time.time() + timeout_s
    while True:
        try:
            return ray.get(actor.pid.remote(), timeout=max(1.0, deadline - time.time()))
        except ActorUnavailableError:
            if time.time() > deadline:
                raise
            time.sleep(0.5)
        except ActorDiedError:
            raise RuntimeError("an actor died and Ray will not restart it (launcher.max_actor_restarts)") from None


@dataclass
class RLResult:
    name: str
    metrics: list[dict[str, float]]
    learner: dict
    actors: list[dict]
    replay: ReplayStats
    actor_restarts: int
    wall_seconds: float
    final_model: str
    pids: dict[str, int] = field(default_factory=dict)
    # Seconds from the start of the run to: actors_ready (every engine built), learner_ready (trainer
    # built), first_step (the first metrics arrive), last_step, end (final model written, all stopped).
    phases: dict[str, float] = field(default_factory=dict)
    # Where each actor ran: (address, Ray node id), in order; a restart on another node adds one.
    nodes: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    # The cores each process of the driver's host was pinned to ("learner": every rank), if any
    # (launcher.pin_cores).
    cores: dict[str, list[int]] = field(default_factory=dict)


def _pin_cores(cfg: RunConfig, pids: dict[str, int], nodes: dict[str, list[tuple[str, str]]]
               ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Pin the run's processes on the driver's host (`pids`: actor{i}, learner, learner{r}) to cores of
    their own (dph_async/app/cores.py). Returns each pinned process's cores by name ("learner": every
    rank) and the pids of the host's processes; where the plan leaves the OS to place them, those get
    every core (a kept process may come pinned from an earlier run)."""
    if not cfg.launcher.pin_cores:
        return {}, {}
    home = home_node()
    local = {name: pid for name, pid in pids.items() if not name.startswith("actor") or nodes[name][-1][1] == home}
    actors = [name for name in local if name.startswith("actor")]
    plan = plan_cores(host_cores(), len(actors), cfg.actors.threads)
    cores = {} if plan is None else dict(zip(actors, plan.actors, strict=True)) | {"learner": plan.learner}
    for name, pid in local.items():
        pin(pid, cores.get(name) or cores.get("learner") or host_cores())
    if cores:
        log.info("cores: %s", cores)
    return cores, local


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
    """Where pinned actor `name`'s other threads go at the start of its run (cores.offload_threads), so
    that its rollout loop keeps its cores to itself: the learner's. None for an actor not pinned here,
    and for engines of several threads (their OpenMP workers would be among the others)."""
    return cores["learner"] if name in cores and name in local and cfg.actors.threads == 1 else None


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
    learner, pg, learner_name = _learner_process(cfg)
    bound = learner.bind.remote(cfg, str(model_dir), str(rl_dir),
                                str(reference_path.resolve()) if reference_path else None, resume_tag)
    keep_s = cfg.launcher.keep_actors_s
    keys = [_actor_key(cfg, model_dir, i) for i in range(cfg.actors.num_actors)]
    placement = actor_placement()
    # New actor processes start (Ray's worker, torch's import) while a new learner imports torch.
    actors = [take(key, keep_s) or _new_actor(cfg, key, placement) for key in keys]
    release_actors()  # kept for runs unlike this one
    ingest, weights = ray.get(bound)
    store = ray.get(learner.rendezvous_store.remote())
    ranks = [LearnerRank.options(num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, r)).remote(
        cfg, str(model_dir), str(rl_dir), r, store) for r in range(1, cfg.learner.ranks)]
    with holding(actors, keep_s):  # pooled actors end themselves once their driver stops calling
        run_args = (cfg, str(model_dir), str(prompts_path), ingest, weights, str(rl_dir / "logs"), home_node(),
                    (learner_name, ray.get_runtime_context().namespace))
        binds = [a.bind.remote(*run_args) for a in actors]
        setup = learner.setup.remote()  # builds the trainer while the actors build (or reset) their engines
        # The other ranks join rank 0's group during its setup, then follow it (a resume's load included).
        setups = [setup, *(r.setup.remote() for r in ranks)]
        rank_pids = [r.pid.remote() for r in ranks]  # asked before `follow`, which holds a rank until the end
        follows = {r.follow.remote(): i + 1 for i, r in enumerate(ranks)}
        reusable = ray.get(binds)
        pids = {f"actor{i}": ray.get(a.pid.remote()) for i, a in enumerate(actors)} | {
            "learner": ray.get(learner.pid.remote())}
        nodes = {f"actor{i}": [ray.get(a.node.remote())] for i, a in enumerate(actors)}
        phases = {"actors_ready": time.time() - start}
        while setups:  # a rank that fails to start fails the run, rather than leave rank 0 waiting for it
            done, setups = ray.wait(setups, num_returns=1)
            ray.get(done)
        phases["learner_ready"] = time.time() - start
        cores, local = _pin_cores(cfg, pids | {f"learner{r + 1}": p for r, p in enumerate(ray.get(rank_pids))}, nodes)
        if on_started:
            on_started(pids)
        # Steps whose metrics were read from the learner; without keep_metrics a resumed run skips the
        # steps before its checkpoint (the learner then drops them at the first read). Asked before the
        # learner runs, so that no new step is skipped.
        read = 0 if keep_metrics else ray.get(learner.steps_logged.remote())
        runs = {i: a.run.remote(spare_cores=_spare_cores(cfg, cores, local, f"actor{i}")) for i, a in enumerate(actors)}
        learner_run = learner.run.remote()
        metrics: list[dict[str, float]] = []
        restarts = 0
        first = ray.get(learner.version.remote())
        try:
            with progress() as bar:
                task = bar.add_task(f"RL [{name}]", total=cfg.learner.steps, completed=first)
                while True:
                    done, _ = ray.wait([learner_run, *runs.values(), *follows], num_returns=1, timeout=0.5)
                    for m in ray.get(learner.metrics_since.remote(read)):
                        read += 1
                        if keep_metrics:
                            metrics.append(m)
                        if on_metrics:
                            on_metrics(m)
                        phases.setdefault("first_step", time.time() - start)
                        bar.update(task, completed=int(m["learner/version"]), description=(
                            f"RL [{name}] reward {m['reward/mean']:.2f} acc {m['reward/accuracy']:.2f}"))
                    if stop is not None and stop.is_set():
                        learner.stop.remote()
                    for ref in follows:
                        if ref in done and learner_run not in done:
                            ray.get(ref)  # raises what stopped the rank
                            raise RuntimeError(f"learner rank {follows[ref]} stopped before rank 0")
                    if learner_run in done:
                        learner_stats = ray.get(learner_run)
                        phases["last_step"] = time.time() - start
                        break
                    for i, ref in list(runs.items()):
                        if ref in done:
                            try:
                                ray.get(ref)
                            except RayActorError as e:
                                restarts += 1
                                if restarts > cfg.launcher.max_actor_restarts * cfg.actors.num_actors:
                                    raise RuntimeError(f"actor {i} keeps dying; giving up") from e
                                log.warning("actor %d died (%s); Ray restarts it and it resumes", i, type(e).__name__)
                                pids[f"actor{i}"] = _wait_restarted(actors[i])
                                ray.get(actors[i].bind.remote(*run_args))
                                # Not kept: Ray's restart budget is per process, and this one spent some.
                                reusable[i] = False
                                nodes[f"actor{i}"].append(ray.get(actors[i].node.remote()))
                                if f"actor{i}" in local:  # on the driver's host: pinned again, if it still is
                                    _repin(f"actor{i}", pids, nodes, cores, local)
                            runs[i] = actors[i].run.remote(spare_cores=_spare_cores(cfg, cores, local, f"actor{i}"))
            out = final_model(rl_dir)
            ray.get(learner.save_model.remote(str(out)))
        finally:
            for a in actors:
                with contextlib.suppress(RayActorError):
                    a.stop.remote()
            learner.stop.remote()
        actor_stats, ended = [], set()
        for i, ref in runs.items():
            with contextlib.suppress(RayActorError, GetTimeoutError):
                actor_stats.append(ray.get(ref, timeout=60))
                ended.add(i)
        replay = ray.get(learner.replay_stats.remote())
        ray.get(learner.close.remote())
        for pid in local.values():  # every core back to the processes kept for a later stage or run
            pin(pid, host_cores())
        with contextlib.suppress(RayActorError, GetTimeoutError):
            ray.get(list(follows), timeout=60)
        for i, a in enumerate(actors):
            if not (cfg.launcher.reuse_actors and reusable[i] and i in ended and keep(a, keys[i], keep_s > 0)):
                ray.kill(a, no_restart=True)
        for handle in ranks:
            ray.kill(handle, no_restart=True)
        _keep_learner(cfg, learner, pg, learner_name)
        phases["end"] = time.time() - start
        return RLResult(name, metrics, learner_stats, actor_stats, replay, restarts, phases["end"], str(out), pids,
                        phases, nodes, cores)
