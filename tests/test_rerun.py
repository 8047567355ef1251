"""The learner's recording, `dph-async rerun` and the auto staleness controller, in this process.

The learner loop runs for real (trainer, DeepSpeed, weight server, recording, checkpoints) on a tiny
model; only its replay is a stand-in that serves synthetic groups, so a test decides how stale their
behaviour log-probs are. What that proves:
- the recording reads back exactly what was written, and damage is refused with file and offset;
- a rerun of the loop's steps is the loop, bit for bit (metrics and weights); a counterfactual with
  another coefficient trains other weights from the same batches; --diagnose decomposes a step;
- the controller raises eta while the effective sample size is healthy and the data reaches the
  bound, and halves it when the data is made stale on purpose, telling the replay each time.
(The same rerun of a real asynchronous run: tests/test_rerun_run.py.)
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, save_tiny_llama

from dph_async.config import RunConfig, load_config
from dph_async.learner.recording import RECORDING, BatchRecorder, RecordingError, read_batches, write_run_info
from dph_async.learner.staleness_control import StalenessController, StalenessRule
from dph_async.net import NetSecurity
from dph_async.paths import checkpoint_dir
from dph_async.protocol import Batch, Completion, ReferenceSample, RolloutGroup, SamplingInfo
from dph_async.rewards.result import RewardResult

VOCAB = 16  # the tiny model's (conftest.TINY_VLLM_CONFIG)
LEARNER = ["learner.zero_stage=0", "learner.micro_token_budget=256", "learner.lr=3e-3", "learner.keep_checkpoints=0",
           "sampling.max_tokens=6", "learner.loss.objective=js_low_var", "learner.loss.coeff=0.1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions"))
    return save_tiny_llama(tmp_path_factory.mktemp("model"), seed=3)


def group(rng: np.random.Generator, seq: int, version: int, logprobs=None) -> RolloutGroup:
    """4 completions of one prompt; behaviour log-probs from `logprobs(prompt, response)` or random."""
    prompt = rng.integers(3, VOCAB, size=4).astype(np.int32)
    comps = []
    for i in range(4):
        ids = rng.integers(3, VOCAB, size=int(rng.integers(2, 6))).astype(np.int32)
        lp = logprobs(prompt, ids) if logprobs else -rng.random(len(ids)).astype(np.float32) - 0.5
        comps.append(Completion(ids, lp.astype(np.float32), np.full(len(ids), version, np.int32),
                                RewardResult(float(i % 2), bool(i % 2)), "stop"))
    return RolloutGroup(0, seq, f"p{seq}", "digits", prompt, comps, SamplingInfo(1.0, 1.0, -1, 6), 0.0, 0.0)


def reference(rng: np.random.Generator, i: int) -> ReferenceSample:
    ids = rng.integers(3, VOCAB, size=3).astype(np.int32)
    return ReferenceSample(f"r{i}", rng.integers(3, VOCAB, size=4).astype(np.int32), ids,
                           -rng.random(3).astype(np.float32) - 0.2, 1.0, "pi0")


class StandInReplay:
    """What the loop asks of the replay, serving synthetic groups: each batch's groups made with the
    tokens' versions `eta` behind the learner (so the data reaches the bound), their behaviour
    log-probs from `behaviour` (None: random)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.seq, self.eta, self.told = 0, 1, []
        self.behaviour = None

    def get_batch(self, version: int, num_groups: int, wait_s: float) -> Batch:
        groups = []
        for _ in range(num_groups):
            groups.append(group(self.rng, self.seq, max(0, version - self.eta), self.behaviour))
            self.seq += 1
        refs = [reference(self.rng, self.seq * 10 + i) for i in range(2)]
        # A learner that waits a third of its time for data, so a healthy bound may grow.
        return Batch(version, groups, refs, {"stale": version // 3}, waited_s=0.05, cycle_s=0.1)

    def snapshot(self, path: str, version: int = -1) -> str:
        return "snapshot"

    def set_staleness(self, eta: int) -> str:
        self.eta = eta
        self.told.append(eta)
        return f"max_staleness -> {eta}"


def run_loop(cfg: RunConfig, model_dir: Path, rl_dir: Path, replay: StandInReplay, setup=None):
    """LearnerLoop.run as the learner process runs it, then the final model, as the launcher saves it."""
    from dph_async.learner.loop import LearnerLoop
    from dph_async.learner.publish import WeightServer
    from dph_async.runtime.learner_trainer import build_trainer

    rl_dir.mkdir(parents=True, exist_ok=True)
    trainer, tokenizer = build_trainer(cfg, str(model_dir), None)
    server = WeightServer("tcp://127.0.0.1:0", NetSecurity(), 32 << 20, "tcp")
    try:
        write_run_info(rl_dir, cfg, model_dir)
        loop = LearnerLoop(cfg, trainer, replay, server, rl_dir)
        if setup is not None:
            setup(loop)
        stats = loop.run(threading.Event())
        trainer.save_pretrained(str(rl_dir / "final_model"))
        tokenizer.save_pretrained(str(rl_dir / "final_model"))
        return stats
    finally:
        server.close()
        trainer.close()


# --- The recording -----------------------------------------------------------------------------------


def batches(n: int, seed: int = 0) -> list[Batch]:
    rng = np.random.default_rng(seed)
    return [Batch(v, [group(rng, 2 * v + i, v) for i in range(2)], [reference(rng, v)], {"stale": v})
            for v in range(n)]


def arrays(b: Batch) -> list[np.ndarray]:
    items = (*b.groups, *(c for g in b.groups for c in g.completions), *b.reference)
    return [getattr(item, name) for item in items for name, _ in item.ARRAYS]


def same_batch(a: Batch, b: Batch) -> bool:
    ids = lambda x: (x.version, x.drops, [g.group_id for g in x.groups], [r.sample_id for r in x.reference])  # noqa: E731
    return ids(a) == ids(b) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                    for x, y in zip(arrays(a), arrays(b), strict=True))


def test_the_recording_reads_back_what_was_written_and_a_resume_keeps_the_steps_before_its_checkpoint(tmp_path):
    path = tmp_path / RECORDING
    written = batches(5)
    recorder = BatchRecorder(path)
    for b in written:
        recorder.append(b)
    recorder.close()
    got = [b for _, b in read_batches(path)]
    assert len(got) == 5 and all(same_batch(a, b) for a, b in zip(written, got, strict=True))
    # Resumed from the checkpoint after step 3: steps 3 and 4 are trained (and recorded) again.
    BatchRecorder(path, keep=3).close()
    assert [b.version for _, b in read_batches(path)] == [0, 1, 2]
    # A file holding fewer steps than the checkpoint (recording was off): it starts anew.
    BatchRecorder(path, keep=7).close()
    assert list(read_batches(path)) == []


@pytest.mark.parametrize("damage", ["flip", "cut", "magic", "length"])
def test_a_damaged_recording_is_refused_with_file_and_offset(tmp_path, damage):
    path = tmp_path / RECORDING
    recorder = BatchRecorder(path)
    for b in batches(3):
        recorder.append(b)
    recorder.close()
    offsets = [o for o, _ in read_batches(path)]
    data = bytearray(path.read_bytes())
    if damage == "flip":  # a byte inside the second record's payload
        data[offsets[1] + 40] ^= 0x01
        expect = f"record at byte {offsets[1]} fails its checksum"
    elif damage == "cut":  # a write cut short at the end
        data = data[:offsets[2] + 30]
        expect = f"record at byte {offsets[2]} cut short"
    elif damage == "magic":
        data[0:8] = b"NOTAREC!"
        expect = "not a batch recording"
    else:  # a length past the end of the file: refused before anything is read
        data[offsets[1]:offsets[1] + 8] = (1 << 60).to_bytes(8, "little")
        expect = f"record at byte {offsets[1]} cut short"
    path.write_bytes(bytes(data))
    with pytest.raises(RecordingError) as e:
        list(read_batches(path))
    assert str(path) in str(e.value) and expect in str(e.value)


def test_a_checksummed_record_that_is_no_batch_is_refused(tmp_path):
    import struct
    import zlib

    path = tmp_path / RECORDING
    payload = struct.pack("<IQ", 1, 3) + b"abc"  # one frame, not a message
    path.write_bytes(b"DPHREC01" + struct.pack("<QI", len(payload), zlib.crc32(payload)) + payload)
    with pytest.raises(RecordingError, match=rf"{path}: record at byte 8: not a batch"):
        list(read_batches(path))


# --- Rerun ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def recorded(model_dir, tmp_path_factory) -> Path:
    """A loop's run of 6 steps, checkpoints every 2, auto staleness on (its decisions are metrics too)."""
    rl_dir = tmp_path_factory.mktemp("run") / "rl" / "js_low_var"
    cfg = load_config("default", [*LEARNER, "learner.steps=6", "learner.checkpoint_every=2",
                                  "replay.max_staleness=auto", "replay.staleness_window=2"])
    run_loop(cfg, model_dir, rl_dir, StandInReplay())
    return rl_dir


def test_a_rerun_is_the_run_bit_for_bit(recorded, tmp_path):
    from dph_async.pipeline.rerun import rerun

    report = rerun(recorded, tmp_path / "same", [])
    assert not report.counterfactual and report.end == 6 and len(report.steps) == 6
    assert report.metrics_equal, report.first_difference
    assert [w.what for w in report.weights] == ["checkpoint v2", "checkpoint v4", "checkpoint v6", "final model"]
    assert all(w.equal and w.distance == 0 for w in report.weights)
    assert report.bitwise
    rows = [json.loads(x) for x in (tmp_path / "same" / "metrics.jsonl").read_text().splitlines()]
    assert {"staleness/eta", "drops/stale", "loss/total"} <= rows[-1].keys()
    # A clock's figure, yet the rerun's own: the batches carry the replay's timings (auto steers by it).
    run = [json.loads(x) for x in (recorded / "metrics.jsonl").read_text().splitlines()]
    assert [r["time/data_wait"] for r in rows] == [r["time/data_wait"] for r in run] != [0.0] * 6
    assert "bitwise the run" in (tmp_path / "same" / "report.md").read_text()


def test_a_rerun_from_a_checkpoint_until_a_step_is_the_run_there(recorded, tmp_path):
    from dph_async.pipeline.rerun import rerun

    report = rerun(recorded, tmp_path / "mid", [], start=2, until=4)
    assert (report.start, report.end, report.stopped) == (2, 4, "--until 4")
    assert [s.version for s in report.steps] == [3, 4] and report.bitwise


def test_a_counterfactual_coefficient_trains_other_weights_from_the_same_batches(recorded, tmp_path):
    from dph_async.pipeline.rerun import rerun

    out = tmp_path / "cf"
    report = rerun(recorded, out, ["learner.loss.coeff=2.0"], diagnose=3, top_tokens=5)
    assert report.counterfactual and report.end == 6
    # The same batches (reward and batch composition are data, not learner), another learner.
    assert all("reward/mean" not in s.differing and "batch/fresh_tokens" not in s.differing for s in report.steps)
    assert any("loss/total" in s.differing for s in report.steps)
    assert all(not w.equal and w.distance > 0 for w in report.weights)
    assert (out / "final_model" / "config.json").is_file()
    assert "Per step: run / counterfactual" in (out / "report.md").read_text()
    diag = json.loads((out / "diagnose_v3.json").read_text())
    assert diag["version"] == 3 and [p["part"] for p in diag["parts"]][-1] == "reference"
    # The contributions are a decomposition: they add up to the gradient's norm.
    assert sum(p["contribution"] for p in diag["parts"]) == pytest.approx(diag["grad_norm"], rel=1e-6)
    weights = [t["weight"] for t in diag["top_tokens"]]
    assert len(weights) == 5 and weights == sorted(weights, reverse=True)


def test_a_rerun_refuses_what_it_cannot_do(recorded, tmp_path):
    from dph_async.cli.commands.rerun import override_problem
    from dph_async.pipeline.rerun import RerunError, rerun

    with pytest.raises(RerunError, match="no checkpoint of version 3"):
        rerun(recorded, tmp_path / "x", [], start=3)
    assert "only the learner" in override_problem(["replay.max_staleness=4"])
    assert "no effect on a rerun" in override_problem(["learner.groups_per_step=8"])
    assert override_problem(["learner.lr=1e-3", "learner.loss.correction=masked"]) is None


def test_a_rerun_writes_through_no_link_planted_in_its_output(recorded, tmp_path):
    """A stranger's run may hold rerun/<label>/metrics.jsonl -> ~/.bashrc, or final_model -> elsewhere."""
    from dph_async.pipeline.rerun import rerun
    from dph_async.safe_files import UnsafeFile

    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "planted"
    out.mkdir()
    (out / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UnsafeFile, match=r"metrics\.jsonl: a symbolic link, not followed"):
        rerun(recorded, out, [], until=1)
    (out / "metrics.jsonl").unlink()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "final_model").symlink_to(elsewhere)
    with pytest.raises(UnsafeFile, match="final_model: a symbolic link, where the rerun's final model belongs"):
        rerun(recorded, out, ["learner.loss.coeff=2.0"], until=1)
    assert victim.read_text() == "precious" and not any(elsewhere.iterdir())
    assert [p.name for p in out.iterdir() if p.name.startswith(".final_model")] == []  # nothing left half-written


