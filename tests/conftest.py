"""Fixtures shared across modules.

`private_core_claims`: the session's runs claim cores in a directory of their own.
`ray_session`: one Ray cluster for the tests that run the processes in-process.
`small_base`: one warm-started tiny base model with its pre-sampled pools (D_pef, D_exp), made once
per session and reused by every end-to-end module (they copy it or train from it, never change it).
`scorer_process`: the scorer service in a process of its own.
`head_starts`, `engine_zygote`: work started with the session for the slow tests (tests/head_starts.py).
`ipc`: ipc:// endpoints in Linux's abstract socket namespace: no file, so no 107-byte path limit
however long TMPDIR is, and nothing left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from head_starts import BUILD_DEEPSPEED_OP, Job, Zygote
from hypothesis import settings

ROOT = Path(__file__).resolve().parent.parent

# A failing property test prints the blob that replays its example (@reproduce_failure); under CI
# (the CI variable set) the examples are derandomised, so a failure there repeats anywhere.
settings.register_profile("dev", print_blob=True)
settings.register_profile("ci", print_blob=True, derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# Per-test time limits by marker (pytest-timeout; `timeout` in pyproject.toml is the default), so a
# hang fails its test instead of stalling the suite. Generous: at a load average of 16 on two cores
# fast tests took over 120 s. A test's own @pytest.mark.timeout wins.
TIMEOUT_BY_MARKER = {"slow": 1200, "triton": 900}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            limits = [s for name, s in TIMEOUT_BY_MARKER.items() if item.get_closest_marker(name)]
            if limits:
                item.add_marker(pytest.mark.timeout(max(limits)))
    # Modules without a slow test first, each module whole (its fixtures made once): their minutes
    # leave a core idle for the head starts (tests/head_starts.py), and a fast failure shows early.
    slow = {item.getparent(pytest.Module) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.getparent(pytest.Module) in slow)


@pytest.fixture(scope="session", autouse=True)
def head_starts(request, tmp_path_factory, private_core_claims) -> Iterator[dict[str, Job | Zygote]]:
    """The head starts the session's tests ask for, started now (tests/head_starts.py): by fixture name,
    and DeepSpeed's op wherever a slow test runs (most start a learner)."""
    items = request.session.items
    wanted = {name for item in items for name in item.fixturenames}
    logs = tmp_path_factory.mktemp("head-starts")
    started: dict[str, Job | Zygote] = {}
    if any(item.get_closest_marker("slow") for item in items):
        started["deepspeed_op"] = Job(BUILD_DEEPSPEED_OP, logs / "deepspeed_op.log")
    if "engine_zygote" in wanted:
        started["engine_zygote"] = Zygote(logs / "engine_zygote.log")
    yield started
    for head_start in started.values():
        head_start.close()


@pytest.fixture(scope="session")
def engine_zygote(head_starts) -> Zygote:
    """tests/engine_zygote.py: vLLM imported once for the engine tests, `run_child(..., zygote=engine_zygote)`."""
    return head_starts["engine_zygote"]

# The small size of every end-to-end run: seconds per stage on two cores. So short a warm start
# leaves pi_0 right a few percent of the time: a prompt joins D_pef with one correct sample of its
# eight, so that the reference pool (and the DPH term) is not empty. The actors' model op by op: these
# runs build more engines than they generate with, and a compiled build costs 2-3 s more (20 s cold);
# `dph-async run`'s test (test_run_command.py) and test_engine_compile.py run the compiled default.
SMALL = [
    "warmstart.steps=100", "presample.min_correct=1", "task.num_train=64", "task.num_test=16",
    "learner.groups_per_step=4", "sampling.n=4", "sampling.max_tokens=10", "eval.k_max=4", "eval.max_prompts=8",
    "actors.max_inflight_prompts=4", "logging.wandb_mode=disabled", "learner.checkpoint_every=0",
    "actors.compile=false",
]
# What a run directory takes from the shared base: the stages before RL.
BASE_PARTS = ("base_model", "data", "presample")


# A model vLLM's CPU attention serves (head size 32) at the embedded default's vocabulary: what the
# tests that run a vLLM engine in a child process build their models from.
TINY_VLLM_CONFIG = dict(vocab_size=16, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
# Its config.json: a model directory the checks before start accept (dph_async/pipeline/preflight.py), no weights.
TINY_LLAMA_JSON = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **TINY_VLLM_CONFIG}


@pytest.fixture
def memory_path(tmp_path):
    """A scratch directory in memory where the machine has one (/dev/shm): logs that sync their files on
    every write (the write-ahead log's manifest and base) cost nothing there, so hundreds stay fast."""
    if not Path("/dev/shm").is_dir():
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="dph-test-"))
    try:
        yield path
    finally:
        shutil.rmtree(path)


def stub_model_dir(out: Path) -> Path:
    """A model directory the driver's checks accept (TINY_LLAMA_JSON, and a safetensors file naming its
    untied head), for tests of what happens after them; nothing can be trained from it."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(TINY_LLAMA_JSON))
    save_file({"lm_head.weight": np.zeros((1, 1), np.float32)}, str(out / "model.safetensors"))
    return out


def save_tiny_model(model, out: Path) -> Path:
    """Save `model` with the embedded default's tokenizer: a directory vLLM loads."""
    from dph_async.tasks.embedded import ALPHABET
    from dph_async.tasks.tiny_model import build_tokenizer

    model.save_pretrained(out)
    build_tokenizer(ALPHABET).save_pretrained(out)
    return out


