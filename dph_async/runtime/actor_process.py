"""The actors' Ray processes (`ActorProcess`: one vLLM engine each), how a run gets them (new, or
kept from an earlier run: dph_async/runtime/actor_pool.py), and the stages before RL that run on the
process actor 0 of the next run takes (pre-sampling, evaluation), so one engine build serves both.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Literal

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError

from dph_async import net
from dph_async.actors.telemetry import ActorCollector, actor_health
from dph_async.config import RunConfig
from dph_async.metrics_endpoint import start_endpoint
from dph_async.paths import endpoints_dir
from dph_async.replay_client import RolloutSender
from dph_async.rewards.scorer import make_scorer
from dph_async.run_stats import ActorStats
from dph_async.runtime import reuse
from dph_async.runtime.actor_pool import engine_settings, holding, keep, new_actor_options, take
from dph_async.runtime.cpu_cores import offload_threads
from dph_async.runtime.evaluate import EvalJob, evaluate_jobs
from dph_async.runtime.placement import actor_placement, home_node, on_home_node
from dph_async.runtime.process_env import log_to_file
from dph_async.samplers import sampler
from dph_async.tasks.dataset import load_prompts

if TYPE_CHECKING:
    from dph_async.runtime.model_shipping import Shipment


def _worker_side() -> ModuleType:
    """The half of an actor process that needs torch (dph_async/runtime/actor_worker.py): imported by the
    process's __init__ (`_import_heavy`), never by the driver."""
    # heavy (torch, transformers: about 3 CPU-s): the driver imports this module to start the
    # processes and never loads them
    from dph_async.runtime import actor_worker
    return actor_worker


