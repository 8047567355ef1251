"""The soak: its verdict on known series, and a 30-second soak of a small run end to end."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest
import zmq
from conftest import copy_base

from dph_async.config import load_config
from dph_async.gate import Gate
from dph_async.net import NetSecurity
from dph_async.protocol import Limits
from dph_async.tools.soak import (
    Check,
    ProcessSample,
    Sample,
    cpu_per_step,
    evaluate,
    gate_processes,
    intervals,
    run_soak,
    throughputs,
    write_report,
)

MB = 2**20
# The most a process may grow after the 30-second soak's warm-up (the learner is ~1 GB; a version of
# the embedded model's weights is ~1.5 MB, more than fifty versions in these 30 seconds).
RSS_GROWTH = 0.25


def series(rss: list[float], fds: list[int] | None = None, steps_per_interval: list[float] | None = None,
           wal_mb: float = 1.0, checkpoints: int = 2, cpu_per_step: list[float] | None = None,
           gate_restarts: list[int] | None = None, others: dict[str, list[float]] | None = None) -> list[Sample]:
    """Samples 60 s apart of the learner with these RSS values (MB), fds, learner steps and CPU-seconds
    per step over each interval, and gate restarts so far; `others`: more processes (the learner's fds
    and RSS) by their CPU-seconds per step."""
    gate_restarts = gate_restarts or [0] * len(rss)
    fds = fds or [100] * len(rss)
    steps_per_interval = steps_per_interval or [600.0] * len(rss)
    per_step = {"learner": cpu_per_step or [0.1] * len(rss), **(others or {})}
    out, version, cpu = [], 0.0, dict.fromkeys(per_step, 1.0)
    for i, (r, f, d) in enumerate(zip(rss, fds, steps_per_interval, strict=True)):
        version += d if i else 0.0
        for name, c in per_step.items():
            cpu[name] += d * c[i] if i else 0.0
        out.append(Sample(60.0 * i, {n: ProcessSample(r * MB, f, 40, cpu[n]) for n in per_step}, 4,
                          int(wal_mb * MB), checkpoints, checkpoints * MB, version, 0.0, 0.0,
                          gate_restarts=gate_restarts[i]))
    return out


def judged(samples: list[Sample], warmup_s: float = 60.0) -> list[Check]:
    cfg = load_config("default", ["replay.wal_compact_mb=4", "replay.wal_segment_mb=1", "learner.keep_checkpoints=2"])
    return evaluate(samples, warmup_s, cfg)


def verdicts(samples: list[Sample], warmup_s: float = 60.0) -> dict[str, bool]:
    return {c.name: c.ok for c in judged(samples, warmup_s)}


def test_flat_resources_pass():
    assert all(verdicts(series([900, 1000, 1010, 995, 1040])).values())  # 900 is before the warm-up ends


@pytest.mark.parametrize(("kwargs", "failing"), [
    ({"rss": [1000, 1000, 1020, 1040, 1060]}, "rss learner"),  # +6% after warm-up: a leak
    ({"rss": [1000] * 5, "fds": [100, 100, 104, 107, 109]}, "fds learner"),
    ({"rss": [1000] * 5, "steps_per_interval": [600, 600, 600, 530, 600]}, "pace"),  # a stall: -11.7%
    ({"rss": [1000] * 5, "wal_mb": 7}, "wal bytes"),  # over compact 4 + 2 segments of 1
    ({"rss": [1000] * 5, "checkpoints": 4}, "checkpoints"),  # over keep 2 + 1
    ({"rss": [1000] * 5, "gate_restarts": [0, 0, 0, 1, 1]}, "gate restarts"),
    ({"rss": [1000] * 5, "gate_restarts": [0, 1, 1, 1, 1]}, "gate restarts"),  # in the warm-up too
])
def test_each_check_fails_on_its_own(kwargs, failing):
    got = verdicts(series(**kwargs))
    assert not got[failing] and all(ok for name, ok in got.items() if name != failing), got


def test_a_slower_machine_passes_and_a_process_doing_more_per_step_fails():
    # The same work per step, one interval on a machine 25% slower: every process as busy as before
    # but 25% more CPU-s per step, 20% fewer steps. Steps/s are reported, not judged.
    slower = series([1000] * 5, steps_per_interval=[600, 600, 600, 480, 600],
                    cpu_per_step=[0.1, 0.1, 0.1, 0.125, 0.1], others={"actor0": [0.2, 0.2, 0.2, 0.25, 0.2]})
    assert [round(c, 6) for _, c in cpu_per_step(slower, "learner")] == [0.1, 0.1, 0.125, 0.1]
    checks = {c.name: c for c in judged(slower)}
    assert all(c.ok for c in checks.values()), checks
    assert "actor0 0.200-0.250 (worst +25.0% of the median); learner 0.100-0.125" in checks["pace"].detail
    assert "steps/s 8.000-10.000 (worst -20.0% of the median)" in checks["progress"].detail
    # The actor, setting the pace, does a quarter more per step on the same machine from the 9th
    # interval on: 20% fewer steps, the learner idle for them. Five such intervals fail work (spans of
    # four: a third of the 13 judged).
    steps, actor = [600] * 9 + [480] * 5, [0.2] * 9 + [0.25] * 5
    checks = {c.name: c for c in judged(series([1000] * 14, steps_per_interval=steps, others={"actor0": actor}))}
    assert not checks["work actor0"].ok and "worst +25.0% over 4 intervals" in checks["work actor0"].detail
    assert not checks["work learner"].ok  # two processes: each is the other's reference
    assert checks["pace"].ok  # -6.7%: busy as it was, but on more work
    # One or two such intervals in any five are the machine's swing and pass (a span of five: +4.2%,
    # +8.7%), the single interval's deviation still in the detail; three in five are a lasting change
    # (+13.6%).
    for n, ok in ((1, True), (2, True), (3, False)):
        steps, actor = [600] * 17, [0.2] * 17
        for i in range(10, 10 + n):  # after the first third, the reference
            steps[i], actor[i] = 480, 0.25
        check = {c.name: c for c in judged(series([1000] * 17, steps_per_interval=steps,
                                                  others={"actor0": actor}))}["work actor0"]
        assert check.ok is ok and "one interval: +25.0%" in check.detail, check
    # Twice the work every other two minutes of five, over the whole second half: each span of five
    # holds two such intervals and rises by 40%.
    actor = [0.2] * 12 + [0.4, 0.4, 0.2, 0.2, 0.2] * 3
    check = {c.name: c for c in judged(series([1000] * 27, others={"actor0": actor}))}["work actor0"]
    assert not check.ok and "worst +40.0% over 5 intervals" in check.detail, check
    # Against the first third: a lasting fifth more work over the second half shows at its full size,
    # and so does a drift to a fifth more; the same pattern all along (twice the work every other
    # minute from the start) is no change and passes. Pace held: the steps follow the actor's work.
    def work(actor: list[float]) -> Check:
        steps = [180 / (0.1 + a) for a in actor]
        return {c.name: c for c in judged(series([1000] * len(actor), steps_per_interval=steps,
                                                 others={"actor0": actor}))}["work actor0"]

    lasting = work([0.2] * 26 + [0.24] * 25)
    assert not lasting.ok and "worst +20.0% over 5" in lasting.detail
    assert not work([0.2 * (1 + 0.2 * i / 50) for i in range(51)]).ok
    assert work([0.2 if i % 2 else 0.4 for i in range(51)]).ok
    # Idle through the first third, busy since: judged a change, not divided by zero.
    idle_first = work([0.0] * 18 + [0.2] * 33)
    assert not idle_first.ok and "worst +inf%" in idle_first.detail
    # A short soak: five intervals judged, the actor tripling its work in the last two. Spans are a
    # third of the intervals (one each here), so it fails.
    check = {c.name: c for c in judged(series([1000] * 6, others={"actor0": [0.1, 0.1, 0.1, 0.1, 0.3, 0.3]}))}
    assert not check["work actor0"].ok and "over 1 interval " in check["work actor0"].detail, check
    # A process that restarted (its counter went back): its interval left out of pace and work, and
    # named by a failing check of its own.
    for s in slower[2:]:
        s.processes["learner"].cpu_seconds -= 100
    assert [round(c, 6) for _, c in cpu_per_step(slower, "learner")] == [0.1, 0.125, 0.1]
    kept, left_out = intervals(slower)
    assert [i.t for i in kept] == [60.0, 180.0, 240.0] and left_out == ["60-120 s: learner restarted"]
    assert not verdicts(slower)["intervals"]


def test_a_stall_fails_whether_the_processes_idle_or_keep_busy():
    # Three intervals without a step, the processes idle: pace falls, progress fails.
    idle = series([1000] * 8, steps_per_interval=[600, 600, 600, 0, 0, 0, 600, 600])
    got = verdicts(idle)
    assert not got["progress"] and not got["pace"], got
    # The same, the processes polling as busily as they trained: only progress sees it.
    busy = series([1000] * 8, steps_per_interval=[600, 600, 600, 60, 60, 60, 600, 600],
                  cpu_per_step=[0.1] * 3 + [1.0] * 3 + [0.1] * 2, others={"actor0": [0.2] * 3 + [2.0] * 3 + [0.2] * 2})
    got = verdicts(busy)
    assert not got["progress"] and got["pace"] and got["work actor0"], got


def test_a_process_missing_from_samples_fails_by_name_and_does_not_break_the_verdict():
    samples = series([1000] * 8, others={"actor0": [0.2] * 8, "replay gate": [0.01] * 8})
    for s in samples[5:7]:  # absent from two samples in a row
        del s.processes["actor0"]
    for s in samples[6:]:  # gone for good
        del s.processes["replay gate"]
    checks = {c.name: c for c in judged(samples)}
    assert not checks["intervals"].ok and "actor0 not sampled" in checks["intervals"].detail
    assert "replay gate not sampled" in checks["intervals"].detail
    assert checks["pace"].ok  # on the intervals where every process was sampled


def test_counters_that_never_move_fail_pace_without_dividing_by_zero():
    flat = series([1000] * 5, cpu_per_step=[0.0] * 5, others={"actor0": [0.0] * 5})
    got = verdicts(flat)
    assert not got["pace"] and "work actor0" not in got and got["progress"], got


def test_too_few_samples_after_warm_up_fail():
    assert verdicts(series([1000] * 3), warmup_s=150.0) == {"samples": False}


def test_gate_processes_are_found_under_their_service_and_named_by_it():
    ctx = zmq.Context()
    limits = Limits(4096, 4096, 0)
    # Each with its service's sockets (a gate whose link to its service closes ends).
    opened = [Gate.open(ctx, [("tcp://127.0.0.1:0", limits)] * n, NetSecurity(), 30.0, queue=4) for n in (1, 2)]
    try:
        found = gate_processes(os.getpid())
        assert set(found) == {"weights gate", "replay gate"}
        assert all(p.rss_bytes > 5 * MB and p.open_fds > 3 and p.threads >= 1 for p in found.values())
    finally:
        for gate, socks in opened:
            for sock in socks:
                sock.close(0)
            gate.close()
        ctx.destroy(linger=0)
    assert gate_processes(os.getpid()) == {}


@pytest.mark.slow
def test_a_30_second_soak(small_base, tmp_path: Path):
    """A small run trained for 30 seconds: every process sampled, training moving, checkpoints pruned to
    learner.keep_checkpoints while many were written, file descriptors, /dev/shm and the WAL bounded."""
    copy_base(small_base, tmp_path)  # its pi_0: the soak's own warm start is skipped
    cfg = load_config("default", [
        f"output_dir={tmp_path}", "learner.loss.objective=grpo", "warmstart.steps=60", "task.num_train=64",
        "task.num_test=16", "learner.groups_per_step=4", "sampling.n=4", "sampling.max_tokens=10",
        "actors.max_inflight_prompts=4", "logging.wandb_mode=disabled", "learner.steps=1000000000",
        "learner.checkpoint_every=10", "learner.keep_checkpoints=2", "replay.wal_segment_mb=1",
        "replay.wal_compact_mb=2", "actors.compile=false"])  # what is watched is the processes over time
    result = run_soak(cfg, minutes=0.5, interval_s=4.0, warmup_s=8.0)
    write_report(result, tmp_path / "soak")
    samples = result.samples
    assert len(samples) >= 7 and samples[-1].t >= 26
    actors = {f"actor{i}" for i in range(cfg.actors.num_actors)}  # the default: one per core beside the learner
    gates = {"replay gate", "weights gate"}
    assert all(set(s.processes) == {"learner", *actors, *gates} for s in samples)
    assert all(p.rss_bytes > (5 if name in gates else 100) * MB and p.open_fds > 3 and p.threads >= 1
               and p.cpu_seconds > 0 for s in samples for name, p in s.processes.items())
    versions = [s.learner_version for s in samples]
    assert versions == sorted(versions) and versions[-1] > 4 * 10  # more than 4 checkpoints were written
    assert samples[-1].actor_tokens > samples[0].actor_tokens and samples[-1].learner_tokens > 0
    checks = {c.name: c for c in result.checks}
    for name in ("checkpoints", "wal bytes", "shm files", "gate restarts", "fds learner",
                 *(f"fds {a}" for a in sorted(actors)), *(f"fds {g}" for g in sorted(gates))):
        assert checks[name].ok, checks[name]
    assert max(s.checkpoints for s in samples) <= 3
    ckpts = sorted(p.name for p in (tmp_path / "soak" / "rl" / "checkpoints").glob("v*"))
    assert len(ckpts) == 2 and max(int(n[1:]) for n in ckpts) >= int(versions[-1]) // 10 * 10
    # RSS and pace are judged by the product's tight bounds (+-5 %, +-10 %) over an hour
    # (docs/benchmarks.md); over these 30 seconds on a shared machine, by generous ones that a leak of
    # a weights version per step, or a stall, still breaks: after the warm-up no process grows by
    # more than RSS_GROWTH, and no interval trains at under a third of the median rate.
    assert {"rss learner", "pace", "work learner"} <= set(checks)
    after = [s for s in samples if s.t >= 8.0]
    for name in after[0].processes:
        rss = [s.processes[name].rss_bytes for s in after]
        assert max(rss) <= (1 + RSS_GROWTH) * rss[0], (name, [round(r / MB) for r in rss])
    rates = [rate for _, rate in throughputs(after)]
    assert len(rates) >= 4 and min(rates) > statistics.median(rates) / 3, rates
    report = json.loads((tmp_path / "soak" / "soak.json").read_text())
    assert len(report["samples"]) == len(samples) and report["checks"]
    assert (tmp_path / "soak" / "soak.png").stat().st_size > 10_000
    assert "| checkpoints | ok |" in (tmp_path / "soak" / "soak.md").read_text()
