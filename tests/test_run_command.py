"""`dph-async run` as a user runs it, at the small size, in sync mode with one actor, comparing two modes.

One uninterrupted run, and the same command (its first mode copied from that run) SIGKILLed (the
driver's whole process group) in the middle of the second mode's RL and then run again. What that
proves:
- a complete run writes summary.json, summary.md with the comparison table, and the plots, whose
  content is that of the evaluations and metrics written beside them; a second invocation of a
  finished run redoes nothing and starts no Ray;
- resume is the uninterrupted run: the same groups, losses, final weights and optimizer state, bit
  for bit (sync mode with one actor makes the run a function of its seed);
- the actors' behaviour log-probs are the learner's at the version stamped on every token, per token
  (vLLM's CPU kernels against the learner's, within float tolerance), and the pi_0 log-probs stored
  with the reference samples are the learner's at step 0.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.figure
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from conftest import SMALL, copy_base, descendants, kill_tree, processes, session_members
from safetensors.torch import load_file

from dph_async.paths import MODEL_STATES, RunPaths, checkpoint_weights
from dph_async.pipeline.report import TABLE_K, write_report
from dph_async.protocol import SHM_PREFIX
from dph_async.run_stats import result_from
from dph_async.runtime.evaluate import load_results
from dph_async.state_file import load_state

pytestmark = pytest.mark.slow

STEPS = 10
MODES = ("grpo", "js_low_var")
# keep_checkpoints=0 keeps every checkpoint: the log-prob test reads the learner's weights at v2, v4, ...
# The actors' model compiled, as by default where a C++ compiler is found: the behaviour log-probs and
# the bit-for-bit resume below hold for the compiled engine.
RUN = ["mode=sync", "actors.num_actors=1", f"learner.steps={STEPS}", "learner.checkpoint_every=2",
       "learner.keep_checkpoints=0", "actors.compile=true"]
# Per-token |behaviour - learner| log-prob: vLLM's CPU kernels and the learner's agree to ~3e-5 in fp32.
LOGPROB_TOL = 2e-4
# Wall-clock figures (and time/*): the only metrics two runs of the same seed may disagree on, besides
# drops/rewound (groups a resumed replay discards because they were generated after the checkpoint).
NOT_REPEATED = ("learner/step_seconds", "learner/tokens_per_s", "drops/rewound")


def command(out: Path) -> list[str]:
    return [sys.executable, "-m", "dph_async.cli.main", "run", "--output", str(out), *SMALL, *RUN,
            "--compare", ",".join(MODES)]


def start(out: Path) -> subprocess.Popen:
    """The command in a session of its own (a terminal's foreground job), output to out.log."""
    with (out.parent / f"{out.name}.log").open("a") as log:
        return subprocess.Popen(command(out), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, out: Path) -> None:
    rc = proc.wait(timeout=900)
    assert rc == 0, (out.parent / f"{out.name}.log").read_text()[-4000:]


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def wait_gone(sid: int, timeout_s: float = 60.0) -> None:
    """Until no process of session `sid` is left (a killed one's children may take a moment)."""
    deadline = time.time() + timeout_s
    while (left := session_members(sid)) and time.time() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the killed run still alive: {left}"


@pytest.fixture(scope="module")
def runs(small_base, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("run-command")
    full, killed = root / "full", root / "killed"
    for out in (full, killed):
        copy_base(small_base, out)
    finish(start(full), full)
    # The killed run's first mode is the full run's, copied: the kill lands in its second mode, whose
    # resumed result must then equal the full run's (which also shows a run repeats from its seed: its
    # steps before the kill ran in processes of their own).
    shutil.copytree(full / "rl" / MODES[0], killed / "rl" / MODES[0])
    proc = start(killed)
    metrics = killed / "rl" / MODES[1] / "metrics.jsonl"
    while len(lines(metrics)) < 3:  # the second mode has passed its checkpoint v2 (of 5)
        assert proc.poll() is None, (root / "killed.log").read_text()[-4000:]
        time.sleep(0.05)
    # The whole run at once, as a lost machine would stop it: the driver's process group and every
    # process under it (Ray's workers sit in sessions of their own and would outlive the driver for
    # the moment Ray takes to notice, training on).
    kill_tree(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    wait_gone(proc.pid)
    latest = (killed / "rl" / MODES[1] / "checkpoints" / "latest").read_text().strip()
    checkpoint_mtime = (killed / "rl" / MODES[1] / "checkpoints" / latest / MODEL_STATES).stat().st_mtime_ns
    steps_at_kill = len(lines(metrics))
    finish(start(killed), killed)  # the same command again: resumes

    finished = {p: p.stat().st_mtime_ns for p in sorted(full.rglob("*")) if p.is_file()
                and p.parent.name in ("eval", "final_model", *MODES)}
    # Pointed at an address where no Ray listens: the call fails if it starts or joins a cluster.
    second = subprocess.run(command(full), capture_output=True, text=True, timeout=600,
                            env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    return {"full": full, "killed": killed, "latest": latest, "checkpoint_mtime": checkpoint_mtime,
            "steps_at_kill": steps_at_kill, "finished": finished, "second": second}


def metrics_of(rl_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in NOT_REPEATED and not k.startswith("time/")}
            for x in lines(rl_dir / "metrics.jsonl")]


def tensors(obj, prefix: str = "") -> dict[str, object]:
    """Every leaf of a (nested) checkpoint object by its path: tensors as tensors, the rest as values."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in tensors(val, f"{prefix}/{key}").items()}
    if isinstance(obj, list | tuple):
        return {k: v for i, val in enumerate(obj) for k, v in tensors(val, f"{prefix}/{i}").items()}
    return {prefix: obj}


def assert_same_checkpoint(a: Path, b: Path, roots: tuple[Path, Path]) -> None:
    """All files (state files) of two DeepSpeed checkpoint tags: every tensor bitwise, every other value equal
    (paths compared relative to their run directory)."""
    from dph_async.learner.checkpoint_engine import CODEC  # heavy (DeepSpeed): the loss scaler's class

    names = sorted(p.name for p in a.glob("*.pt"))
    assert names and names == sorted(p.name for p in b.glob("*.pt"))
    assert any("optim_states" in n for n in names), names
    for name in names:
        left, right = (tensors(load_state(d / name, CODEC)) for d in (a, b))
        assert left.keys() == right.keys(), name
        for key, x in left.items():
            y = right[key]
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), f"{name}{key} differs"
            elif isinstance(x, str):
                assert x.replace(str(roots[0]), "") == y.replace(str(roots[1]), ""), f"{name}{key}"
            elif hasattr(x, "__dict__") and type(x).__eq__ is object.__eq__:  # DeepSpeed's loss scaler
                assert type(x) is type(y) and vars(x) == vars(y), f"{name}{key}: {vars(x)} != {vars(y)}"
            else:
                assert x == y, f"{name}{key}: {x!r} != {y!r}"


# --- A complete run and its report -------------------------------------------------------------------


def test_complete_run_writes_the_report(runs):
    full = runs["full"]
    summary = json.loads((full / "summary.json").read_text())
    assert summary["modes"] == list(MODES)
    evals = {name: load_results(full / "eval" / f"{name}.json") for name in ("base", *MODES)}
    assert set(summary["eval"]) == set(evals)
    # One engine evaluated the base and the trained models (they share config and tokenizer): one
    # evaluation worker, so one log.
    assert [p.name for p in (full / "eval").glob("*.log")] == ["base.log"]
    for mode in MODES:
        assert summary["rl"][mode]["learner"]["steps"] == STEPS
        assert len(metrics_of(full / "rl" / mode)) == STEPS
        assert (full / "rl" / mode / "final_model" / "model.safetensors").is_file()
    # The comparison table: one row per model, the figures of its evaluation file.
    text = (full / "summary.md").read_text().splitlines()
    first = next(i for i, line in enumerate(text) if line.startswith("| "))
    table = list(itertools.takewhile(lambda x: x.startswith("|"), text[first:]))
    table = [line for line in table if not line.startswith("|---")]
    header = [c.strip() for c in table[0].strip("|").split("|")]
    assert header[0] == "model"
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in table[1:])}
    for name, res in evals.items():
        row = rows[name]
        for split, result in res.items():
            assert row[header.index(f"{split} Greedy")] == f"{100 * result.greedy_accuracy:.1f}"
            for k in TABLE_K:
                if k <= 4:
                    assert row[header.index(f"{split} P@{k}")] == f"{100 * result.pass_at_k[k]:.1f}"
            assert row[header.index(f"{split} Distinct")] == f"{result.distinct_correct:.2f}"


def test_plots_show_the_data_written_beside_them(runs, tmp_path, monkeypatch):
    """Render the report again from the run's own files, look inside the figures, and check that the
    PNGs the run wrote are those figures."""
    full = runs["full"]
    figures: dict[str, matplotlib.figure.Figure] = {}
    save = matplotlib.figure.Figure.savefig

    def keep(fig, path, *args, **kwargs):
        figures[Path(path).name] = fig
        return save(fig, path, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", keep)
    paths = RunPaths(tmp_path)
    for mode in MODES:
        (tmp_path / "rl" / mode).mkdir(parents=True)
        (tmp_path / "rl" / mode / "metrics.jsonl").write_bytes((full / "rl" / mode / "metrics.jsonl").read_bytes())
    summary = json.loads((full / "summary.json").read_text())
    summary["rl"] = {mode: result_from(r) for mode, r in summary["rl"].items()}
    eval_files = {name: full / "eval" / f"{name}.json" for name in ("base", *MODES)}
    write_report(paths, summary, eval_files)
    assert set(figures) == {"training.png", "pass_at_k.png"}

    evals = {name: load_results(f) for name, f in eval_files.items()}
    for ax in figures["pass_at_k.png"].axes:
        split = ax.get_title()
        lines_ = {line.get_label(): line for line in ax.get_lines()}
        assert set(lines_) == set(evals) and ax.get_xlabel() == "k" and ax.get_ylabel() == "Pass@k (%)"
        for name, res in evals.items():
            k = sorted(res[split].pass_at_k)
            assert list(lines_[name].get_xdata()) == k
            np.testing.assert_allclose(lines_[name].get_ydata(), [100 * res[split].pass_at_k[i] for i in k])
    assert sorted(ax.get_title() for ax in figures["pass_at_k.png"].axes) == sorted(evals["base"])

    reward_ax = next(ax for ax in figures["training.png"].axes if ax.get_title() == "reward")
    for line in reward_ax.get_lines():
        rows = metrics_of(full / "rl" / line.get_label())
        assert list(line.get_xdata()) == [r["learner/version"] for r in rows]
        assert list(line.get_ydata()) == [r["reward/mean"] for r in rows]
    assert {line.get_label() for line in reward_ax.get_lines()} == set(MODES)
    for name in figures:  # what the run wrote is what was just inspected
        assert (full / "plots" / name).read_bytes() == (tmp_path / "plots" / name).read_bytes(), name


def test_second_invocation_of_a_finished_run_redoes_nothing_and_starts_no_ray(runs):
    second, full = runs["second"], runs["full"]
    assert second.returncode == 0, second.stderr[-3000:]
    now = {p: p.stat().st_mtime_ns for p in runs["finished"]}
    assert now == runs["finished"]
    summary = json.loads((full / "summary.json").read_text())
    # No stage ran; the evaluations were read back (their files and logs unchanged, above).
    assert set(summary["stage_seconds"]) == {"evaluation"}


# --- Resume = uninterrupted ----------------------------------------------------------------------


def test_the_kill_landed_mid_rl_after_a_checkpoint(runs):
    assert runs["latest"] in ("v2", "v4", "v6", "v8") and runs["steps_at_kill"] < STEPS
    killed = runs["killed"] / "rl" / MODES[1]
    # Resumed from that checkpoint, not started over (which would have rewritten it).
    assert (killed / "checkpoints" / runs["latest"] / MODEL_STATES).stat().st_mtime_ns == runs["checkpoint_mtime"]


def test_resumed_run_equals_the_uninterrupted_run(runs):
    full, killed = runs["full"] / "rl" / MODES[1], runs["killed"] / "rl" / MODES[1]
    assert lines(full / "consumed.jsonl") == lines(killed / "consumed.jsonl")
    assert len(lines(full / "consumed.jsonl")) == STEPS
    assert metrics_of(full) == metrics_of(killed)  # every loss, reward and diagnostic, bitwise
    a = load_file(full / "final_model" / "model.safetensors")
    b = load_file(killed / "final_model" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"final weights differ at {name}"
    # Model and optimizer state (AdamW moments, step counts) of the last checkpoint.
    assert_same_checkpoint(full / "checkpoints" / f"v{STEPS}", killed / "checkpoints" / f"v{STEPS}",
                           (runs["full"], runs["killed"]))


def test_the_second_mode_ran_on_the_first_modes_kept_processes(runs):
    """launcher.reuse_actors and reuse_learner: in the full run js_low_var's actor was grpo's process,
    its engine reset to pi_0, and its learner was grpo's process, with a trainer of its own; the killed
    run's js_low_var began in new processes. That both gave the same run bit for bit (the test above:
    metrics, weights, optimizer state) shows a kept process computes what a new one does."""
    pids = {mode: json.loads((runs["full"] / "rl" / mode / "result.json").read_text())["pids"] for mode in MODES}
    assert pids[MODES[0]] == pids[MODES[1]]


# --- Behaviour log-probs are the learner's ---------------------------------------------------------


def learner_model(run: Path, mode: str, version: int) -> torch.nn.Module:
    """The learner's weights at `version`: pi_0, a checkpoint, or the final model."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(run / "base_model", dtype=torch.float32).eval()
    if version:
        model.load_state_dict(checkpoint_weights(run / "rl" / mode / "checkpoints" / f"v{version}"))
    return model


def learner_logprobs(model: torch.nn.Module, units: list[list], kind: str,
                     temperature: float = 1.0) -> dict[int, np.ndarray]:
    """The learner's per-token log-probs of every sequence (by id) at `temperature`, packed as the
    learner packs them: a group's completions share their prompt's row."""
    from dph_async.learner.batching import pack
    from dph_async.learner.logprobs import response_logprobs

    out: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for mb in pack(units, kind, 4096, 0):
            logp, _ = response_logprobs(model, mb, temperature)
            for row, s in enumerate(mb.sequences):
                out[id(s)] = logp[row][mb.mask[row]].double().numpy()
    return out


def worst_gap(model: torch.nn.Module, units: list[list], kind: str, temperature: float = 1.0) -> float:
    """max |learner - recorded| log-prob over every token of the units."""
    mine = learner_logprobs(model, units, kind, temperature)
    return max(float(np.abs(mine[id(s)] - s.old_logprobs).max()) for u in units for s in u)


def test_behaviour_logprobs_are_the_learners_at_the_stamped_version(runs):
    from dph_async.learner.batching import Sequence
    from dph_async.replay.wal import IngestRecord, WriteAheadLog

    run, mode = runs["full"], MODES[1]
    rl_dir = run / "rl" / mode
    groups = [g for r in WriteAheadLog(rl_dir / "replay_wal").records() if isinstance(r, IngestRecord)
              for g in r.groups]
    consumed = {(a, s): step["version"] for step in map(json.loads, lines(rl_dir / "consumed.jsonl"))
                for a, s, *_ in step["groups"]}
    assert consumed.keys() <= {g.group_id for g in groups}
    by_version: dict[int, list[list[Sequence]]] = {}
    for g in groups:
        versions = {int(v) for c in g.completions for v in c.versions}
        assert len(versions) == 1, f"group {g.group_id}: tokens of several versions in sync mode: {versions}"
        (v,) = versions
        assert consumed.get(g.group_id, v) == v  # trained on at the version that generated it
        by_version.setdefault(v, []).append(
            [Sequence(g.prompt_ids, c.token_ids, c.logprobs) for c in g.completions if len(c.token_ids)])
    checked = [v for v in by_version if v % 2 == 0]  # versions with learner weights on disk
    assert {0, 2, 4} <= set(checked)
    worst = max(worst_gap(learner_model(run, mode, v), by_version[v], "fresh") for v in checked)
    assert worst < LOGPROB_TOL, f"behaviour and learner log-probs differ by up to {worst:.2e}"
    # The check can fail: the weights of another version are far outside the tolerance.
    last = max(checked)
    drift = worst_gap(learner_model(run, mode, 0), by_version[last], "fresh")
    assert drift > 10 * LOGPROB_TOL, f"versions 0 and {last} differ by only {drift:.2e}: the check is blind"


def test_reference_logprobs_are_the_learners_at_step_0(runs):
    from dph_async.learner.batching import Sequence

    run = runs["full"]
    pool = pq.read_table(run / "presample" / "reference_pool.parquet").to_pylist()
    assert pool
    units = [[Sequence(np.asarray(r["prompt_ids"]), np.asarray(r["response_ids"]),
                       np.asarray(r["ref_logprobs"], np.float32))] for r in pool]
    worst = worst_gap(learner_model(run, MODES[1], 0), units, "reference")
    assert worst < 1e-5, worst
    # In the run: the divergence on reference tokens is zero at the first step (weights of version 0).
    first = metrics_of(run / "rl" / MODES[1])[0]
    assert first["batch/reference_samples"] > 0
    assert abs(first["loss/divergence_ref"]) < 1e-6


# --- Ctrl-C ------------------------------------------------------------------------------------------


def shm_files_of(pids: list[int]) -> set[str]:
    """The /dev/shm files these processes have open or mapped: the shared memory this run made."""
    names = set()
    for pid in pids:
        try:
            paths = [line.split(maxsplit=5)[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()]
            paths += [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:  # gone meanwhile, or not ours to read
            continue
        names |= {p.removeprefix("/dev/shm/").removesuffix(" (deleted)") for p in paths if p.startswith("/dev/shm/")}
    return names


def test_ctrl_c_during_rl_stops_everything(small_base, tmp_path: Path):
    out = tmp_path / "out"
    copy_base(small_base, out)
    with (tmp_path / "run.log").open("w") as log:  # the child keeps its own copy of the descriptor
        # A session of its own, like a terminal's foreground job; SIGINT handled by default even where
        # the test runner was started with it ignored (background jobs of a non-interactive shell).
        proc = subprocess.Popen(
            [sys.executable, "-m", "dph_async.cli.main", "run", "--output", str(out),
             *SMALL, "learner.steps=100000", "learner.checkpoint_every=10"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    ours: set[str] = set()
    try:
        deadline = time.time() + 600
        while sum(len(lines(m)) for m in out.glob("rl/*/metrics.jsonl")) < 3:  # the learner is training
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.time() < deadline, "RL did not start"
            time.sleep(0.2)
        members = session_members(proc.pid)
        assert len(members) > 3, members  # the check below sees the run's processes
        ours = shm_files_of([int(m.split()[0]) for m in members])
        # The learner's weight slots at least (one host: shared memory by default); none seen would
        # make the check below pass whatever the run leaves behind.
        assert any(name.startswith(SHM_PREFIX) for name in ours), ours
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    wait_gone(proc.pid, timeout_s=10)
    assert ours & set(os.listdir("/dev/shm")) == set(), "shared memory of the run left behind"
    assert "interrupted" in (tmp_path / "run.log").read_text()


# --- A run that fails ---------------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _listening() -> dict[int, str]:
    """Socket inode -> address of every listening TCP and Unix socket on this machine."""
    found = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    found[int(fields[9])] = f"{table} {fields[1]}"
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if int(fields[3], 16) & 0x10000:  # __SO_ACCEPTCON: listening
                found[int(fields[6])] = f"unix {fields[7] if len(fields) > 7 else '(unnamed)'}"
    return found


class Footprint:
    """Everything a run holds at any moment it is sampled: its processes (the driver's descendants,
    with their start times, so that a reused pid is not mistaken for one of them), the /dev/shm files
    they map or hold open, and the sockets they listen on."""

    def __init__(self) -> None:
        self.processes: dict[int, tuple[str, str]] = {}  # pid -> (start time, command line)
        self.shm: set[str] = set()
        self.listening: dict[int, str] = {}

    def sample(self, driver: int) -> None:
        table = processes()
        pids = [driver, *descendants(driver, table)]
        for pid in pids:
            if (start := _start_time(pid)) is not None:
                self.processes.setdefault(pid, (start, table.get(pid, (0, ""))[1]))
        self.shm |= shm_files_of(pids)
        listening = _listening()
        for pid in pids:
            with contextlib.suppress(OSError):
                for fd in Path(f"/proc/{pid}/fd").iterdir():
                    link = os.readlink(fd)
                    if link.startswith("socket:[") and (inode := int(link[8:-1])) in listening:
                        self.listening[inode] = listening[inode]

    def left(self) -> list[str]:
        return [f"{pid} {cmd[:120]}" for pid, (start, cmd) in self.processes.items() if _start_time(pid) == start]


def _fail_learner(how: str, rl_dir: Path) -> None:
    """Make the training learner of `rl_dir` fail: "raises" puts a file where its checkpoints go (its
    next checkpoint raises), "killed" SIGKILLs its process (as the OOM killer would)."""
    if how == "raises":
        shutil.rmtree(rl_dir / "checkpoints", ignore_errors=True)
        (rl_dir / "checkpoints").write_text("in the way of the learner's checkpoints\n")
    else:
        os.kill(json.loads((rl_dir / "endpoints" / "learner.json").read_text())["pid"], signal.SIGKILL)


@pytest.mark.parametrize("how", ["raises", "killed"])
def test_a_run_that_fails_midway_leaves_no_process_socket_or_shared_memory(small_base, tmp_path: Path, how: str):
    """The learner fails once it trains: it raises at its first checkpoint (after step CHECKPOINT), or
    its process is killed. The command fails, and nothing of the run is left: no process, no listening
    socket, no /dev/shm segment."""
    out = tmp_path / "out"
    copy_base(small_base, out)
    checkpoint = 60  # steps: seconds of training to place the file first, at the rate of a loaded machine too
    with (tmp_path / "run.log").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "dph_async.cli.main", "run", "--output", str(out), *SMALL,
                                 "learner.steps=100000", f"learner.checkpoint_every={checkpoint}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    footprint, failed = Footprint(), None
    try:
        deadline = time.time() + 900
        while proc.poll() is None:  # everything the run holds, from its start to its end
            footprint.sample(proc.pid)
            if failed is None and (trained := [m.parent for m in out.glob("rl/*/metrics.jsonl") if lines(m)]):
                failed = trained[0]
                _fail_learner(how, failed)
            assert time.time() < deadline, "the run neither failed nor ended"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    output = (tmp_path / "run.log").read_text()
    assert proc.returncode not in (0, None), output[-3000:]
    assert failed is not None and len(lines(failed / "metrics.jsonl")) < 2 * checkpoint, output[-3000:]
    if how == "raises":  # the learner's error reached the user
        assert len(lines(failed / "metrics.jsonl")) == checkpoint and "snapshot failed" in output, output[-3000:]
    assert len(footprint.processes) > 3 and footprint.listening, "the samples did not see the run's processes"
    deadline = time.time() + 60
    while (left := footprint.left()) and time.time() < deadline:  # a killed process's children take a moment
        time.sleep(0.2)
    assert not left, f"processes of the failed run still alive: {left}"
    assert footprint.shm & set(os.listdir("/dev/shm")) == set(), "shared memory of the run left behind"
    still = {inode: address for inode, address in _listening().items() if inode in footprint.listening}
    assert not still, f"sockets of the failed run still listening: {still}"