def _import_heavy(engine: Literal["vllm", "mixture"]) -> None:
    """Import every heavy module the process's calls use, on the thread Ray runs __init__ on: Ray runs
    no call before __init__ returns, so no two threads import at once (transformers' lazy module
    fails an import that another thread has begun). vLLM and pre-sampling's modules only for an
    online sampler's engine (`engine` "vllm"): a mixture sampler's process never loads them."""
    w = _worker_side()
    if engine == "vllm":
        w.vllm_engine()
        import dph_async.runtime.presample  # noqa: F401  (heavy: transformers' models, the learner's kernels)


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
    (`launcher.keep_actors_s`, dph_async/runtime/actor_pool.py); each `bind` gives it a run's prompt
    stream, reward workers and connections, and `unbind` closes them.

    On the driver's node (`home`) it reads the model and the prompts from their paths; on any other
    node it gets them from the learner and its weight server (dph_async/runtime/model_shipping.py)."""

    def __init__(self, actor_id: int, keep_s: float, engine: Literal["vllm", "mixture"]) -> None:
        _import_heavy(engine)
        self.actor_id = actor_id
        self.engine = None
        self.worker = None
        self.endpoint = None
        self._stop = threading.Event()
        # Outliving the invocation (dph_async/runtime/actor_pool.py): one driver at a time holds the
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
             home: str, learner: tuple[str, str], actor_token: bytes) -> bool:
        """Join a run; returns whether this process may serve a later run (one whose engine a reset can
        bring back to the run's start: not a mixture sampler's, which holds pi_0 as well). actor_token:
        the replay's, carried by this actor's ticket requests."""
        self._binding = True
        try:
            return self._bind(cfg, model_dir, prompts_path, ingest, weights, log_dir, home, learner, actor_token)
        finally:
            self._binding, self._called = False, time.monotonic()

    def _bind(self, cfg: RunConfig, model_dir: str, prompts_path: str, ingest: str, weights: str, log_dir: str,
              home: str, learner: tuple[str, str], actor_token: bytes) -> bool:
        log_to_file(Path(log_dir) / f"actor{self.actor_id}.log")
        w = _worker_side()
        actor_id, security = self.actor_id, net.NetSecurity.from_config(cfg.net)
        weight_client = w.WeightClient(weights, security, actor_id, transport=cfg.learner.weight_transport)
        at_home = home_node() == home
        if self.engine is None:
            prompts = self._build_engine(cfg, model_dir, prompts_path, weight_client, at_home, learner)
        elif at_home:  # the launcher hands a kept process only a run its engine fits
            self.engine.reset(model_dir)
            prompts = _prompts(cfg, prompts_path, self.engine)
        else:
            prompts = self._restart_from_learner(cfg, prompts_path, weight_client, learner)
        sender = RolloutSender(ingest, actor_id, security, token=actor_token)
        self.worker = w.RolloutWorker(actor_id, cfg, self.engine, prompts, sender, weight_client,
                                      make_scorer(cfg.rewards))
        self.endpoint = _actor_endpoint(cfg, self.worker, Path(log_dir).parent)
        return not sampler(cfg.actors.sampler).uses_reference

    def _restart_from_learner(self, cfg: RunConfig, prompts_path: str, weight_client,
                              learner: tuple[str, str]) -> list:
        """Off the driver's node: back to what a new engine here starts from (model_shipping.py), the
        learner's newest weights, and the prompts it ships; return those prompts."""
        shipment = _shipment(learner, prompts_path)
        ready = _worker_side().first_weights(weight_client)
        with weight_client.tensors(ready) as named:
            self.engine.restart(named, ready.version)
        with tempfile.TemporaryDirectory(prefix=f"dph-actor{self.actor_id}-") as local:
            prompts_file = Path(local) / shipment.prompts_name
            prompts_file.write_bytes(shipment.prompts)
            return _prompts(cfg, str(prompts_file), self.engine)

    def _build_engine(self, cfg: RunConfig, model_dir: str, prompts_path: str, weight_client, at_home: bool,
                      learner: tuple[str, str]) -> list:
        """Build the engine (self.engine); return the run's prompts, read while a shipped copy exists."""
        w = _worker_side()
        actor_id, version, chosen = self.actor_id, 0, sampler(cfg.actors.sampler)
        with tempfile.TemporaryDirectory(prefix=f"dph-actor{actor_id}-") as local:  # gone once loaded
            if not at_home:
                if chosen.uses_reference:  # the shipped model is the newest policy, not pi_0
                    raise RuntimeError(f"actors.sampler={chosen.name} mixes in pi_0, which only the "
                                       "driver's node holds: run these actors on that node")
                shipment = _shipment(learner, prompts_path)
                model, prompts_file, version = w.materialize(shipment, weight_client, Path(local))
                model_dir, prompts_path = str(model), str(prompts_file)
            if chosen.engine == "vllm":
                self.engine = w.online_engine(cfg, model_dir, actor_id, version)
            else:  # pi_ref is the model the actor starts from: pi_0
                self.engine = w.MixtureEngine(model_dir, chosen.name, dtype=cfg.model.dtype,
                                            seed=cfg.seed + 1000 * actor_id, threads=cfg.actors.threads)
            return _prompts(cfg, prompts_path, self.engine)

    def presample(self, cfg: RunConfig, model_dir: str, train: str, out_dir: str) -> None:
        """Pre-sample pi_0 (dph_async/runtime/presample.py) with this process's engine, built here if it has
        none: the RL run that takes the process next starts on an engine already built."""
        from dph_async.runtime.presample import presample  # imported by __init__ (`_import_heavy`)

        log_to_file(Path(out_dir) / "presample.log")
        self._engine_of(cfg, model_dir)
        presample(cfg, Path(model_dir), Path(train), Path(out_dir), engine=self.engine)

    def evaluate(self, cfg: RunConfig, model_dir: str, jobs: list[EvalJob], test_sets: dict[str, str]) -> None:
        """Evaluate `jobs` (dph_async/runtime/evaluate.py) with this process's engine, reset to `model_dir`'s
        weights first, or built here if it has none (as for `presample`)."""
        log_to_file(jobs[0].out.with_suffix(".log"))
        self._engine_of(cfg, model_dir)
        evaluate_jobs(cfg, Path(model_dir), jobs, {k: Path(v) for k, v in test_sets.items()}, engine=self.engine)

    def _engine_of(self, cfg: RunConfig, model_dir: str) -> None:
        """This process's engine on `model_dir`'s weights: built if there is none, else reset to them."""
        if self.engine is None:
            self.engine = _worker_side().online_engine(cfg, model_dir, self.actor_id)
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

    def run(self, max_groups: int | None = None, spare_cores: list[int] | None = None) -> ActorStats:
        """Generate until stopped; first, with `spare_cores`, every other thread of the process but ZMQ's
        goes there, and the calling thread (Ray's choice) keeps the actor's cores (cpu_cores.py)."""
        self._stop.clear()
        if spare_cores:
            self.worker.stats.threads_offloaded = offload_threads(spare_cores)
        return self.worker.run(self._stop, max_groups)

    def stop(self) -> None:
        self._stop.set()


def actor_key(cfg: RunConfig, model_dir: Path, actor_id: int) -> tuple:
    """What a kept process must match to serve as actor `actor_id` of a run (actor_pool.py). Pooled
    processes are named and detached, the others are not: the two never stand in for each other."""
    return (actor_id, home_node(), cfg.launcher.keep_actors_s > 0, *engine_settings(cfg, model_dir))