# --- Auto staleness -------------------------------------------------------------------------------------


def rule(**kw) -> StalenessRule:
    return StalenessRule(**({"minimum": 1, "maximum": 6, "target": 0.9, "window": 2, "min_wait": 0.05} | kw))


def step(ess: float, staleness: int, wait: float = 0.2) -> dict[str, float]:
    """One step's metrics: its ESS, the staleness its data reached, the fraction it waited for data."""
    return {"policy/ess": ess, "staleness/max": float(staleness), "time/data_wait": wait}


def test_the_controller_doubles_until_a_window_is_unhealthy_then_halves_waits_and_adds_one():
    c = StalenessController(rule(maximum=8))
    assert c.eta == 1
    decisions = [c.observe(step(0.99, c.eta)) for _ in range(8)]
    assert [d.eta for d in decisions] == [1, 2, 2, 4, 4, 8, 8, 8]  # slow start: doubled, to the maximum
    assert [d.change for d in decisions if d.signal is not None] == [1, 2, 4, 0]
    # Healthy, but the data never got as stale as the bound: the window says nothing about eta.
    assert c.observe(step(0.99, 2)).signal is None and c.observe(step(0.99, 2)).change == 0 and c.eta == 8
    # Below the target: halved at the window's end; slow start is over.
    c.observe(step(0.5, 8))
    d = c.observe(step(0.7, 8))
    assert (d.eta, d.change, d.signal, c.slow_start, c.hold) == (4, -4, pytest.approx(0.6), False, 8)
    # The groups admitted under eta = 8 are consumed during the next 8 steps: no window counts them.
    assert all(c.observe(step(0.1, 8)).signal is None for _ in range(8)) and c.window == [] and c.eta == 4
    # Then healthy at the new bound: one more, not twice as many.
    c.observe(step(0.99, 4))
    assert c.observe(step(0.99, 4)).change == 1 and c.eta == 5
    c.observe(step(0.1, 5))
    assert c.observe(step(0.1, 5)).eta == 2 and c.hold == 5
    for _ in range(5 + 1):
        c.observe(step(0.1, 2))
    assert c.observe(step(0.1, 2)).eta == 1 and c.hold == 2
    # At the minimum an unhealthy window changes nothing and starts no wait.
    for _ in range(2):
        c.observe(step(0.1, 1))
    c.observe(step(0.1, 1))
    assert c.observe(step(0.1, 1)).change == 0 and (c.eta, c.hold) == (1, 0)
    # Never above the maximum; steps without fresh tokens (no ESS) do not count.
    c = StalenessController(rule(maximum=2), eta=2)
    for _ in range(4):
        c.observe(step(1.0, 2))
        c.observe({"staleness/max": 2.0})
    assert c.eta == 2 and c.window == []


