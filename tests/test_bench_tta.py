"""`dph-async bench tta`: time to target on curves against the interpolation's own definition, the
speed-up's interval computed apart, a dph-async run's clock from its own records, the command's
refusals. The bench end to end with the real processes: tests/test_bench_commands.py."""

from __future__ import annotations

import json
import math
import random
import statistics
from dataclasses import replace

import pytest

from dph_async.cli.commands import bench_tta
from dph_async.cli.main import main
from dph_async.safe_files import UnsafeFile
from dph_async.stats import t_critical
from dph_async.tools.bench import tta, tta_data, tta_report
from dph_async.tools.bench.tta_data import Curve, TTABench, load
from dph_async.tools.bench.tta_report import compare, time_to_target


def _interp(c: Curve, t: float) -> float:
    """The curve's Pass@1 at clock t, on the straight lines between its points."""
    for i in range(1, len(c.wall)):
        if t <= c.wall[i]:
            f = (t - c.wall[i - 1]) / (c.wall[i] - c.wall[i - 1])
            return c.pass1[i - 1] + f * (c.pass1[i] - c.pass1[i - 1])
    raise AssertionError("past the curve")


def _random_curve(rng: random.Random, system: str = "async", seed: int = 0) -> Curve:
    n = rng.randint(2, 9)
    wall = [0.0]
    for _ in range(n):
        wall.append(wall[-1] + rng.uniform(0.5, 20.0))
    steps = [0, *range(10, 10 * n + 1, 10)]
    return Curve(system, seed, steps, wall, [rng.random() * 0.5 for _ in wall])


def test_time_to_target_is_the_first_crossing_of_the_straight_lines():
    rng = random.Random()
    for _ in range(500):
        c = _random_curve(rng)
        target = rng.uniform(0.0, 0.55)
        r = time_to_target(c, target)
        first = next((i for i, p in enumerate(c.pass1) if p >= target), None)
        assert r.last_s == c.wall[-1]
        if first is None:
            assert (r.seconds, r.step, r.gap_s) == (None, None, 0.0)
            continue
        if first == 0:
            assert (r.seconds, r.step, r.gap_s) == (0.0, 0.0, 0.0)
            continue
        assert c.wall[first - 1] < r.seconds <= c.wall[first] + 1e-12
        assert _interp(c, r.seconds) == pytest.approx(target, abs=1e-9)
        assert r.gap_s == pytest.approx(c.wall[first] - c.wall[first - 1])
        # steps interpolate with the same fraction as seconds
        f = (r.seconds - c.wall[first - 1]) / (c.wall[first] - c.wall[first - 1])
        assert r.step == pytest.approx(c.steps[first - 1] + f * (c.steps[first] - c.steps[first - 1]))


def test_time_to_target_by_hand():
    c = Curve("sync", 0, [0, 10, 20, 30], [0.0, 10.0, 30.0, 40.0], [0.10, 0.12, 0.20, 0.15])
    assert time_to_target(c, 0.16).seconds == pytest.approx(20.0)  # halfway from 0.12 to 0.20
    assert time_to_target(c, 0.16).step == pytest.approx(15.0)
    assert time_to_target(c, 0.20).seconds == pytest.approx(30.0)  # exactly at a point counts
    assert time_to_target(c, 0.2000001).seconds is None  # the later drop does not cross again
    assert time_to_target(c, 0.10).seconds == 0.0