def save_tiny_llama(out: Path, seed: int = 0) -> Path:
    """A random-init Llama of TINY_VLLM_CONFIG drawn from `seed`, saved as save_tiny_model saves it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return save_tiny_model(LlamaForCausalLM(LlamaConfig(**TINY_VLLM_CONFIG)), out)


def run_child(source: str, tmp_path: Path, *args: str, timeout: float = 900, zygote: Zygote | None = None) -> dict:
    """Run `source` as a script in a child process of its own (as an actor's vLLM engine lives), as
    `python script OUT *args` from the repository, or forked from `zygote` (vLLM already imported);
    return the JSON it wrote to OUT."""
    script, out = tmp_path / "child.py", tmp_path / "out.json"
    script.write_text(source)
    if zygote is not None:
        log = tmp_path / "child.log"
        code = zygote.run(script, [str(out), *args], log, timeout)
        assert code == 0, log.read_text(errors="replace")[-3000:]
        return json.loads(out.read_text())
    proc = subprocess.run([sys.executable, str(script), str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def small_config(root: Path, *overrides: str):
    from dph_async.config import load_config
    from dph_async.pipeline.stages import validate

    return validate(load_config("default", [*SMALL, f"output_dir={root}", *overrides]), [])


@pytest.fixture(scope="session", autouse=True)
def private_core_claims(tmp_path_factory) -> Iterator[Path]:
    """The runs of this test run claim cores among themselves only (dph_async/runtime/cpu_claims.py): other
    invocations on the machine would otherwise leave them cores other than the tests expect."""
    directory = tmp_path_factory.mktemp("core-claims")
    before = os.environ.get("DPH_CORES_DIR")
    os.environ["DPH_CORES_DIR"] = str(directory)
    yield directory
    if before is None:
        os.environ.pop("DPH_CORES_DIR", None)
    else:
        os.environ["DPH_CORES_DIR"] = before


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory) -> Iterator[None]:
    """One local Ray cluster for every test that runs the processes in this one: their `ray_cluster`
    uses it and leaves it running, instead of paying a cluster's start (5-9 s here) each. Runs in
    subprocesses start clusters of their own. Four CPUs: the most any of these tests asks for."""
    from dph_async.runtime.cluster import ray_cluster

    with ray_cluster(small_config(tmp_path_factory.mktemp("ray"), "launcher.num_cpus=4")):
        yield


@pytest.fixture(scope="session")
def small_base(ray_session, tmp_path_factory) -> Path:
    """A run directory holding pi_0 (warm start), the datasets and the pre-sampling of the small size."""
    from dph_async.paths import RunPaths
    from dph_async.pipeline.stages import StageTimer, prepare

    root = tmp_path_factory.mktemp("small-base")
    prepare(small_config(root), RunPaths(root), StageTimer(), need_presample=True)
    return root


def copy_base(base: Path, root: Path) -> None:
    """Start a run directory from the shared base: its warm start and pre-sampling are then skipped."""
    root.mkdir(parents=True, exist_ok=True)
    for part in BASE_PARTS:
        shutil.copytree(base / part, root / part)


def ipc_endpoint(name: str) -> str:
    """A unique abstract-namespace endpoint (`ipc://@...`), short whatever the temporary directory."""
    return f"ipc://@dph-{os.getpid()}-{uuid.uuid4().hex[:12]}-{name}"


@pytest.fixture
def ipc():
    """ipc_endpoint, as a fixture: `ipc("ingest")`."""
    return ipc_endpoint


def session_members(sid: int) -> list[str]:
    """`pid sid command` of every process in session `sid`."""
    out = subprocess.run(["ps", "-eo", "pid=,sess=,args="], capture_output=True, text=True, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.split()[1] == str(sid)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every process."""
    # -ww: whole command lines, whatever COLUMNS says (pytest sets it; ps would cut lines to it).
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True,
                         check=True).stdout
    table = {}
    for line in out.splitlines():
        pid, ppid, *args = line.split(None, 2)
        table[int(pid)] = (int(ppid), args[0] if args else "")
    return table


def descendants(root: int, table: dict[int, tuple[int, str]]) -> list[int]:
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        kids = [pid for pid, (ppid, _) in table.items() if ppid == parent]
        found += kids
        frontier += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL a process this test started and everything under it."""
    table = processes()
    for p in [pid, *descendants(pid, table)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


@pytest.fixture
def closed_port():
    """A loopback TCP port nothing listens on, for as long as the test runs: bound here but never
    listening, so connections to it are refused (no guess that some well-known port is closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@contextlib.contextmanager
def _scorer(*args: str) -> Iterator[tuple[str, int]]:
    """`dph-async serve scorer --port 0 ARGS` in its own process, until ready: (url, pid)."""
    server = subprocess.Popen([sys.executable, "-m", "dph_async.cli.main", "serve", "scorer", "--port", "0", *args],
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = server.stderr.readline()  # "scorer: N workers, http://127.0.0.1:PORT"
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:"), line
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert server.poll() is None, "the scorer service exited"
                time.sleep(0.1)
        else:
            pytest.fail("the scorer service never became healthy")
        yield url, server.pid
    finally:
        server.terminate()
        code = server.wait(timeout=20)
        server.stderr.close()
    assert code == 0, f"the scorer service did not stop cleanly on SIGTERM (exit {code})"


@pytest.fixture(scope="session")
def scorer_process() -> Callable[..., contextlib.AbstractContextManager[tuple[str, int]]]:
    """A function starting the scorer service in a process of its own: `with scorer_process(*args) as
    (url, pid)`."""
    return _scorer
