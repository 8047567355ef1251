"""`dph-async bench scale`: the grid's plan, a cell's record and the refusal of one measured with other
work, the projection against the scaling model, the report and plot, each process's peak memory, and
the resume rules (a finished cell not run again, a grown grid running only its new cell) around a
stand-in for the runs, and a tiny grid through dph-async's real processes and the loop."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from dataclasses import asdict

import pytest

from dph_async.cli.main import main
from dph_async.config import ConfigError
from dph_async.errors import UserError
from dph_async.stats import RatioInterval, ratio_interval
from dph_async.tools import scaling
from dph_async.tools.bench import scale, scale_data, scale_report
from dph_async.tools.bench.cpu import Memory, ProcessTreeCPU, memory_of
from dph_async.tools.bench.peer import PeerBench, PeerRun
from dph_async.tools.bench.scale import (
    SIZES,
    CellPlan,
    GridError,
    Size,
    check_recorded,
    parse_size,
    plan_grid,
    projection,
    summarise_cell,
)
from dph_async.tools.bench.scale_data import ScaleBench, ScaleCell, SystemFigures
from dph_async.tools.bench.scale_report import markdown, plot


def test_the_grid_runs_size_by_size_and_keeps_a_steps_completion_tokens_near_the_budget():
    plans = plan_grid([SIZES["2m"], SIZES["52m"]], [256, 16, 64], tokens_per_step=1024, n=4)
    assert [p.key for p in plans] == ["2m-L16", "2m-L64", "2m-L256", "52m-L16", "52m-L64", "52m-L256"]
    assert [p.prompts_per_step for p in plans[:3]] == [16, 4, 1]
    assert all(p.n == 4 for p in plans)
    assert [p.prompts_per_step for p in plan_grid([SIZES["2m"]], [64], 100, 4)] == [1]  # one prompt at least
    with pytest.raises(GridError, match="length 0"):
        plan_grid([SIZES["2m"]], [0], 1024, 4)


def test_sizes_by_name_or_shape_with_heads_vllm_can_serve():
    assert parse_size("52m") == Size("52m", 512, 6) and parse_size("52m").heads == 8
    assert parse_size("160x4").heads == 5 and parse_size("32x2").heads == 1 and parse_size("96x2").heads == 3
    for bad in ("48x2", "16x2", "512", "512x0", "huge"):
        with pytest.raises(GridError, match="HIDDENxLAYERS"):
            parse_size(bad)


def _dph_run(step_s: float = 0.5) -> PeerRun:
    detail = {"cpu_cores": {"learner": 0.8, "actors": 0.9, "ray": 0.05, "outside": 0.3},
              "weights": {"delay_s": 0.02, "publish_bytes": 8_000_000}}
    return PeerRun("dph-async", 1, 6, step_s, 64 / step_s, 1024 / step_s, {}, 20.0, (1.0, 1.5), 0.3, 0.0,
                   0.85, detail, {"learner": 900.0, "actor": 1200.0, "Ray and the driver": 800.0})


def _peer_run(system: str, step_s: float, cpu_s: float) -> PeerRun:
    return PeerRun(system, 1, 6, step_s, 64 / step_s, 1024 / step_s, {}, 5.0, (1.0, 1.2), 0.1, 0.0, cpu_s, {},
                   {system: 700.0})


def _bench(q: int = 4) -> PeerBench:
    runs = [_dph_run(), _peer_run("trl", 0.9, 1.6), _peer_run("loop", 0.6, 1.1)]
    return PeerBench("now", {}, {"prompts_per_step": q, "eta": 1}, 2, runs, {}, {"trl": 1.8, "loop": 1.2}, None, [])


@pytest.mark.parametrize("q", [4, 1])
def test_projection_is_the_scaling_model_on_the_cells_costs_against_the_peers_best(q):
    """One prompt per step (a long cell) cannot be split over actors: at eta 1 one actor works at a time."""
    rows = projection(_bench(q), (2, 4, 8))
    costs = scaling.Costs(samples_per_step=64, actor_cpu_s_per_sample=0.9 * 0.5 / 64, learner_cpu_s_per_step=0.4,
                          weight_latency_s=0.02, sync_latency_s=0.0, other_cores=0.05, grad_bytes=8_000_000)
    for row in rows:
        c = row["cores"]
        by_actors = {n: scaling.samples_per_s(costs, "async", scaling.Layout(
            n, 1, cores=c, eta=1, groups_per_step=q, inflight_prompts=-(-q // n))) for n in range(1, max(2, c))}
        assert row["dph-async"] == pytest.approx(max(by_actors.values()))
        assert by_actors[row["actors"]] == pytest.approx(row["dph-async"])
        # A peer's best: its completions per step over its CPU-seconds spread on every core.
        assert row["trl"] == pytest.approx(64 / (1.6 / c)) and row["loop"] == pytest.approx(64 / (1.1 / c))
    assert [r["cores"] for r in rows] == [2, 4, 8]
    assert projection(PeerBench("now", {}, {}, 2, [_peer_run("trl", 0.9, 1.6)], {}, {}, None, []), (2,)) == []


def _cell(key: str = "2m-L64", length: int = 64, trl_ratio: float = 1.8) -> ScaleCell:
    systems = {"dph-async": SystemFigures(0.5, 128.0, 8192.0, 0.85, 20.0, {"learner": 900.0, "actor": 1200.0}),
               "trl": SystemFigures(0.9, 71.1, 4551.0, 1.6, 5.0, {"trl": 700.0})}
    return ScaleCell(key, key.split("-")[0], 2_120_864, 32, 2, 1, length, 4, 4, 8, 2, "now", 95.0, (1.0, 2.0), 0.3,
                     systems, {"trl": trl_ratio}, {"learner: training": 0.3, "Ray": 0.02},
                     {"the busiest actor's thread, as measured": 0.4},
                     {"trl": {"every part, as measured": 2.1, "the busiest actor's thread, as measured": 2.2}},
                     projection(_bench(), (2, 4)))


def test_a_cells_record_reads_back_and_one_with_other_work_is_refused():
    cell = _cell()
    cell.repeats, cell.intervals = 3, {"trl": RatioInterval(1.8, 1.5, 2.1, 3)}
    again = ScaleCell.from_json(json.loads(json.dumps(asdict(cell))))
    assert again == cell
    plan = CellPlan("2m-L64", SIZES["2m"], 64, 4, 4)
    setup = {"preset": "grpo", "overrides": [], "systems": ["dph-async", "trl"], "vocab": 32768}
    cell.setup = setup
    again = ScaleCell.from_json(json.loads(json.dumps(asdict(cell))))
    check_recorded(again, plan, 2_120_864, steps=8, skip=2, repeats=3, setup=setup)
    for other in (dict(steps=9, skip=2, repeats=3, setup=setup), dict(steps=8, skip=3, repeats=3, setup=setup),
                  dict(steps=8, skip=2, repeats=1, setup=setup),
                  dict(steps=8, skip=2, repeats=3, setup={**setup, "overrides": ["actors.compile=false"]}),
                  dict(steps=8, skip=2, repeats=3, setup={**setup, "vocab": 512})):
        with pytest.raises(GridError, match="recorded with other work"):
            check_recorded(again, plan, 2_120_864, **other)
    with pytest.raises(GridError, match="recorded with other work"):
        check_recorded(again, CellPlan("2m-L64", SIZES["2m"], 64, 2, 4), 2_120_864, steps=8, skip=2, repeats=3,
                       setup=setup)
    # A cell recorded before repeats ran each system once and had no interval, nor its setup.
    old = {k: v for k, v in asdict(_cell()).items() if k not in ("repeats", "intervals", "commit", "setup")}
    assert ScaleCell.from_json(json.loads(json.dumps(old))) == _cell()
    check_recorded(ScaleCell.from_json(old), plan, 2_120_864, steps=8, skip=2, repeats=1, setup={})
    with pytest.raises(GridError, match="recorded with other work"):  # its setup unknown: not taken as this one
        check_recorded(ScaleCell.from_json(old), plan, 2_120_864, steps=8, skip=2, repeats=1, setup=setup)


def test_a_cell_of_repeats_keeps_medians_the_largest_peaks_and_the_paired_interval():
    """Three rotations: each system's row is its runs' medians (CPU-seconds of the runs that kept
    them), each process's peak the largest of its runs; the interval pairs the runs of one repeat."""
    dph = [_dph_run(s) for s in (0.5, 0.4, 0.8)]
    trl = [_peer_run("trl", s, c) for s, c in ((0.9, 1.6), (1.0, None), (1.2, 2.0))]
    for k, (d, t) in enumerate(zip(dph, trl, strict=True), 1):
        d.repeat = t.repeat = k
    dph[1].peak_rss_mb = {"learner": 950.0, "actor": 1100.0}
    bench = PeerBench("now", {}, {"prompts_per_step": 4, "eta": 1}, 2, [*dph, *trl], {}, {"trl": 1.5}, None, [],
                      {"trl": ratio_interval([(d.completions_per_s, t.completions_per_s)
                                              for d, t in zip(dph, trl, strict=True)])})
    cell = summarise_cell(CellPlan("2m-L64", SIZES["2m"], 64, 4, 4), 2_120_864, bench, 6, 1, 30.0, (1.0, 1.0), 3,
                          {"preset": "grpo"})
    d, t = cell.systems["dph-async"], cell.systems["trl"]
    assert (d.step_s, d.completions_per_s, d.tokens_per_s) == (0.5, 128.0, 2048.0)
    assert d.peak_rss_mb == {"learner": 950.0, "actor": 1200.0, "Ray and the driver": 800.0}
    assert t.step_s == 1.0 and t.cpu_s_per_step == pytest.approx(1.8) and t.startup_s == 5.0
    ci = cell.intervals["trl"]
    # Per repeat the pairs are 1.8, 2.5, 1.5: their geometric mean, not the ratio of medians (1.5).
    assert ci.ratio == pytest.approx((1.8 * 2.5 * 1.5) ** (1 / 3)) and ci.low < ci.ratio < ci.high and ci.n == 3
    assert cell.repeats == 3 and cell.ratios == {"trl": 1.5} and cell.setup == {"preset": "grpo"}
    assert cell.ratio("trl") == ci.ratio  # what the docs show: the interval's centre, never outside it
    # The projection takes each system's median run (by completions/s) of those that kept their costs:
    # dph-async's first (128 of 80, 128, 160), TRL's last (53 of 53 and 71; the second kept no CPU figure).
    for d in dph:
        d.detail = {**d.detail, "cpu_cores": {**d.detail["cpu_cores"], "actors": 0.5 + d.step_s}}
    want = projection(PeerBench("now", {}, {"prompts_per_step": 4, "eta": 1}, 2, [dph[0], trl[2]], {}, {}, None, []),
                      (2, 4))
    assert want[0]["trl"] == pytest.approx(64 / (2.0 / 2))
    assert projection(bench, (2, 4)) == want and scale.median_run([]) is None