def test_the_controller_raises_the_bound_only_while_the_learner_waits_for_data():
    """Healthy data as stale as the bound, but a learner that no longer waits: a higher bound would buy
    nothing, so eta stays; a window that waited (its mean at least min_wait) raises it again."""
    c = StalenessController(rule(maximum=8))
    c.observe(step(0.99, 1, wait=0.3))
    assert c.observe(step(0.99, 1, wait=0.3)).eta == 2
    for _ in range(3):
        c.observe(step(0.99, 2, wait=0.0))
        d = c.observe(step(0.99, 2, wait=0.09))  # window mean 0.045 < 0.05
        assert (d.eta, d.change, d.wait) == (2, 0, pytest.approx(0.045))
    assert d.metrics()["staleness/wait"] == pytest.approx(0.045)
    c.observe(step(0.99, 2, wait=0.0))
    assert c.observe(step(0.99, 2, wait=0.1)).eta == 4  # mean 0.05: still slow start, doubled
    # Waiting, but the data stayed fresher than the bound: the actors, not the bound, are the limit.
    c.observe(step(0.99, 3, wait=0.5))
    assert c.observe(step(0.99, 3, wait=0.5)).change == 0 and c.eta == 4
    # Unhealthy data lowers the bound whether or not the learner waits.
    c.observe(step(0.5, 4, wait=0.0))
    assert c.observe(step(0.5, 4, wait=0.0)).eta == 2
    # Steps without fresh tokens carry no wait into the window either.
    c = StalenessController(rule(), eta=2)
    c.observe({"staleness/max": 2.0, "time/data_wait": 0.9})
    assert c.waits == [] and c.window == []