def prestart_actors(cfg: RunConfig) -> None:
    """Start the processes of the first run's actors now, on the cluster this invocation just started
    on this host, each importing vLLM in its __init__ (about 8 s of a core) while the driver goes on
    with its own imports and preparation: the first `new_actor` of each id takes one. Not for processes that outlive the
    invocation (they are named by their engine settings, not known yet) nor for samplers that build
    no vLLM engine."""
    if cfg.launcher.keep_actors_s > 0 or sampler(cfg.actors.sampler).engine != "vllm":
        return
    for i in range(cfg.actors.num_actors):
        if not reuse.has_spare(key := reuse.spare_key(cfg, i)):
            reuse.put_spare(key, _new_process(cfg, i, on_home_node(), {}))


def new_actor(cfg: RunConfig, key: tuple, placement: dict) -> ray.actor.ActorHandle:
    """A new actor process for `key`, or a spare started with the cluster (`prestart_actors`: spares
    live on the one node of a local cluster, where `placement` leads too). Ray restarts it if it dies
    (its __init__ runs again, then the run binds it again), on another node if its own is gone."""
    naming = new_actor_options(key, cfg.launcher.keep_actors_s)
    if not naming and (spare := reuse.take_spare(reuse.spare_key(cfg, key[0]))) is not None:
        return spare
    return _new_process(cfg, key[0], placement, naming)


def _new_process(cfg: RunConfig, actor_id: int, placement: dict, naming: dict) -> ray.actor.ActorHandle:
    keep_s = cfg.launcher.keep_actors_s
    options = dict(num_cpus=1, max_concurrency=4, max_restarts=cfg.launcher.max_actor_restarts, max_task_retries=0)
    if cfg.actors.threads > 1:
        # OpenMP's thread count is per OS thread, and vLLM fixes torch's after its build; the calls run
        # on Ray's threads, not the one that built the engine, so the count must be every thread's
        # default from the process's start (vLLM's CPU attention checks that its plan and its kernel
        # agree). Ray would set 1, from num_cpus.
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(cfg.actors.threads)}}
    return ActorProcess.options(**options, **placement, **naming).remote(actor_id, keep_s,
                                                                         sampler(cfg.actors.sampler).engine)


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
    return (cfg.launcher.reuse_actors and not sampler(cfg.actors.sampler).uses_reference
            and "label_selector" not in actor_placement())


def presample_on_actor(cfg: RunConfig, model_dir: Path, train: Path, out_dir: Path) -> bool:
    """Pre-sample pi_0 in the process that actor 0 of the next RL run from `model_dir` takes
    (`launcher.reuse_actors`), so that one engine build serves both; False, with nothing done, where a
    kept process could not serve that run (`_keepable`)."""
    if not _keepable(cfg):
        return False
    model_dir = model_dir.resolve()
    keep_s, key = cfg.launcher.keep_actors_s, actor_key(cfg, model_dir, 0)
    actor = take(key, keep_s) or new_actor(cfg, key, on_home_node())  # it reads and writes the run directory
    _then_keep(actor, key, keep_s, actor.presample.remote(cfg, str(model_dir), str(train.resolve()),
                                                          str(out_dir.resolve())))
    return True


def evaluate_on_actor(cfg: RunConfig, model_dir: Path, jobs: list[EvalJob], test_sets: dict[str, Path]) -> bool:
    """Evaluate `jobs` in the process that actor 0 of an RL run of `model_dir`'s architecture takes:
    the one a run kept, without building another engine, or else a new one, kept afterwards, so that
    an evaluation before RL (pi_0's, in a sweep) builds the engine the first run then starts on. Every
    other kept process ends first (its memory goes to this one). False, with nothing evaluated, where
    no process is kept on the driver's node and a new one could not be kept (`_keepable`)."""
    keep_s, key = cfg.launcher.keep_actors_s, actor_key(cfg, model_dir.resolve(), 0)
    actor = take(key, keep_s) if not sampler(cfg.actors.sampler).uses_reference else None
    reuse.release(spares=False, learner=False)
    if actor is not None and ray.get(actor.node.remote())[1] != home_node():  # it reads and writes the run directory
        if not keep(actor, key, keep_s > 0):
            ray.kill(actor, no_restart=True)
        actor = None
    if actor is None:
        if not _keepable(cfg):
            return False
        actor = new_actor(cfg, key, on_home_node())
    _then_keep(actor, key, keep_s, actor.evaluate.remote(cfg, str(model_dir.resolve()), jobs,
                                                         {k: str(v) for k, v in test_sets.items()}))
    return True


def wait_restarted(actor: ray.actor.ActorHandle, timeout_s: float = 600.0) -> int:
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