def test_report_and_plot_carry_every_cell(tmp_path):
    cells = [_cell("2m-L16", 16, 1.2), _cell("2m-L64", 64, 1.8)]
    res = ScaleBench("now", {"cpu": "test", "cores": 2, "load_avg": (1, 1, 1), "load_avg_end": (2, 2, 2)},
                     {"preset": "grpo", "overrides": [], "vocab": 32768, "tokens_per_step": 1024, "n": 4, "steps": 8,
                      "skip": 2, "systems": ["dph-async", "trl"]}, cells)
    text = markdown(res)
    assert ("| model, tokens | prompts x n | dph-async c/s | loop c/s | TRL c/s | / TRL | / loop | tokens/s: "
            "dph-async, loop, TRL | cell s | load start -> end | others' cores |") in text
    assert "| 2.1 M, 16 | 4 x 4 | 128 | - | 71.1 | 1.20x |" in text  # below 1.5x: not bold
    assert "| 2.1 M, 64 | 4 x 4 | 128 | - | 71.1 | **1.80x** |" in text
    assert "One run per system per cell: no interval." in text  # a grid recorded before repeats
    cells[1].intervals = {"trl": RatioInterval(1.7, 1.45, 2.05, 3)}
    res.settings["repeats"] = 3
    text = markdown(res)
    assert "| 2.1 M, 64 | 4 x 4 | 128 | - | 71.1 | **1.70x** [1.45-2.05] |" in text  # the interval's centre
    assert "3 runs per system per cell, the order rotating each repeat." in text
    assert "| 2.1 M, 64 | 900 | 1200 | - | - | 700 |" in text  # peak memory per process
    assert "2.10x" in text and "2.20x" in text  # the bounds against TRL
    rows = projection(_bench(), (2, 4))
    four = rows[1]
    assert f"{four['dph-async']:.0f} ({four['actors']} act., {four['dph-async'] / four['trl']:.2f}x)" in text
    plot(res, tmp_path / "scale.png")
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_docs_table_puts_sizes_in_rows_and_lengths_in_columns_with_when_and_where(tmp_path):
    a, b = _cell("2m-L16", 16, 1.2), _cell("2m-L64", 64, 1.8)
    b.ratios["loop"], b.intervals = 1.3, {"trl": RatioInterval(1.7, 1.45, 2.05, 3)}
    a.date, b.date, b.commit = "2026-11-29 23:01 UTC", "2026-11-29 23:10 UTC", "f337f21"
    big = _cell("52m-L64", 64, 2.5)
    big.params = 52_400_000
    res = ScaleBench("now", {"cpu": "test cpu", "cores": 2}, {"repeats": 3}, [a, b, big])
    assert scale_report.ratio_table(res.cells).splitlines() == [
        "| dph-async / TRL (/ loop) | 16 tokens | 64 tokens |", "|---|---|---|",
        "| 2.1 M (2m) | 1.20x (-) | **1.70x** [1.45-2.05] (1.30x) |", "| 52.4 M (52m) | - | **2.50x** (-) |"]
    same = _cell("512x6-L64", 64, 2.0)  # another name for a size of as many parameters: a row of its own
    same.params = 52_400_000
    assert "| 52.4 M (512x6) | - | **2.00x** (-) |" in scale_report.ratio_table([*res.cells, same])
    assert scale_report.provenance(res) == ("Cells finished 2026-11-29 23:01 UTC to now at commit not recorded, "
                                            "f337f21; test cpu, 2 cores; 3 runs per system per cell, the order "
                                            "rotating each repeat.")
    assert scale_report.provenance(ScaleBench("now", {}, {}, [])) == "No cell recorded."
    # One date, once; a machine that recorded nothing is "?"; a row's parameters rounded as /1e6 rounds.
    one = _cell("2m-L64", 64, 1.8)
    one.params = 52_450_000
    assert scale_report.provenance(ScaleBench("now", {}, {}, [one])) == (
        "Cells finished now at commit not recorded; ?, ? cores; One run per system per cell: no interval.")
    assert "| 52.5 M (2m) |" in scale_report.ratio_table([one])
    path = tmp_path / "bench.json"
    path.write_text(res.to_json())
    assert scale_data.load(path) == res
    for text in ("{not json", json.dumps({"date": "x"}), json.dumps({**json.loads(res.to_json()), "cells": [{}]})):
        path.write_text(text)
        with pytest.raises(UserError, match=r"is not a bench\.json this version of `bench scale` writes "
                                            r"\((Decode|Validation)Error: "):
            scale_data.load(path)
    path.unlink()
    path.symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(UserError, match="a symbolic link, not followed"):
        scale_data.load(path)