def test_the_controller_state_survives_a_checkpoint_within_the_limits():
    c = StalenessController(rule(), eta=4)
    c.observe(step(0.95, 4, wait=0.07))
    again = StalenessController.from_state(rule(), json.loads(json.dumps(c.state())))
    assert (again.eta, again.window, again.reached, again.slow_start, again.hold) == (4, [0.95], 4, True, 0)
    assert again.waits == [0.07]
    assert again.observe(step(0.97, 4)).eta == 6 == c.observe(step(0.97, 4)).eta
    assert StalenessController.from_state(rule(maximum=3), c.state()).eta == 3
    c.observe(step(0.1, 6))
    c.observe(step(0.1, 6))
    again = StalenessController.from_state(rule(), json.loads(json.dumps(c.state())))
    assert (again.eta, again.slow_start, again.hold) == (3, False, 6)
    # A checkpoint from before slow start, the hold and the data wait existed: additive increase, no
    # hold, and the window's steps so far count as not waiting.
    old = StalenessController.from_state(rule(), {"eta": 2, "window": [0.99], "reached": 2})
    assert (old.slow_start, old.hold, old.waits) == (False, 0, [0.0])
    assert old.observe(step(0.99, 2, wait=0.08)).eta == 2  # window mean wait 0.04 < 0.05


