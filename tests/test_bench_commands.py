"""The benchmarks run, at a tiny size: `dph-async bench` (sync against async with the real processes),
`dph-async bench tta` (async and sync to a target), `dph-async bench transport` and `dph-async bench
gemm`, checking the fields of the JSON they write and
that the figures in it agree with each other and with the runs' own records (the arithmetic alone is
tests/test_bench_*.py)."""

from __future__ import annotations

import json

import pytest
from conftest import SMALL, copy_base

from dph_async.cli.main import main
from dph_async.tools.bench.figures import RunFigures, WeightSync
from dph_async.tools.bench.pipeline import Comparison
from dph_async.tools.bench.timeline import ideal_speedup
from dph_async.tools.bench.transport import synthetic_group
from dph_async.tools.bench.tta_data import load

pytestmark = pytest.mark.slow

STEPS, SKIP = 8, 2


@pytest.fixture(scope="module")
def pipeline_bench(small_base, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "pipeline"
    copy_base(small_base, out)  # warm start and pre-sampling are not what is measured
    sets = [x for item in SMALL for x in ("--set", item)]
    assert main(["bench", "--out", str(out), "--steps", str(STEPS), "--skip", str(SKIP), *sets]) == 0
    return out


def test_pipeline_bench_json(pipeline_bench):
    out = pipeline_bench
    res = json.loads((out / "bench.json").read_text())
    assert set(res) == {"date", "machine", "config", "skip", "runs", "comparison", "pairs", "scaling",
                        "stage_seconds"}
    assert res["skip"] == SKIP and res["config"]["learner"]["steps"] == STEPS
    assert {"cpu", "cores", "load_avg", "load_avg_end"} <= set(res["machine"])
    assert set(res["runs"]) == {"sync", "async"}
    fields = set(RunFigures.__dataclass_fields__)
    for name, run in res["runs"].items():
        assert set(run) == fields, name
        assert set(run["weights"]) == set(WeightSync.__dataclass_fields__)
        assert run["mode"] == name and run["steps"] == STEPS - SKIP
        assert run["groups_per_step"] == 4 and run["window_s"] > 0
        assert run["step_s"] == pytest.approx(run["window_s"] / run["steps"])
        assert run["samples_per_s"] == pytest.approx(4 * 4 / run["step_s"])  # groups x n per step
        # From the run's own records: its result.json and metrics.
        result = json.loads((out / "rl" / name / "result.json").read_text())
        assert result["learner"]["steps"] == STEPS
        assert run["weights"]["publishes"] == STEPS + 1  # the initial weights, then every step
        assert run["weights"]["loads"] == sum(a["weight_loads"] for a in result["actors"]) >= 1
        assert sum(run["staleness_hist"].values()) == STEPS * 4
        assert max(int(s) for s in run["staleness_hist"]) <= run["eta"]
        assert 0 <= run["all_waiting"] <= 1 and all(0 <= v <= 1 for v in run["learner_busy"].values())
        assert run["cpu_cores"] is None or run["cpu_cores"]["learner"] >= 0
        # Each actor's clocks over the window, interpolated between its marks: a thread spends no more
        # CPU than wall time, its engine steps no more than it, their forward no more than those.
        assert len(run["actor_cpu_s"]) == len(result["actors"])
        for a in run["actor_cpu_s"]:
            assert 0 <= a["forward"] <= a["engine"] <= a["thread"] <= run["step_s"] + 0.01, a
        assert max(a["engine"] for a in run["actor_cpu_s"]) > 0
    assert res["runs"]["sync"]["eta"] == 0 and res["runs"]["async"]["eta"] == 1
    c = res["comparison"]
    assert set(c) == set(Comparison.__dataclass_fields__) and len(res["pairs"]) == 1
    sync, async_ = res["runs"]["sync"], res["runs"]["async"]
    assert c["speedup"] == pytest.approx(sync["step_s"] / async_["step_s"])
    assert (c["generate_s"], c["train_s"]) == pytest.approx((sync["generate_s"], sync["train_s"]))
    assert c["ideal"] == pytest.approx(ideal_speedup(sync["generate_s"], sync["train_s"]))
    assert c["of_ideal"] == pytest.approx(c["speedup"] / c["ideal"])
    assert (out / "bench.md").read_text().count("|") > 20
    assert {p.name for p in (out / "plots").glob("*.png")} >= {"timeline.png", "busy.png"}


def test_transport_bench_json(tmp_path):
    out = tmp_path / "transport.json"
    n, tokens, prompt = 2, 16, 8
    assert main(["bench", "transport", "--n", str(n), "--tokens", str(tokens), "--prompt-tokens", str(prompt),
                 "--transports", "ipc", "--repeats", "1", "--mb", "0.2", "--ingest-tokens", str(tokens),
                 "--replay-held", "300", "--replay-seconds", "0.2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"date", "machine", "args", "transport", "ingest", "replay"} <= set(res)
    assert "load_avg_after" in res["machine"]
    (row,) = res["transport"]
    assert (row["n"], row["tokens"], row["transport"]) == (n, tokens, "ipc")
    assert row["group_bytes"] == synthetic_group(0, 0, n=n, tokens=tokens, prompt_tokens=prompt).nbytes
    for mode in ("zmq", "protocol", "pickle", "pickle_lists"):
        m = row[mode]
        assert m["groups_per_s"] > 0 and m["cpu_us_per_group"] > 0
        assert m["gb_per_s"] == pytest.approx(m["groups_per_s"] * row["group_bytes"] / 1e9)
    for base in ("zmq", "pickle", "pickle_lists"):  # one repeat: the ratio of the two rates
        assert row[f"protocol_vs_{base}"] == pytest.approx(row["protocol"]["groups_per_s"] / row[base]["groups_per_s"])
    assert row["memcpy_gb_per_s"] > 0 and row["protocol_cpu_vs_zmq"] > 0
    rows = [(r["tokens"], r["wal"], r["gate"], r["all_acknowledged"]) for r in res["ingest"]]
    assert rows == [(tokens, wal, gate, True) for wal in (False, True) for gate in (True, False)]
    for gated, direct in zip(res["ingest"][::2], res["ingest"][1::2], strict=True):  # gate / none, in one run
        assert gated["vs_no_gate"] == pytest.approx(gated["groups_per_s"] / direct["groups_per_s"])
    assert [r["wal"] for r in res["replay"]] == [False, True]
    for r in res["replay"]:
        assert r["held"] >= 300 and r["insert_groups_per_s"] > 0 and r["sample_groups_per_s"] > 0


def test_gemm_bench_json(tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert main(["bench", "gemm", "--shapes", "32:48", "--rows", "8", "2048", "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert {"date", "command", "machine", "threads", "cells"} <= set(res)
    assert [(c["n_in"], c["n_out"], c["rows"]) for c in res["cells"]] == [(32, 48, 8), (32, 48, 2048)]
    for c in res["cells"]:
        assert c["speedup"] == pytest.approx(c["torch_ms"] / c["onednn_ms"])
        flops = 6 * c["rows"] * 32 * 48
        assert c["torch_gflops"] == pytest.approx(flops / c["torch_ms"] / 1e6)
        assert c["onednn_gflops"] == pytest.approx(flops / c["onednn_ms"] / 1e6)
    assert "| 32 x 48 | 2048 |" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # argparse names the bad shape
        main(["bench", "gemm", "--shapes", "32x48"])
    assert exit_.value.code == 2 and "'32x48': a shape is IN:OUT" in capsys.readouterr().err


def test_every_benchmark_records_the_machine_the_same_way():
    """One description of the machine for every `bench` command: the CPU model as /proc/cpuinfo names
    it, the core count, the load, the versions; torch's and the GPU's only where torch is loaded."""
    import os
    import subprocess
    import sys

    from dph_async.tools.bench.machine import machine

    m = machine()
    with open("/proc/cpuinfo") as f:
        models = {line.split(":", 1)[1].strip() for line in f if line.startswith("model name")}
    assert m["cpu"] in models and m["cores"] == os.cpu_count() and len(m["load_avg"]) == 3
    assert {"python", "numpy", "pyzmq", "libzmq", "msgpack"} <= set(m)
    assert ("torch" in m) == ("torch" in sys.modules)
    code = "import json; from dph_async.tools.bench.machine import machine; print(json.dumps(machine()))"
    bare = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert "torch" not in bare and "gpu" not in bare  # no torch import for a benchmark without it
    code = "import torch, json; from dph_async.tools.bench.machine import machine; print(json.dumps(machine()))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert loaded["torch"] and "gpu" in loaded


def test_bench_tta_runs_async_and_sync_to_the_report(small_base, tmp_path):
    out = tmp_path / "tta"
    copy_base(small_base, out)
    sets = [x for item in [*SMALL, "task.name=embedded", "model.max_model_len=32"] for x in ("--set", item)]
    assert main(["bench", "tta", "-o", str(out), "--systems", "async", "sync", "--seeds", "3", "--steps", "4",
                 "--every", "2", "--gain", "0.01", *sets]) == 0
    res = load(out / "tta.json")
    assert [(c.system, c.seed) for c in res.curves] == [("async", 3), ("sync", 3)]
    for c in res.curves:
        assert c.steps == [0, 2, 4]
        assert c.wall[0] == 0.0 and 0 < c.wall[1] < c.wall[2] == c.run_s
        assert all(0.0 <= p <= 1.0 for p in c.pass1)
        for v in (2, 4):
            got = json.loads((out / "eval" / f"{c.system}-seed3" / f"v{v}.json").read_text())
            assert set(got) == {"in_domain"}  # the target's split alone
            assert got["in_domain"]["pass_at_k"]["1"] == pytest.approx(c.pass1[c.steps.index(v)])
        metrics = [json.loads(x) for x in (out / "rl" / f"{c.system}-seed3" / "metrics.jsonl").read_text().splitlines()]
        assert [int(m["learner/version"]) for m in metrics] == [1, 2, 3, 4]
    base = json.loads((out / "eval" / "base-seed3.json").read_text())["in_domain"]["pass_at_k"]["1"]
    assert all(c.pass1[0] == pytest.approx(base) for c in res.curves) and res.base_pass1 == pytest.approx(base)
    md = (out / "tta.md").read_text()
    assert f"Target: held-out Pass@1 >= {res.base_pass1 + 0.01:.3f} (pi_0's {res.base_pass1:.3f} + 0.01, --gain " \
        "given)" in md and "| sync |" in md
    assert (out / "plots" / "tta.png").is_file()