def test_speed_up_pairs_seeds_and_counts_the_censored_apart():
    rng = random.Random()
    curves, logs = [], []
    target = 0.5
    for seed in range(7):
        ta, tp = rng.uniform(5, 50), rng.uniform(5, 50)
        # straight to the target at ta / tp, then past it
        curves.append(Curve("async", seed, [0, 10, 20], [0.0, ta, ta + 5], [0.1, target, 0.9]))
        curves.append(Curve("trl", seed, [0, 10, 20], [0.0, tp, tp + 5], [0.1, target, 0.9]))
        logs.append(math.log(tp / ta))
    reached, missed = [0.1, 0.9], [0.1, 0.2]
    for seed, (a, b) in enumerate([(reached, missed)] * 3 + [(missed, reached)] * 2 + [(missed, missed)], start=7):
        curves += [Curve("async", seed, [0, 10], [0.0, 4.0], a), Curve("trl", seed, [0, 10], [0.0, 4.0], b)]
    curves.append(Curve("async", 20, [0, 10], [0.0, 4.0], reached))  # no peer run: not a pair
    curves += [Curve("sync", 21, [0, 10], [0.0, 4.0], reached), Curve("trl", 21, [0, 10], [0.0, 4.0], reached)]
    comp = compare(curves, target, "trl")
    assert (comp.both, comp.only_async, comp.only_peer, comp.neither) == (7, 3, 2, 1)
    mean, sd = statistics.fmean(logs), statistics.stdev(logs)
    half = t_critical(6) * sd / math.sqrt(7)
    assert comp.interval.ratio == pytest.approx(math.exp(mean))
    assert comp.interval.low == pytest.approx(math.exp(mean - half))
    assert comp.interval.high == pytest.approx(math.exp(mean + half))
    assert comp.interval.n == 7