def behaviour_of(trainer):
    """Behaviour log-probs of the learner's own current weights (temperature 1): on-policy data."""

    def logprobs(prompt: np.ndarray, response: np.ndarray) -> np.ndarray:
        ids = torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64))[None]
        with torch.no_grad():
            logits = trainer.module(input_ids=ids).logits.float()[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0].numpy()

    return logprobs


def test_auto_staleness_rises_on_healthy_data_and_falls_when_it_is_made_stale(model_dir, tmp_path):
    """12 steps on data the learner's own weights made (ESS ~1, at the bound's staleness), then 12 on
    behaviour log-probs far from them (ESS well below the target): eta doubles 1 -> 6 (the maximum)
    a window at a time, then halves, waits out the 6 steps of data admitted under 6, and halves to
    the minimum; each decision reaches the replay."""
    cfg = load_config("default", [*LEARNER, "learner.steps=24", "learner.checkpoint_every=0",
                                  "replay.max_staleness=auto", "replay.staleness_window=3",
                                  "replay.staleness_target_ess=0.9", "replay.staleness_max=6"])
    replay = StandInReplay(seed=1)
    noise = np.random.default_rng(7)

    def setup(loop) -> None:
        own = behaviour_of(loop.trainer)
        collect = loop._collect

        def collect_and_steer(stop):
            # Healthy until version 12, then behaviour policies far from the learner's.
            stale = loop.trainer.version >= 12
            replay.behaviour = (lambda p, r: np.minimum(own(p, r) + noise.normal(0, 2.0, len(r)), 0.0)) if stale \
                else own
            return collect(stop)

        loop._collect = collect_and_steer

    stats = run_loop(cfg, model_dir, tmp_path / "rl", replay, setup)
    rows = [json.loads(x) for x in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    signals = [(int(r["learner/version"]), r["staleness/signal"], int(r["staleness/eta"])) for r in rows
               if "staleness/signal" in r]
    assert [(v, eta) for v, _, eta in signals] == [(3, 2), (6, 4), (9, 6), (12, 6), (15, 3), (24, 1)], signals
    assert all(s >= 0.9 for v, s, _ in signals if v <= 12) and all(s < 0.9 for v, s, _ in signals if v > 12)
    assert replay.told == [2, 4, 6, 6, 3, 1]
    assert all(r["time/data_wait"] == pytest.approx(1 / 3) for r in rows)  # as the batches reported it
    changes = [(int(r["staleness/eta"]), round(r["staleness/signal"], 6)) for r in rows if r.get("staleness/change")]
    assert [(eta, round(s, 6)) for _, eta, s, _ in stats.staleness] == changes and len(changes) == 5
    assert all(wait == pytest.approx(1 / 3) for *_, wait in stats.staleness)
    # Admission's data followed the bound: each batch's groups were as stale as the eta in force.
    assert [int(r["staleness/max"]) for r in rows][:7] == [0, 1, 1, 2, 2, 2, 4], rows


def test_a_resumed_loop_tells_the_replay_its_bound_and_keeps_the_recording_before_its_checkpoint(model_dir, tmp_path):
    """Killed after its checkpoint at 4 and resumed: the controller's state comes back from the
    checkpoint, the replay is told its bound, and the recording holds steps 0-3 once."""
    cfg = load_config("default", [*LEARNER, "learner.steps=6", "learner.checkpoint_every=4",
                                  "replay.max_staleness=auto", "replay.staleness_window=2"])
    rl_dir = tmp_path / "rl"
    first = StandInReplay(seed=2)
    run_loop(cfg, model_dir, rl_dir, first)
    resumed = StandInReplay(seed=2)
    restored: list[str] = []
    resumed.restore = lambda path: restored.append(path) or "restored"
    run_loop(cfg, model_dir, rl_dir, resumed, setup=lambda loop: loop.resume("v4"))
    # The replay goes back to its snapshot of that checkpoint (an end-to-end resume one step past a
    # checkpoint cannot tell: the replay serves that step again as its pending batch).
    assert restored == [str((checkpoint_dir(rl_dir) / "v4" / "replay").resolve())]
    assert resumed.told[0] == first.told[1]  # the bound decided at step 4, from the checkpoint
    assert [b.version for _, b in read_batches(rl_dir / RECORDING)] == list(range(6))
    assert len((rl_dir / "metrics.jsonl").read_text().splitlines()) == 6


@pytest.mark.parametrize("model", ["missing", "pickled"])
def test_a_recording_naming_no_usable_model_directory_is_one_error_line(tmp_path, capsys, model):
    """recording.json names the model the run started from, and a run directory may be a stranger's.
    Before: transformers' OSError traceback from inside the trainer's build, for a directory that is
    not there as for one holding only a pytorch_model.bin (never unpickled either way)."""
    from dph_async.cli.main import main
    from dph_async.config import dump_config

    rl = tmp_path / "rl" / "m"
    rl.mkdir(parents=True)
    (rl / "learner_config.yaml").write_text(dump_config(load_config("default")))
    (rl / RECORDING).write_bytes(b"")
    base = tmp_path / "base_model"
    if model == "pickled":
        base.mkdir()
        (base / "config.json").write_text("{}")
        (base / "pytorch_model.bin").write_bytes(b"\x80\x04N.")  # a pickle of None
    (rl / "recording.json").write_text(json.dumps({"config": "learner_config.yaml", "model_dir": "../../base_model",
                                                   "recording": RECORDING}))
    assert main(["rerun", str(rl)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    says = ("is not a Hugging Face model directory (no config.json)" if model == "missing"
            else "pytorch_model.bin: weights in a format other than safetensors")
    assert len(err) == 1 and err[0].startswith(f"error: {rl / 'recording.json'}: model_dir: {base}") and says in err[0]


def test_a_metrics_line_cut_short_is_one_error_naming_file_and_line(tmp_path):
    """A run killed while it wrote a step's metrics leaves half a line. Before: json's JSONDecodeError
    traceback from the rerun, after the trainer had been built."""
    from dph_async.pipeline.rerun import RerunError, _run_metrics

    (tmp_path / "metrics.jsonl").write_text('{"learner/version": 1.0}\n{"learner/version": 2.0, "loss/to\n')
    with pytest.raises(RerunError, match=rf"^{tmp_path / 'metrics.jsonl'}: line 2 is not a JSON record"):
        _run_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"learner/version": 1.0}\n')
    assert _run_metrics(tmp_path) == [{"learner/version": 1.0}]
