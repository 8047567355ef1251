"""The real system at a small size: Ray, vLLM actors in their own processes, the replay service, the
DeepSpeed learner, ZeroMQ between them: an async run within its staleness bound, and an actor killed
mid-run. (Sync mode, resume against an uninterrupted run, per-token log-probs and Ctrl-C go through
the `dph-async run` command in tests/test_run_command.py.)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest
import ray
import torch
from conftest import alive, small_config

from dph_async.paths import RunPaths
from dph_async.pipeline.specs import RunSpec
from dph_async.pipeline.stages import StageTimer, prepare
from dph_async.run_stats import RLResult
from dph_async.runtime import actor_process, launcher, learner_process, reuse
from dph_async.runtime.actor_pool import POOL_NAMESPACE, holding
from dph_async.runtime.actor_process import ActorProcess
from dph_async.runtime.cluster import ray_cluster
from dph_async.runtime.cpu_claims import live_claims
from dph_async.runtime.cpu_cores import host_cores, plan_cores, process_tree
from dph_async.runtime.launcher import run_rl
from dph_async.runtime.process_env import cache_dir

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def prepared(small_base):
    """The shared small base (pi_0 and the pre-sampled pools) inside a Ray cluster for this module."""
    cfg = small_config(small_base)
    with ray_cluster(cfg):
        yield small_base, prepare(cfg, RunPaths(small_base), StageTimer(), need_presample=True)


def consumed(rl_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (rl_dir / "consumed.jsonl").read_text().splitlines()]


def group_ids(rl_dir: Path) -> list[tuple[int, int]]:
    """Every consumed group id, step by step (sorted within a step: arrival order is not data)."""
    return [gid for step in consumed(rl_dir) for gid in sorted((a, s) for a, s, *_ in step["groups"])]


def train(prepared, name: str, *overrides: str, mode: str = "js_low_var", **kwargs) -> tuple[RLResult, Path]:
    root, prep = prepared
    spec = RunSpec.parse(mode)
    cfg = spec.apply(small_config(root, *overrides))
    rl_dir = root / name
    return run_rl(cfg, name, rl_dir, prep.base, prep.prompts_for(spec), prep.pool_for(spec), **kwargs), rl_dir


def test_a_cluster_this_process_holds_is_used_and_left_running(prepared):
    """A run inside a Ray cluster it did not start (a service's, a notebook's, the test session's) must
    not shut that cluster down when it ends."""
    node = ray.get_runtime_context().get_node_id()
    with ray_cluster(small_config(prepared[0])):
        assert ray.get_runtime_context().get_node_id() == node
    assert ray.is_initialized() and ray.get_runtime_context().get_node_id() == node


def test_workers_of_a_local_cluster_see_the_cache_directory_without_a_runtime_env(prepared):
    """DeepSpeed's compiled ops are found through DPH_CACHE_DIR in every worker. It reaches them from
    the raylet's environment, not a runtime_env, which would make each actor process start 0.7 s later."""

    @ray.remote(num_cpus=0)
    def seen() -> tuple[str | None, dict]:
        return os.environ.get("DPH_CACHE_DIR"), ray.get_runtime_context().runtime_env

    cache, env = ray.get(seen.remote())
    assert cache == str(cache_dir()) and not env.get("env_vars")


def test_a_local_run_starts_its_own_cluster_whatever_ray_remembers_of_a_stopped_one():
    """Ray records the address of a cluster `ray start` made on this machine, and a cluster stopped
    without `ray stop` (cluster.sh stops its node by signal) leaves that record behind. A run without
    launcher.address must still start its own cluster, not try to join the dead one and fail."""
    tmp = Path(tempfile.mkdtemp(prefix="r"))  # short: Ray's socket paths live under it
    try:
        (tmp / "ray").mkdir()
        (tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
        code = ("import ray\nfrom dph_async.config import load_config\n"
                "from dph_async.runtime.cluster import ray_cluster\n"
                "with ray_cluster(load_config('default', ['launcher.num_cpus=1'])):\n"
                "    print(ray.get_runtime_context().gcs_address)")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(tmp)}
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
        assert child.returncode == 0, child.stderr[-3000:]
        assert child.stdout.strip() and "127.0.0.1:1" not in child.stdout
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


ETA = 1
# Rollouts at a temperature other than 1, where vLLM's raw and processed log-probs differ.
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def async_run(prepared) -> tuple[RLResult, Path]:
    """Two actors within eta = 1 at temperature 0.7, a checkpoint at every version (the behaviour
    log-prob test reads the learner's weights of each)."""
    return train(prepared, "async", "learner.steps=5", f"replay.max_staleness={ETA}", "actors.num_actors=2",
                 f"sampling.temperature={TEMPERATURE}", "learner.checkpoint_every=1", "learner.keep_checkpoints=0")


def test_async_respects_staleness_and_trains(async_run):
    result, rl_dir = async_run
    assert len(result.metrics) == 5
    assert all(math.isfinite(m["loss/total"]) for m in result.metrics)
    # On one host every version reached the actors through the learner's shared memory.
    assert all(a.weight_shm_loads == a.weight_loads and a.weight_shm_fallbacks == 0
               for a in result.actors), result.actors
    assert all(m["batch/reference_samples"] > 0 for m in result.metrics)  # the DPH term had samples
    plan = plan_cores(host_cores(), 2, 1)  # none on 2 cores: the learner would be left without one
    assert result.cores == ({} if plan is None else {"actor0": plan.actors[0], "actor1": plan.actors[1],
                                                     "learner": plan.learner})
    steps = consumed(rl_dir)
    assert [s["version"] for s in steps] == list(range(5))
    for step in steps:
        assert len(step["groups"]) == 4
        for _, _, oldest, _ in step["groups"]:
            assert 0 <= step["version"] - oldest <= ETA
    ids = group_ids(rl_dir)
    assert len(ids) == len(set(ids)), "a group was used twice"
    # The actors' ticket requests carried the run's actor token: none was served as a stranger's.
    assert result.replay.tickets.granted > 0 and result.replay.tickets.anonymous == 0
    # Every actor that contributed loaded new weights, and tokens made with them reached the learner.
    # (Not necessarily both: in a run of 5 steps, about 2 s, one actor can take every ticket while
    # the other is still in its first engine step.)
    assert all(a.weight_loads >= 1 for a in result.actors if a.groups_sent > 0)
    assert max(newest for s in steps for *_, newest in s["groups"]) >= 1
    assert (rl_dir / "final_model" / "config.json").is_file()
    # An engine step's CPU splits into the model's forward and vLLM's bookkeeping (bench peer's limit).
    # The actor's thread does the engine steps and more (bench peer's bound on one actor's thread),
    # and marks its clocks as it goes: between two marks the thread's CPU is no more than the wall
    # time, its engine steps' no more than that, their forward no more than those.
    for a in (a for a in result.actors if a.groups_sent > 0):
        assert 0 < a.forward_cpu_seconds < a.generate_cpu_seconds < a.thread_cpu_seconds, a
        marks = a.cpu_marks
        assert len(marks) >= 2 and list(marks[-1][1:]) == [a.thread_cpu_seconds, a.generate_cpu_seconds,
                                                             a.forward_cpu_seconds]
        for m0, m1 in pairwise(marks):
            wall, thread, engine, forward = (y - x for x, y in zip(m0, m1, strict=True))
            assert 0 <= forward <= engine + 1e-6 and engine <= thread + 1e-6 and thread <= wall + 0.02, (m0, m1)


def test_async_behaviour_logprobs_are_those_sampled_at_each_tokens_version(prepared, async_run):
    """Every token an actor logged (the replay's write-ahead log) against the distribution its engine
    sampled it from: the learner's weights of the version stamped on it (its checkpoints), over the KV
    cache of the earlier tokens' weights where a load came mid-response (tests/sampled_logprobs.py),
    at the sampling temperature."""
    from sampled_logprobs import model_at, sampled_logprobs
    from test_run_command import LOGPROB_TOL

    from dph_async.paths import checkpoint_dir
    from dph_async.replay.wal import IngestRecord, WriteAheadLog

    _, rl_dir = async_run
    groups = [g for r in WriteAheadLog(rl_dir / "replay_wal").records() if isinstance(r, IngestRecord)
              for g in r.groups]
    models = {v: model_at(prepared[1].base, checkpoint_dir(rl_dir), v)
              for v in {int(v) for g in groups for c in g.completions for v in c.versions}}
    worst, blind, checked, mid_response = 0.0, 0.0, 0, 0
    for g in groups:
        completions = [c for c in g.completions if len(c.token_ids)]
        firsts = {int(c.versions[0]) for c in completions}
        if len(firsts) > 1:  # a load between its completions' first steps: tests/test_inflight_logprobs.py
            continue
        (first,) = firsts
        for c in completions:
            versions = [int(v) for v in c.versions]
            want = sampled_logprobs(models, g.prompt_ids, c.token_ids, versions, first, TEMPERATURE)
            worst = max(worst, float(abs(want - c.logprobs).max()))
            checked += len(versions)
            mid_response += sum(v != first for v in versions)
            if first >= 2:  # the check can fail: pi_0's log-probs of tokens sampled two versions on
                at_0 = sampled_logprobs(models, g.prompt_ids, c.token_ids, [0] * len(versions), 0, TEMPERATURE)
                blind = max(blind, float(abs(at_0 - c.logprobs).max()))
    # Batches of version 4 take groups of version 3 at the oldest (eta = 1): tokens of 3 or later.
    assert max(models) >= 3 and checked >= 100, (sorted(models), checked)
    assert worst < LOGPROB_TOL, f"behaviour log-probs differ from those sampled by up to {worst:.2e} " \
                                f"({mid_response} of {checked} tokens sampled after a mid-response load)"
    assert blind > 10 * LOGPROB_TOL, f"versions 0 and 2+ differ by only {blind:.2e}: the check is blind"


def _without_seconds(results: dict) -> dict:
    return {split: {k: v for k, v in r.items() if k != "seconds"} for split, r in results.items()}


def test_pre_sampling_and_evaluation_run_in_a_runs_actor_process_as_in_a_process_of_their_own(prepared, tmp_path):
    """launcher.reuse_actors: an evaluation with no process kept (pi_0's, before a sweep's first run)
    builds the engine in a new actor process, which pre-sampling then takes (reset to pi_0), then
    actor 0 of the next run, and the evaluation after the run uses that engine again, so neither
    the run nor the later stages import and build vLLM; what they sample is what they sample in a
    process of their own, bit for bit."""
    import pyarrow.parquet as pq

    from dph_async.paths import final_model
    from dph_async.pipeline.stages import _evaluate_task, _presample_task
    from dph_async.runtime.evaluate import EvalJob

    root, prep = prepared
    cfg = small_config(root)
    tests = {"in_domain": root / "data" / "test.parquet"}
    key = actor_process.actor_key(cfg, prep.base.resolve(), 0)

    def kept_pid() -> int:
        return ray.get(reuse.KEPT.actors[key][0].pid.remote())

    def results(job: EvalJob) -> dict:
        return _without_seconds(json.loads(job.out.read_text()))

    reuse.release(spares=False, learner=False)  # no process kept: the test's runs before may have kept one
    first = EvalJob(prep.base, tmp_path / "new" / "base.json", 3)
    assert actor_process.evaluate_on_actor(cfg, prep.base, [first], tests)
    built = kept_pid()

    assert actor_process.presample_on_actor(cfg, prep.base, prep.train, tmp_path / "on-actor")
    assert kept_pid() == built
    ray.get(_presample_task.remote(cfg, str(prep.base), str(prep.train), str(tmp_path / "alone")))
    for name in ("samples.parquet", "reference_pool.parquet", "d_exp.parquet"):
        assert pq.read_table(tmp_path / "on-actor" / name).equals(pq.read_table(tmp_path / "alone" / name)), name
    result, rl_dir = train(prepared, "after-presample", "learner.steps=2", mode="grpo")
    assert result.pids["actor0"] == built and len(result.metrics) == 2
    # Pinned for the run where the host has a core to spare, unpinned once kept (launcher.pin_cores).
    assert ("actor0" in result.cores) == (plan_cores(host_cores(), cfg.actors.num_actors, 1) is not None)
    assert os.sched_getaffinity(built) == host_cores()

    jobs = {where: [EvalJob(prep.base, tmp_path / where / "base.json", 3),
                    EvalJob(final_model(rl_dir), tmp_path / where / "trained.json", 4)] for where in ("kept", "alone")}
    assert actor_process.evaluate_on_actor(cfg, prep.base, jobs["kept"], tests)
    assert kept_pid() == built
    ray.get(_evaluate_task.remote(cfg, str(prep.base), jobs["alone"], {k: str(v) for k, v in tests.items()}))
    for kept, alone in zip(jobs["kept"], jobs["alone"], strict=True):
        assert results(kept) == results(alone)
    assert results(first) == results(jobs["alone"][0])  # pi_0 on the new engine, as in a process of its own


def test_a_learner_started_ahead_is_the_next_runs_learner(prepared):
    """learner_process.start_learner (before pre-sampling, before a sweep's pi_0 evaluation): the process it
    starts is the next run's learner, and it starts none while one is kept."""
    reuse.release(spares=False, actors=False)
    cfg = small_config(prepared[0])
    learner_process.start_learner(cfg)
    ahead = reuse.KEPT.learner
    assert ahead is not None
    learner_process.start_learner(cfg)
    assert reuse.KEPT.learner is ahead
    pid = ray.get(ahead.handle.pid.remote())
    result, _ = train(prepared, "ahead", "learner.steps=2", mode="grpo")
    assert result.pids["learner"] == pid and len(result.metrics) == 2


def test_a_kept_actor_process_that_died_is_replaced(prepared):
    """launcher.reuse_actors: the run after one whose kept actor process died (and that Ray may not
    restart) gets a new process and trains, instead of failing on the dead one."""
    once = ("learner.steps=2", "launcher.max_actor_restarts=0")
    first, _ = train(prepared, "kept-1", *once, mode="grpo")
    again, _ = train(prepared, "kept-2", *once, mode="grpo")
    assert again.pids == first.pids  # kept: the same process served both runs
    os.kill(first.pids["actor0"], signal.SIGKILL)
    third, _ = train(prepared, "kept-3", *once, mode="grpo")
    assert third.pids["actor0"] != first.pids["actor0"] and len(third.metrics) == 2


# Another invocation: a driver process (a Ray job) of its own, running one RL run on a cluster it joins.
INVOCATION = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from conftest import alive, small_config
from dph_async.runtime.cluster import ray_cluster
from dph_async.runtime.launcher import run_rl
from dph_async.pipeline.stages import StageTimer, prepare
from dph_async.pipeline.specs import RunSpec
from dph_async.paths import RunPaths
root, name, overrides = Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
spec = RunSpec.parse("grpo")
cfg = spec.apply(small_config(root, *overrides))
with ray_cluster(cfg):
    prep = prepare(cfg, RunPaths(root), StageTimer(), need_presample=True)
    result = run_rl(cfg, name, root / name, prep.base, prep.prompts_for(spec), prep.pool_for(spec))
print(json.dumps({"pids": result.pids, "steps": len(result.metrics)}))
"""


def pooled() -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == POOL_NAMESPACE and a["name"].startswith("dph-actor-")]


def test_an_actor_kept_on_the_cluster_serves_the_next_invocation(prepared):
    """launcher.keep_actors_s: a run on a cluster that outlives its driver leaves its actor process
    there; the next invocation, another driver process, takes it instead of building an engine; and
    `dph-async pool` lists it (held by no run once that run ended) and ends it."""
    address = ray.get_runtime_context().gcs_address
    pool = ("learner.steps=2", f"launcher.address={address}", "launcher.keep_actors_s=60")
    first, _ = train(prepared, "pool-1", *pool, mode="grpo")
    assert len(pooled()) == 1
    child = subprocess.run([sys.executable, "-c", INVOCATION, str(Path(__file__).parent), str(prepared[0]),
                            "pool-2", *pool], capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    second = json.loads(child.stdout.strip().splitlines()[-1])
    # The same actor process, its engine reset (a learner is kept within an invocation only).
    assert second["steps"] == 2 and second["pids"]["actor0"] == first.pids["actor0"]

    def pool_command(*args: str) -> list[dict]:
        out = subprocess.run([sys.executable, "-m", "dph_async.cli.main", "pool", address, "--json", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    (row,) = pool_command()
    assert (row["pid"], row["held"], row["engine"], row["keep_s"]) == (first.pids["actor0"], False, True, 60)
    assert pool_command("--end")[0]["ended"]
    deadline = time.monotonic() + 30
    while (pooled() or alive(first.pids["actor0"])) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert pooled() == [] and not alive(first.pids["actor0"])


def test_a_kept_process_ends_itself_once_no_driver_calls_it():
    """What bounds a pooled process's life: one a run holds stays while its driver calls it; once
    the calls stop (the run ended, or its driver died) it ends itself keep_s later."""
    options = {"namespace": POOL_NAMESPACE, "lifetime": "detached", "num_cpus": 0}
    # "mixture": their __init__ imports no vLLM, which no engine here needs
    idle = ActorProcess.options(name="dph-actor-test-idle", **options).remote(0, 4.0, "mixture")
    held = ActorProcess.options(name="dph-actor-test-held", **options).remote(1, 4.0, "mixture")
    pids = ray.get([idle.pid.remote(), held.pid.remote()])
    ray.get(idle.unbind.remote())  # kept, and no run holds it
    with holding([held], 4.0):
        deadline = time.monotonic() + 30
        while alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive(pids[0]) and alive(pids[1])  # 4 s passed at least, the driver called every 2 s
    deadline = time.monotonic() + 30
    while alive(pids[1]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(pids[1]) and pooled() == []


def test_an_actor_off_the_drivers_node_is_kept_and_reset_from_the_learner(prepared, monkeypatch):
    """An actor on another node builds its engine from the learner's shipment and weights, having no
    base model on its disk; kept for the next run, it is reset from them again. (The driver is told
    it runs elsewhere: the actor then takes the path of a worker node's actor.)"""
    monkeypatch.setattr(launcher, "home_node", lambda: "the driver's node, elsewhere")
    # Three steps: at eta = 1 the third batch takes no group of version 0, so the kept actor must load
    # the learner's weights during the run. With two, it may finish both batches on the weights of its
    # reset: it did once in a full suite, and once in three runs of this test alone.
    once = ("learner.steps=3",)
    first, _ = train(prepared, "away-1", *once, mode="grpo")
    again, _ = train(prepared, "away-2", *once, mode="grpo")
    assert again.pids == first.pids and len(again.metrics) == 3
    assert all(a.weight_loads >= 1 for a in again.actors), again.actors


def test_killed_actor_is_restarted_and_run_completes(prepared, private_core_claims):
    pids: dict[str, int] = {}
    steps_at_kill: list[int] = []
    affinity: dict[str, set[int]] = {}
    actor_threads: list[tuple[str, set[int]]] = []  # (name, cores) of each of actor0's threads
    started: dict[int, set[int]] = {}  # cores of the processes the learner started (its gates)
    finished = threading.Event()
    metrics = prepared[0] / "chaos" / "metrics.jsonl"

    failed: list[BaseException] = []

    def cores_of(tids: list[int]) -> dict[int, set[int]]:
        """The cores of each of these processes or threads that still runs (one may end while read)."""
        out = {}
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):
                out[tid] = os.sched_getaffinity(tid)
        return out

    def thread_names(pid: int) -> list[tuple[str, set[int]]]:
        task = Path(f"/proc/{pid}/task")
        named = []
        for tid, cores in cores_of([int(t) for t in os.listdir(task)]).items():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                named.append(((task / str(tid) / "comm").read_text().strip(), cores))
        return named

    def kill_after_first_step() -> None:
        # Watched here, not from the driver's metrics (read every 0.5 s or later on two busy cores):
        # the steps take 0.25 s, and a late kill would find the remaining batches already made.
        try:
            while not finished.is_set():
                if "actor0" in pids and metrics.is_file() and (n := len(metrics.read_text().splitlines())):
                    affinity.update({k: os.sched_getaffinity(pids[k]) for k in ("actor0", "learner")})
                    started.update(cores_of(process_tree(pids["learner"])[1:]))
                    actor_threads.extend(thread_names(pids["actor0"]))
                    os.kill(pids["actor0"], signal.SIGKILL)
                    steps_at_kill.append(n)
                    return
                time.sleep(0.01)
        except BaseException as e:  # failed in the test, not silently in its thread
            failed.append(e)

    watcher = threading.Thread(target=kill_after_first_step)
    watcher.start()
    # One actor, and admission lets it work on one batch ahead at most (eta = 0): the steps after
    # the kill but one can only be taken if the killed actor comes back.
    try:
        result, rl_dir = train(prepared, "chaos", "learner.steps=8", "replay.max_staleness=0",
                               "actors.num_actors=1", on_started=pids.update)
    finally:
        finished.set()
        watcher.join()
    assert not failed, f"the watcher failed: {failed[0]!r}"
    assert steps_at_kill and steps_at_kill[0] <= 6, steps_at_kill  # the run still needed the actor
    assert result.actor_restarts >= 1
    assert result.metrics[-1]["learner/version"] == 8
    ids = group_ids(rl_dir)
    assert len(ids) == len(set(ids)) == 8 * 4
    # One actor on the learner's host: a core of its own (before the kill, and again once restarted)
    # and the learner the rest, where the host has a core to spare (launcher.pin_cores).
    plan = plan_cores(host_cores(), 1, 1)
    if plan is None:
        assert result.cores == {} and affinity["actor0"] == affinity["learner"] == host_cores()
    else:
        assert result.cores == {"actor0": plan.actors[0], "learner": plan.learner}
        # The actor's rollout thread and ZMQ's I/O threads kept its core; every other thread of it (Ray's
        # main thread among them) went to the learner's, before the kill and again once restarted.
        assert affinity == {"actor0": set(plan.learner), "learner": set(plan.learner)}
        # The learner's gates started before it was pinned, and were pinned with it.
        assert len(started) >= 2 and all(cores == set(plan.learner) for cores in started.values()), started
        zmq_cores = [cores for name, cores in actor_threads if name.startswith("ZMQbg")]
        assert zmq_cores and all(cores == set(plan.actors[0]) for cores in zmq_cores), actor_threads
        assert {frozenset(cores) for _, cores in actor_threads} == {frozenset(plan.actors[0]), frozenset(plan.learner)}
        assert result.actors[0].cores == plan.actors[0] and result.actors[0].threads_offloaded > 0
    assert live_claims(private_core_claims) == []  # the run's cores given back


HOLD_EVERY_CORE = """
import sys, time
from dph_async.runtime.cpu_claims import claim_cores
from dph_async.runtime.cpu_cores import host_cores
claim_cores(host_cores(), lambda free: free or None, list)
print("claimed", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(len(host_cores()) < 2, reason="one core: no run pins, so none shares")
def test_a_run_whose_cores_another_invocation_claimed_shares_them_and_says_so(prepared, private_core_claims):
    """Another invocation (a process of its own) holds every core of the host: the run pins nothing
    rather than pin onto its cores, names its claim, and gives back its own claim-free state."""
    child = subprocess.Popen([sys.executable, "-c", HOLD_EVERY_CORE], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1])
    try:
        assert child.stdout.readline().strip() == "claimed"
        result, _ = train(prepared, "shared", "learner.steps=2", "actors.num_actors=1", mode="grpo")
    finally:
        child.kill()
        child.wait(60)
    assert result.cores == {}
    assert len(result.cores_shared_with) == 1 and f"pid {child.pid} " in result.cores_shared_with[0]
    assert live_claims(private_core_claims) == []  # the child's dropped as stale; the run made none


def test_two_learner_ranks_train_checkpoint_and_resume(prepared):
    """learner.ranks=2: a second DeepSpeed rank in the learner's placement group trains its share of
    every batch; both write their parts of a checkpoint, and a run resumed from it goes on as the
    uninterrupted run did (sync mode: the run is a function of its seed), to the same weights."""
    from safetensors.torch import load_file
    from test_run_command import NOT_REPEATED

    def repeated(metrics: list[dict]) -> list[dict]:
        return [{k: v for k, v in m.items() if k not in NOT_REPEATED and not k.startswith("time/")} for m in metrics]

    ranks = ("mode=sync", "learner.ranks=2", "actors.num_actors=1", "learner.checkpoint_every=2", "learner.steps=3")
    result, rl_dir = train(prepared, "ranks", *ranks)
    assert [m["learner/version"] for m in result.metrics] == [1, 2, 3]
    assert all(math.isfinite(m["loss/total"]) and m["batch/trained_fresh_tokens"] > 0 for m in result.metrics)
    assert (rl_dir / "logs" / "learner1.log").is_file()
    # Both ranks' optimizer partitions (ZeRO-1, the default) are in the checkpoint.
    assert len(list((rl_dir / "checkpoints" / "v2").glob("*optim_states.pt"))) == 2
    weights = load_file(rl_dir / "final_model" / "model.safetensors")
    groups = group_ids(rl_dir)
    resumed, _ = train(prepared, "ranks", *ranks, resume_tag="v2")  # step 3 again, from v2's two partitions
    # The resumed run's metrics: the two steps logged before the checkpoint, then the new one.
    assert [m["learner/version"] for m in resumed.metrics] == [1, 2, 3]
    assert [s["version"] for s in consumed(rl_dir)] == [0, 1, 2] and group_ids(rl_dir) == groups
    assert repeated(resumed.metrics) == repeated(result.metrics)
    again = load_file(rl_dir / "final_model" / "model.safetensors")
    assert again.keys() == weights.keys()
    assert all(torch.equal(again[k], weights[k]) for k in weights), "the resumed run's weights differ"


def test_zero3_over_two_learner_ranks_publishes_measures_and_saves_whole_weights(prepared):
    """learner.zero_stage=3 with two ranks, every parameter partitioned: each rank holds half of every
    weight, so publishing, the KL monitor and the final model gather them from both ranks."""
    from transformers import AutoModelForCausalLM

    _, prep = prepared
    result, _ = train(prepared, "zero3", "learner.steps=2", "learner.ranks=2", "learner.zero_stage=3",
                      "learner.zero3_persist_below=0", "learner.kl_every=1", "learner.kl_samples=4",
                      "actors.num_actors=1", "replay.max_staleness=0")
    assert [m["learner/version"] for m in result.metrics] == [1, 2]
    # Staleness 0: the batch of version 1 was sampled with the weights published after step 1.
    assert all(m["staleness/max"] == 0 for m in result.metrics)
    assert all(m["kl/k3"] >= 0 and m["kl/sequences"] > 0 for m in result.metrics)
    final = AutoModelForCausalLM.from_pretrained(result.final_model).state_dict()
    base = AutoModelForCausalLM.from_pretrained(prep.base).state_dict()
    assert {k: v.shape for k, v in final.items()} == {k: v.shape for k, v in base.items()}
    assert any(not torch.equal(final[k], base[k]) for k in base)


# Last in the module: its engine settings differ (cpu_gemm), so it ends the kept actor process the
# tests above share.
def test_under_f_linear_the_actor_runs_on_the_learners_shared_weights(prepared):
    """actors.cpu_gemm=torch: every version reaches the engine as views of the learner's shared-memory
    slot, leased while the engine runs on it (no copy), and the behaviour log-probs are still the
    learner's at the version that made them (sync mode: one version per group), at a sampling
    temperature of 0.7. With two threads per actor: the engine runs on threads other than the one
    that built it, with the same thread count."""
    from test_run_command import LOGPROB_TOL, worst_gap
    from transformers import AutoModelForCausalLM

    from dph_async.learner.batching import Sequence
    from dph_async.paths import checkpoint_weights
    from dph_async.replay.wal import IngestRecord, WriteAheadLog

    result, rl_dir = train(prepared, "views", "mode=sync", "learner.steps=4", "actors.num_actors=1",
                           "actors.cpu_gemm=torch", "actors.threads=2", "learner.checkpoint_every=2",
                           "learner.keep_checkpoints=0", f"sampling.temperature={TEMPERATURE}", mode="grpo")
    (actor,) = result.actors
    assert actor.weight_loads >= 3, actor
    assert actor.weight_leased_loads == actor.weight_shm_loads == actor.weight_loads, actor
    made_at_2 = [[Sequence(g.prompt_ids, c.token_ids, c.logprobs) for c in g.completions if len(c.token_ids)]
                 for r in WriteAheadLog(rl_dir / "replay_wal").records() if isinstance(r, IngestRecord)
                 for g in r.groups if {v for c in g.completions for v in c.versions} == {2}]
    assert made_at_2
    model = AutoModelForCausalLM.from_pretrained(prepared[0] / "base_model", dtype=torch.float32).eval()
    model.load_state_dict(checkpoint_weights(rl_dir / "checkpoints" / "v2"))
    assert worst_gap(model, made_at_2, "fresh", TEMPERATURE) < LOGPROB_TOL