def test_a_finished_cell_that_is_no_record_is_refused_by_name(tmp_path):
    path = tmp_path / "cell.json"
    path.write_text(json.dumps(asdict(_cell())))
    assert scale.read_cell(path) == _cell()
    deep = "[" * 100_000 + "]" * 100_000
    for text in ("[]", json.dumps({**asdict(_cell()), "systems": {"trl": {"step_s": 1}}}), "x" * 10, deep,
                 json.dumps({**asdict(_cell()), "ratios": {"trl": "2"}}),
                 json.dumps({**asdict(_cell()), "load_avg": "1, 2"}),
                 json.dumps({**asdict(_cell()), "wall_s": float("nan")})):
        path.write_text(text)
        with pytest.raises(GridError, match=re.escape(f"{path} is not a cell this version of `bench scale` writes")):
            scale.read_cell(path)
    path.write_text(" " * (scale_data.MAX_BYTES + 1))
    with pytest.raises(GridError, match="more than the"):
        scale.read_cell(path)
    # Well-typed but not what the report can show: refused too, each naming why.
    good = asdict(_cell())
    for change, says in ((dict(intervals={"trl": {"ratio": 9.0, "low": 1.0, "high": 2.0, "n": 3}}), "outside its"),
                         (dict(intervals={"trl": {"ratio": 0.0, "low": 0.0, "high": 0.0, "n": 3}}), "outside its"),
                         (dict(projection=[{"cores": 2}]),
                          r"\(ValidationError: a projection row without cores, actors or dph-async"),
                         (dict(size="2m | 9.99x |"), "not a cell's name"),
                         (dict(key="52m-L256"), "not a cell's name"),
                         (dict(key="k" * 50), f"cell '{'k' * 40}' of size '2m'"),
                         (dict(size="s" * 50), f"of size '{'s' * 40}': not")):
        path.write_text(json.dumps({**good, **change}))
        with pytest.raises(GridError, match=says):
            scale.read_cell(path)
    # The edges that hold: a ratio at either end of its interval, a projection row of just its columns.
    for ci in ({"ratio": 1.0, "low": 1.0, "high": 2.0, "n": 3}, {"ratio": 2.0, "low": 1.0, "high": 2.0, "n": 3}):
        path.write_text(json.dumps({**good, "intervals": {"trl": ci}, "projection": [
            {"cores": 2, "actors": 1, "dph-async": 9.0}]}))
        assert scale.read_cell(path).intervals["trl"].ratio == ci["ratio"]