def test_a_run_clock_starts_at_the_first_generation(tmp_path):
    t0 = 1000.0
    timeline = {"learner": [[t0 + 3.0, t0 + 4.0, "train"], [t0 + 0.5, t0 + 3.0, "wait"]],
                "actors": [[[t0 - 2.0, t0 - 1.0, "weights"], [t0 + 0.2, t0 + 0.3, "submit"]],
                           [[t0, t0 + 0.1, "submit"], [t0 + 0.1, t0 + 2.0, "generate"]]]}
    (tmp_path / "timeline.json").write_text(json.dumps(timeline))
    rows = [{"learner/version": v, "time/wall": t0 + 4.0 * v, "learner/step_seconds": 1.0} for v in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert tta.generation_start(tmp_path) == t0  # the first submit, not the weights' load before it
    assert tta.dph_clock(tmp_path) == {1: 4.0, 2: 8.0, 3: 12.0}
    timeline["actors"] = [[[t0 - 2.0, t0 - 1.0, "weights"]]]
    (tmp_path / "timeline.json").write_text(json.dumps(timeline))
    assert tta.generation_start(tmp_path) == t0 + 3.0  # no submit recorded: the first training step


def test_kept_steps_and_the_rotation():
    assert tta.kept_steps(150, 15) == [15, 30, 45, 60, 75, 90, 105, 120, 135, 150]
    assert tta.kept_steps(10, 4) == [4, 8, 10]
    assert tta.kept_steps(4, 4) == [4]
    systems = ["async", "sync", "trl"]
    assert [tta.order(systems, i) for i in range(4)] == [
        ["async", "sync", "trl"], ["sync", "trl", "async"], ["trl", "async", "sync"], ["async", "sync", "trl"]]


def _bench(curves: list[Curve], notes: list[str]) -> TTABench:
    return TTABench(provenance={"date": "2026-11-29 20:00 UTC", "commit": "abc1234", "command": "dph-async bench tta",
                                "machine": {"cpu": "EPYC", "cores": 2, "load_avg": [0.5, 0.4, 0.3]}},
                    workload={"task": "stride", "prompts_per_step": 16, "n": 8, "max_tokens": 400, "lr": 1e-3,
                              "temperature": 1.0, "steps": 20, "objective": "grpo", "actors": 2, "eta": 1,
                              "test_prompts": 100, "k": 16},
                    base_pass1=0.1, base_se=0.02, every=10, curves=curves, notes=notes)


def test_the_report_says_every_figure_in_its_place(tmp_path):
    curves = [Curve("async", 0, [0, 10, 20], [0.0, 5.0, 10.0], [0.1, 0.2, 0.3], run_s=10.0),
              Curve("sync", 0, [0, 10, 20], [0.0, 9.0, 18.0], [0.1, 0.15, 0.18], run_s=18.0),
              Curve("async", 1, [0, 10, 20], [0.0, 6.0, 12.0], [0.1, 0.3, 0.35], run_s=12.0),
              Curve("sync", 1, [0, 10, 20], [0.0, 8.0, 16.0], [0.1, 0.2, 0.3], run_s=16.0),
              Curve("trl", 1, [0, 10, 20], [0.0, 20.0, 40.0], [0.1, 0.28, 0.4], run_s=40.0)]
    res = _bench(curves, ["TRL could not be installed"])
    (tmp_path / "tta.json").write_text(res.to_json())
    assert load(tmp_path / "tta.json") == res
    # times to 0.25: async 7.5 (seed 0: 0.2 at 5 s -> 0.3 at 10 s) and 4.5 (seed 1: 0.1 -> 0.3 over 6 s);
    # sync seed 1 12.0 (0.2 at 8 -> 0.3 at 16), seed 0 never; trl seed 1 16.7 (0.1 -> 0.28 over 20 s).
    # One pair per peer: no interval, which the table shows as "-".
    expected = "\n".join([
        "# dph-async bench tta (2026-11-29 20:00 UTC, commit abc1234)", "",
        "Command: `dph-async bench tta`. Machine: EPYC, 2 cores, load average 0.50 0.40 0.30 at the end.",
        "Work: task stride, 16 prompts x 8 completions a step, at most 400 tokens, lr 0.001, temperature 1, "
        "20 steps, objective grpo; dph-async: actors 2, eta 1 (async). Evaluated every 10 steps on 100 held-out "
        "prompts x 16 samples.",
        "Target: held-out Pass@1 >= 0.250 (given with --target); one evaluation's sampling standard error on these "
        "prompts is about 0.020.",
        "The clock starts at each run's first generation, on one host; dph-async's holds its checkpoint writing, "
        "TRL's has its writing taken out.", "",
        "## Time to target", "",
        "| system | reached | median s to target | median steps to target | median gap between evaluations, s "
        "| median s/step | final Pass@1 (mean) |",
        "|---|---|---|---|---|---|---|",
        "| async | 2 of 2 | 6.0 | 11.2 | 5.5 | 0.55 | 0.325 |",
        "| sync | 1 of 2 | 12.0 | 15.0 | 8.0 | 0.85 | 0.240 |",
        "| trl | 1 of 1 | 16.7 | 8.3 | 20.0 | 2.00 | 0.400 |", "",
        "## async's speed-up to target (per seed: t_peer / t_async)", "",
        "| peer | geometric mean (95% interval) | seeds both reached | only async | only the peer | neither |",
        "|---|---|---|---|---|---|",
        "| sync | - | 1 | 1 | 0 | 0 |",
        "| trl | - | 1 | 0 | 0 | 0 |", "",
        "## Runs", "",
        "| system | seed | s to target | steps to target | s for all steps | Pass@1 along the run |",
        "|---|---|---|---|---|---|",
        "| async | 0 | 7.5 | 15.0 | 10.0 | 0.100 0.200 0.300 |",
        "| sync | 0 | > 18.0 | - | 18.0 | 0.100 0.150 0.180 |",
        "| async | 1 | 4.5 | 7.5 | 12.0 | 0.100 0.300 0.350 |",
        "| sync | 1 | 12.0 | 15.0 | 16.0 | 0.100 0.200 0.300 |",
        "| trl | 1 | 16.7 | 8.3 | 40.0 | 0.100 0.280 0.400 |", "",
        "Notes:", "", "- TRL could not be installed", ""])
    assert tta_report.markdown(res, 0.25, "given with --target") == expected
    assert tta_report.default_target(res, 0.05) == pytest.approx(0.15)
    # within two standard errors of pi_0 (0.1 + 2 x 0.02): said beside the target
    near = tta_report.markdown(res, 0.139, "given with --target")
    assert "is about 0.020, so a crossing this close to pi_0 may be noise." in near
    assert "may be noise" not in tta_report.markdown(res, 0.14, "given with --target")
    # a summary without its machine (written by hand, or cut) still reads
    bare = replace(res, provenance={"date": "d", "commit": "c", "command": "x"})
    assert "Machine: ?, ? cores, load average ? at the end." in tta_report.markdown(bare, 0.25, "given")
    assert tta_report._median([]) == "-"


def test_the_report_gives_the_interval_where_two_seeds_pair():
    times = [(4.0, 9.0), (5.0, 8.0), (3.0, 9.5)]  # (async, trl) per seed
    curves = [Curve(system, seed, [0, 10], [0.0, t], [0.1, 0.5])
              for seed, pair in enumerate(times) for system, t in zip(("async", "trl"), pair, strict=True)]
    md = tta_report.markdown(_bench(curves, []), 0.3, "given")
    assert f"| trl | {compare(curves, 0.3, 'trl').interval.fmt()} | 3 | 0 | 0 | 0 |" in md


def test_the_figure_draws_every_run_in_its_system_colour(tmp_path):
    curves = [Curve("async", 0, [0, 10], [0.0, 5.0], [0.1, 0.2]), Curve("async", 1, [0, 10], [0.0, 6.0], [0.1, 0.3]),
              Curve("trl", 0, [0, 10], [0.0, 20.0], [0.1, 0.25])]
    res = _bench(curves, [])
    fig = tta_report.figure(res, 0.22)
    ax = fig.axes[0]
    runs, target = ax.lines[:3], ax.lines[3]
    for line, c in zip(runs, curves, strict=True):
        assert list(line.get_xdata()) == c.wall and list(line.get_ydata()) == c.pass1
        assert line.get_color() == tta_report.COLOURS[c.system]
    assert list(target.get_ydata()) == [0.22, 0.22] and target.get_linestyle() == "--"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["async", "trl", "target 0.220"]
    assert ax.get_xlabel() == "seconds since the run's first generation" and ax.get_ylabel() == "held-out Pass@1"
    assert ax.get_title() == "time to accuracy: stride, 2 seeds"
    assert tuple(fig.get_size_inches()) == (7.0, 4.5)
    assert all(line.get_marker() == "." for line in runs) and target.get_color() == "grey"
    out = tmp_path / "a" / "b" / "tta.png"
    tta_report.plot(res, 0.22, out)
    tta_report.plot(res, 0.22, out)  # again over the same file
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_command_names_its_systems_and_split_as_the_bench_does():
    assert bench_tta.SYSTEMS == tta.SYSTEMS and bench_tta.SPLIT == tta.SPLIT


def test_a_report_of_a_damaged_or_foreign_summary_names_the_file(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    record = json.loads(_bench([Curve("async", 0, [0, 10], [0.0, 4.0], [0.1, 0.9])], []).to_json())
    mistyped = {**record, "curves": [{**record["curves"][0], "pass1": ["0.1", "0.9"]}]}
    for text in ("{not json", json.dumps({"date": "x"}), json.dumps({**json.loads(_bench([], []).to_json()),
                                                                    "curves": [{"system": "async"}]}),
                 json.dumps(mistyped), json.dumps({**record, "base_pass1": float("nan")}),
                 *(json.dumps({**record, "curves": [{**record["curves"][0], **change}]}) for change in (
                     {"system": "async | x"}, {"steps": [0], "wall": [0.0], "pass1": [0.1]},
                     {"wall": [0.0]}, {"steps": [0, 0]}, {"steps": [5, 10]})),
                 "[" * 100_000 + "]" * 100_000):
        (out / "tta.json").write_text(text)
        assert main(["bench", "tta", "-o", str(out), "--report-only"]) == 2
        err = capsys.readouterr().err
        assert f"{out / 'tta.json'} is not a tta.json this version of `bench tta` writes" in err
    good = tmp_path / "elsewhere.json"
    good.write_text(_bench([], []).to_json())
    (out / "tta.json").unlink()
    (out / "tta.json").symlink_to(good)  # a link is not followed, even to a good summary
    assert main(["bench", "tta", "-o", str(out), "--report-only"]) == 2
    assert "a symbolic link, not followed" in capsys.readouterr().err
    (out / "tta.json").unlink()
    (out / "tta.json").write_text(_bench([], []).to_json()[:-1] + " " * tta_data.MAX_BYTES + "}")
    assert main(["bench", "tta", "-o", str(out), "--report-only"]) == 2
    assert f"more than the {tta_data.MAX_BYTES} allowed" in capsys.readouterr().err
    (out / "tta.json").write_text(_bench([Curve("async", 0, [0, 10], [0.0, 4.0], [0.1, 0.9])], []).to_json())
    (out / "tta.md").symlink_to(good)  # the report is not written through a link either
    assert main(["bench", "tta", "-o", str(out), "--report-only"]) == 2
    assert f"{out / 'tta.md'}: a symbolic link, not followed" in capsys.readouterr().err
    assert good.read_text() == _bench([], []).to_json()
    (out / "tta.md").unlink()
    (tmp_path / "theirs").mkdir()
    (out / "plots").symlink_to(tmp_path / "theirs")  # nor is the figure drawn into a linked directory
    assert main(["bench", "tta", "-o", str(out), "--report-only"]) == 2
    assert "a symbolic link, where an output directory belongs" in capsys.readouterr().err
    assert list((tmp_path / "theirs").iterdir()) == []


def test_a_target_at_or_below_pi_0_is_refused(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tta.json").write_text(_bench([Curve("async", 0, [0, 10], [0.0, 4.0], [0.1, 0.9])], []).to_json())
    assert main(["bench", "tta", "-o", str(out), "--report-only", "--target", "0.1"]) == 2
    assert "target 0.100: pi_0's held-out Pass@1 is 0.100, so it must lie in (0.100, 1]" in capsys.readouterr().err
    assert not (out / "tta.md").exists()
    assert main(["bench", "tta", "-o", str(out), "--report-only", "--gain", "0.05"]) == 0
    assert "(pi_0's 0.100 + 0.05, --gain given)" in (out / "tta.md").read_text()
    assert main(["bench", "tta", "-o", str(out), "--report-only"]) == 0  # pi_0's + 0.04
    text = (out / "tta.md").read_text()
    assert "Target: held-out Pass@1 >= 0.140 (pi_0's 0.100 + 0.04, the default gain, fixed before any run)" in text


def test_a_directory_keeps_its_settings_and_fresh_deletes_only_a_bench(tmp_path):
    from dph_async.config import ConfigError, load_config

    out = tmp_path / "out"
    out.mkdir()
    cfg = load_config("grpo", ["learner.steps=40"])
    tta.lock(cfg, 10, out)
    tta.lock(cfg, 10, out)  # the same settings again
    for other, every in ((load_config("grpo", ["learner.steps=41"]), 10), (cfg, 20)):
        with pytest.raises(ConfigError, match="made with other settings"):
            tta.lock(other, every, out)
    # A shared directory's links are not followed: the lock is neither read nor written through one.
    victim = tmp_path / "victim.json"
    victim.write_text("theirs")
    saved = (out / tta.CONFIG_FILE).read_text()
    (out / tta.CONFIG_FILE).unlink()
    (out / tta.CONFIG_FILE).symlink_to(victim)
    with pytest.raises(UnsafeFile, match="a symbolic link, not followed"):
        tta.lock(cfg, 10, out)
    assert victim.read_text() == "theirs"
    (out / tta.CONFIG_FILE).unlink()
    (out / tta.CONFIG_FILE).write_text(saved)
    for name in ("rl/async-seed0", "base_model", "plots"):
        (out / name).mkdir(parents=True)
    (out / "tta.json").write_text("{}")
    (out / "keep.txt").write_text("not the bench's")
    tta.clear(out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    with pytest.raises(ConfigError, match=r"holds no tta_config\.json"):
        tta.clear(out)  # no longer a bench's directory: nothing deleted
    assert (out / "keep.txt").is_file()
    tta.clear(tmp_path / "missing")  # nothing there: nothing to do


@pytest.mark.parametrize("argv, words", [
    (["--every", "0"], "--every must be >= 1"),
    (["--target", "1.5"], "--target is a Pass@1 in (0, 1]"),
    (["--gain", "0"], "--gain is a rise of Pass@1 in (0, 1)"),
    (["--gain", "1"], "--gain is a rise of Pass@1 in (0, 1)"),
    (["--seeds", "1", "1"], "--seeds names one twice: 1 1"),
    (["--systems", "async", "trl", "async"], "--systems names one twice"),
    (["--report-only"], "no "),
    (["--steps", "5", "--every", "10"], "is fewer than --every"),
    (["--set", "model.path=m", "--set", "task.data=d.parquet", "--set", "task.test_data.bird_dev=t.parquet"],
     "give its prompts as task.test_data.in_domain=PATH (given: bird_dev)"),
])
def test_the_command_refuses_what_cannot_run(tmp_path, capsys, argv, words):
    assert main(["bench", "tta", "-o", str(tmp_path / "out"), *argv]) == 2
    assert words in capsys.readouterr().err


def test_the_sampling_error_of_an_evaluation_is_the_binomial_one_on_its_prompts(tmp_path):
    from dph_async.runtime.evaluate import PromptResult, SplitResult, write_results

    rng = random.Random()
    n = rng.choice([4, 8, 16])
    correct = [rng.randint(0, n) for _ in range(rng.randint(2, 40))]
    prompts = [PromptResult(str(i), c, min(c, 1), False) for i, c in enumerate(correct)]
    split = SplitResult("in_domain", len(prompts), 0.0, {1: statistics.fmean(c / n for c in correct)}, 0.0, 0.0, 0.0,
                        samples=n, per_prompt=prompts)
    write_results({"in_domain": split}, tmp_path / "e.json")
    # the variance of a prompt's share is p(1-p)/n; of the mean over N prompts, the sum over N^2
    variance = sum((c / n) * (1 - c / n) / n for c in correct) / len(correct) ** 2
    assert tta._se(tmp_path / "e.json") == pytest.approx(math.sqrt(variance))
    assert tta._pass1(tmp_path / "e.json") == pytest.approx(statistics.fmean(c / n for c in correct))


def test_the_docs_render_a_summary_at_its_default_target(tmp_path):
    from dph_async.tools.rendered_docs import Context, render

    curves = [Curve("async", 0, [0, 10], [0.0, 4.0], [0.1, 0.3]), Curve("trl", 0, [0, 10], [0.0, 9.0], [0.1, 0.2])]
    (tmp_path / "t.json").write_text(_bench(curves, []).to_json())
    text, changed = render("<!-- rendered: tta t.json -->\n<!-- end rendered -->\n",
                           Context(tmp_path, tmp_path / "a.md", write=True))
    body = "\n".join(text.splitlines()[1:-1])
    assert changed and body.startswith("Target: held-out Pass@1 >= 0.140 (pi_0's 0.100 + 0.04).\n\n#### Time to target")
    # async at 0.1 + 0.04 / 0.2 x 4 s = 0.8 s; trl at 0.4 x 9 s = 3.6 s
    assert "| async | 1 of 1 | 0.8 |" in body and "| trl | 1 of 1 | 3.6 |" in body
    assert body.endswith(tta_report.tables(_bench(curves, []), 0.14).rstrip("\n").replace("## ", "#### ").split(
        "#### Time to target", 1)[1])
    with pytest.raises(ValueError, match=r"tta JSON: 1 argument\(s\), got 2"):
        render("<!-- rendered: tta t.json u.json -->\n<!-- end rendered -->\n",
               Context(tmp_path, tmp_path / "a.md", write=False))
