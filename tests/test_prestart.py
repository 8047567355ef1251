"""A local cluster started for an RL run starts that run's processes at once (`ray_cluster(prestart=
True)`): the learner's, and a spare actor process per actor importing vLLM, which the first process
asked for each actor id takes; anything else gets a new process, and the spares no one took end with
the cluster. In a child process: the test session holds a cluster of its own."""

from __future__ import annotations

import pytest
from conftest import run_child

pytestmark = pytest.mark.slow

CHILD = """
import json, sys
from pathlib import Path
import ray
from dph_async.runtime import reuse
from dph_async.runtime.actor_process import actor_key, new_actor
from dph_async.runtime.cluster import ray_cluster
from dph_async.runtime.placement import actor_placement
from dph_async.config import load_config

cfg = load_config("default", ["actors.num_actors=2", "launcher.num_cpus=4", *sys.argv[2:]])
model = Path(sys.argv[1]).parent
out = {}
with ray_cluster(cfg, prestart=True):
    spares = dict(reuse.KEPT.spares)
    out["spares"] = sorted(k[0] for k in spares)
    out["learner_started"] = reuse.KEPT.learner is not None
    spare_pids = {k[0]: ray.get(h.pid.remote()) for k, h in spares.items()}
    first = new_actor(cfg, actor_key(cfg, model, 1), actor_placement())
    again = new_actor(cfg, actor_key(cfg, model, 1), actor_placement())
    out["first_is_spare"] = ray.get(first.pid.remote()) == spare_pids[1]
    out["again_is_new"] = ray.get(again.pid.remote()) not in spare_pids.values()
    out["left"] = sorted(k[0] for k in reuse.KEPT.spares)
    # vLLM imported by its __init__, before any call ran
    spare = spares[(0, cfg.launcher.max_actor_restarts, cfg.actors.threads)]
    out["imported"] = ray.get(spare.__ray_call__.remote(lambda self: "vllm" in sys.modules))
out["after"] = sorted(k[0] for k in reuse.KEPT.spares)
Path(sys.argv[1]).write_text(json.dumps(out))
"""


def test_a_runs_processes_start_with_its_cluster_and_the_first_of_each_actor_takes_its_spare(tmp_path):
    out = run_child(CHILD, tmp_path)
    assert out["spares"] == [0, 1] and out["learner_started"]
    assert out["first_is_spare"] and out["again_is_new"]
    assert out["left"] == [0] and out["imported"]
    assert out["after"] == []  # the cluster's end released the spare no one took


def test_no_process_starts_early_without_prestart(tmp_path):
    code = CHILD.replace("prestart=True", "prestart=False").split("    spare_pids")[0] + (
        "Path(sys.argv[1]).write_text(json.dumps(out))\n")
    out = run_child(code, tmp_path)
    assert out == {"spares": [], "learner_started": False}