def test_each_processs_peak_memory_is_this_runs_and_kept_by_component():
    """A process running before the sampler starts (kept from an earlier run) gets its peak reset: its
    200 MiB of before do not count, its 120 MiB during the run do."""
    code = ("import sys; b = bytearray(200 * 2**20); del b; print('freed', flush=True); sys.stdin.readline(); "
            "b = bytearray(120 * 2**20); print('held', flush=True); sys.stdin.readline()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "freed"
        with ProcessTreeCPU(interval=0.05) as sampler:
            child.stdin.write("\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "held"
            sampler.sample()
        child.communicate("\n", timeout=60)
    finally:
        child.kill()
    component, peak = sampler.peaks[child.pid]
    assert component == "ray" and 120 * 2**20 <= peak < 190 * 2**20, peak / 2**20
    mem = memory_of(sampler.peaks)["ray"]
    assert mem.largest_mb >= 120 and mem.processes >= 2  # this process and the child
    # Only the "ray" processes: another test's Ray cluster may keep titled processes under this one.
    assert mem.sum_mb == pytest.approx(sum(b for c, b in sampler.peaks.values() if c == "ray") / 2**20)
    assert memory_of({1: ("learner", 2**20), 2: ("learner", 3 * 2**20), 3: ("actors", 2**21)}) == {
        "actors": Memory(2.0, 2.0, 1), "learner": Memory(3.0, 4.0, 2)}


SCALE = ["bench", "scale", "--sizes", "32x1", "--vocab", "512", "--tokens-per-step", "16", "--n", "2", "--steps", "8",
         "--skip", "2", "--systems", "dph-async", "loop", "--set", "actors.compile=false", "--repeats", "1"]


def test_a_grid_runs_only_the_cells_not_finished_and_refuses_one_recorded_with_other_work(tmp_path, monkeypatch,
                                                                                          capsys):
    """The resume rules of run_grid, around a stand-in for the runs (the real ones: the test below):
    the same grid again runs no cell, a grown grid runs only its new cell, a finished cell recorded
    with other work is refused before any cell runs."""
    ran: list[int] = []

    def run(cfg, cell_dir, repeats, skip, machine, systems, cache, log, settings):
        ran.append(cfg.sampling.max_tokens)
        assert repeats == 2
        cell_dir.mkdir(parents=True)  # as the real one does
        bench = _bench(q=cfg.learner.groups_per_step)
        bench.workload.update(n=2, max_tokens=cfg.sampling.max_tokens, lr=1e-3, temperature=1.0, steps=4, model="m",
                              data="d", objective="grpo", actors=1, settings=[])
        return bench

    monkeypatch.setattr(scale.peer, "run", run)
    monkeypatch.setattr(scale, "ray_cluster", lambda cfg, prestart: contextlib.nullcontext())
    out = tmp_path / "scale"

    def grid(lengths: list[int], steps: int = 4, repeats: int = 2) -> list[str]:
        return [c.key for c in scale.run_grid([parse_size("32x1")], lengths, out, preset="grpo", overrides=[],
                                              tokens_per_step=16, n=2, steps=steps, skip=1, systems=["dph-async"],
                                              cache=tmp_path, machine={}, repeats=repeats, vocab=512,
                                              log=lambda m: None).cells]

    assert grid([4]) == ["32x1-L4"] and ran == [4]
    stamp = (out / "cells" / "32x1-L4" / "cell.json").stat().st_mtime_ns
    assert grid([4]) == ["32x1-L4"] and ran == [4]
    assert grid([8, 4]) == ["32x1-L4", "32x1-L8"] and ran == [4, 8]
    assert (out / "cells" / "32x1-L4" / "cell.json").stat().st_mtime_ns == stamp
    assert [c["key"] for c in json.loads((out / "bench.json").read_text())["cells"]] == ["32x1-L4", "32x1-L8"]
    for other in (dict(steps=5), dict(repeats=3)):
        with pytest.raises(GridError, match="32x1-L4 is recorded with other work"):
            grid([4, 8, 16], **other)
    assert ran == [4, 8]  # refused before the new cell ran
    assert json.loads((out / "bench.json").read_text())["settings"]["repeats"] == 2
    # A cell stopped midway starts over: what its earlier runs left (of other settings, maybe) goes.
    (out / "cells" / "32x1-L16" / "peers").mkdir(parents=True)
    (out / "cells" / "32x1-L16" / "peers" / "trl-1.json").write_text("{}")
    assert grid([4, 8, 16]) == ["32x1-L4", "32x1-L8", "32x1-L16"] and ran == [4, 8, 16]
    assert not (out / "cells" / "32x1-L16" / "peers").exists()
    with pytest.raises(GridError, match="holds inputs made with other settings"):
        scale.run_grid([parse_size("32x1")], [4], out, preset="grpo", overrides=[], tokens_per_step=16, n=2, steps=4,
                       skip=1, systems=["dph-async"], cache=tmp_path, machine={}, repeats=2, vocab=600,
                       log=lambda m: None)
    record = (out / "inputs" / "inputs.json").read_text()
    (out / "inputs" / "inputs.json").unlink()  # inputs whose settings are unknown are not taken as these
    with pytest.raises(GridError, match="holds inputs without the record of their settings"):
        grid([4])
    (out / "inputs" / "inputs.json").write_text(record)
    # --fresh deletes nothing before the settings are known good, nor in a directory no grid made.
    with pytest.raises(ConfigError):
        scale.run_grid([parse_size("32x1")], [4], out, preset="grpo", overrides=["actors.compil=false"],
                       tokens_per_step=16, n=2, steps=4, skip=1, systems=["dph-async"], cache=tmp_path, machine={},
                       repeats=2, vocab=512, fresh=True, log=lambda m: None)
    assert (out / "cells" / "32x1-L4" / "cell.json").is_file()
    mine = tmp_path / "mine"
    (mine / "cells").mkdir(parents=True)
    (mine / "cells" / "notebook.ipynb").write_text("{}")
    with pytest.raises(GridError, match="no grid made it: nothing deleted"):
        scale.clear(mine)
    assert (mine / "cells" / "notebook.ipynb").is_file()
    (out / "bench.md").write_text("old")
    scale.clear(out)  # a grid's own: its cells, inputs and reports go
    assert sorted(p.name for p in out.iterdir()) == []
    assert grid([4]) == ["32x1-L4"] and ran == [4, 8, 16, 4]
    # A shared directory's links are not followed: not for the grid's record, nor for its cells.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "bench.json").write_text("theirs")
    (out / "bench.json").unlink()
    (out / "bench.json").symlink_to(elsewhere / "bench.json")
    with pytest.raises(UserError, match="a symbolic link, not followed"):
        grid([4])
    assert (elsewhere / "bench.json").read_text() == "theirs"
    (out / "bench.json").unlink()
    (out / "cells").rename(elsewhere / "cells")
    (out / "cells").symlink_to(elsewhere / "cells")
    with pytest.raises(UserError, match="a symbolic link, where an output directory belongs"):
        grid([4])
    assert ran == [4, 8, 16, 4]
    assert main([*SCALE, "-o", str(out), "--lengths", "4", "--fresh"]) == 2  # --fresh deletes nothing through it
    assert "a symbolic link, where an output directory belongs" in capsys.readouterr().err
    assert sorted(p.name for p in (elsewhere / "cells").iterdir()) == ["32x1-L4"]


@pytest.mark.slow
def test_a_tiny_grid_writes_its_report(tmp_path, capsys, ray_session):
    """Through the command, in the suite's Ray cluster: a cell of dph-async's real processes and the
    loop (the runs of `bench peer`, which the cell is), its figures, report and plot; the limit read
    from the actor's clocks over the steady state, no bound below the ratio the runs measured; the
    same command with other work is refused."""
    out = tmp_path / "scale"
    assert main([*SCALE, "-o", str(out), "--lengths", "4"]) == 0
    assert "cell 1/1: 32x1-L4" in capsys.readouterr().err  # the progress log is on stderr, as every command's

    res = json.loads((out / "bench.json").read_text())
    (cell,) = res["cells"]
    assert cell["key"] == "32x1-L4"
    assert set(cell["systems"]) == {"dph-async", "loop"} and set(cell["ratios"]) == {"loop"}
    dph = cell["systems"]["dph-async"]
    # Every completion as long as the cell asks: a random model over 512 tokens seldom ends one sooner.
    assert dph["tokens_per_s"] / dph["completions_per_s"] == pytest.approx(cell["length"], rel=0.3)
    assert cell["prompts_per_step"] == max(1, 16 // (2 * cell["length"])) and cell["params"] > 0
    assert {"learner", "actor", "Ray and the driver"} <= set(dph["peak_rss_mb"])
    assert cell["systems"]["loop"]["peak_rss_mb"]["loop"] > 100
    assert cell["parts"] and cell["projection"][0]["cores"] == 2
    assert f"| {cell['params'] / 1e6:.1f} M, 4 |" in (out / "bench.md").read_text()
    assert (out / "scale.png").read_bytes()[:4] == b"\x89PNG"

    peer = json.loads((out / "cells" / "32x1-L4" / "bench.json").read_text())  # the cell's `bench peer`
    dph = next(r for r in peer["runs"] if r["system"] == "dph-async")
    (actor,) = dph["detail"]["actor_cpu_s"]
    assert 0 < actor["forward"] <= actor["engine"] <= actor["thread"] <= dph["step_s"] + 0.01, actor
    assert cell["threads"] == pytest.approx({"the busiest actor's thread, as measured": actor["thread"],
                                             "the busiest actor's thread, its engine steps alone": actor["engine"]})
    # A run cannot beat its own costs: one thread's CPU fits in the wall time, the processes' in the cores'.
    for bound in ("the busiest actor's thread, as measured", "every part, as measured"):
        assert cell["ceilings"]["loop"][bound] >= 0.95 * cell["ratios"]["loop"], bound
    text = " ".join((out / "cells" / "32x1-L4" / "bench.md").read_text().split())
    assert "| the busiest actor's thread, as measured |" in text
    # A setting given with --set is recorded with the workload.
    assert peer["workload"]["settings"] == ["actors.compile=false"] and "settings given: actors.compile=false." in text

    other = [*SCALE, "-o", str(out), "--lengths", "4"]
    other[other.index("--steps") + 1] = "5"
    assert main(other) == 2
    assert "32x1-L4 is recorded with other work" in capsys.readouterr().err
