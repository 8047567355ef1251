"""The pre-registered confirmatory test (docs/preregistration.md, design 1) and the raw per-seed data
it reads: seeds.csv written from finished cells and read back exactly, non-finite values refused;
the family's paired differences against their float64 closed form; Holm over all ten tests, a
missing task, an incomplete task and a test without a standard error each entering as p = 1; every
verdict branch and the Pass@1 bound's edges; only the pre-registered seeds analysed; rows of the
wrong share, task, step count or pi_0, or a seed twice, refused; the secondary gap per seed against
its closed form with Holm over the one table; the command's output and errors.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dph_async.cli.main import main
from dph_async.config import load_config
from dph_async.runtime.evaluate import SplitResult
from dph_async.stats import Difference, holm, t_critical, t_two_sided_p
from dph_async.tools.ablate import confirm
from dph_async.tools.ablate.cells import Cell
from dph_async.tools.ablate.results import CellResult, EvalPoint, Stat, split_metrics
from dph_async.tools.ablate.seeds import SeedRow, fingerprint, read_seeds, write_seeds

SEEDS = list(confirm.SEEDS)
BASE_METRICS = {"in_domain/pass@1": 0.4, "in_domain/pass@16": 0.98, "ood/pass@1": 0.9, "ood/pass@16": 1.0}


def split(name: str, p1: float, p16: float, greedy: float = 0.5, distinct: float = 1.5) -> SplitResult:
    return SplitResult(name, 10, greedy, {1: p1, 16: p16}, p1, distinct, 1.0, samples=16)


def test_seeds_csv_holds_each_cells_final_figures_config_and_provenance(tmp_path):
    rng = np.random.default_rng()
    cfg = load_config("default", ["learner.loss.reference_pg_share=0.375", "task.name=digit_sets", "seed=3"])
    base = {s: split(s, 0.1, 0.9) for s in ("in_domain", "ood")}
    cells, expect = [], []
    for i, (group, mode) in enumerate([("grpo@d_exp", "grpo@d_exp"), ("js_low_var:200 share25", "js_low_var:200")]):
        p1, p16, g, dist, ood = (float(x) for x in rng.uniform(0, 1, 5))
        final = {"in_domain": split("in_domain", p1, p16, g, dist), "ood": split("ood", ood, 1.0)}
        prov = {"commit": f"abc{i}", "date": "2026-11-29 07:00 UTC", "machine": {"load_avg": [1.234, 1.0, 1.0]}}
        cell = Cell(f"{group}-seed{100 + i}", group, {"mode": mode, "coeff": 200.0 * i, "share": 0.25 * i}, 100 + i,
                    mode)
        cells.append(CellResult(cell, [1, 2, 3, 4, 5], [8.0, 16.0, 24.0, 32.0, 40.0], [1.0, 2.0, 3.0, 4.0, 5.5],
                                [0.1, 0.2, 0.3, 0.4, 0.5 + i], [EvalPoint(0, 0.0, 0.0, base),
                                                                EvalPoint(5, 40.0, 5.5, final)],
                                {0: 3, 1: 5, 2 + i: 2, 9: 0}, {}, {}, bool(i), prov))
        expect.append((cell, p1, p16, g, dist, ood, 0.5 + i))
    cells.append(CellResult(Cell("old-seed0", "old", {}, 0, "grpo"), [1], [8.0], [1.0], [0.0],
                            [EvalPoint(0, 0.0, 0.0, base), EvalPoint(1, 8.0, 1.0, final)], {}, {}, {}, False))
    model = tmp_path / "base_model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(rng.bytes(3 * 2**20))
    (model / "config.json").write_text("{}")
    write_seeds(tmp_path / "seeds.csv", cells, ["in_domain", "ood"], 16, cfg, model)
    base_row, *rows = read_seeds(tmp_path / "seeds.csv")
    assert (base_row.cell, base_row.group, base_row.mode, base_row.seed) == ("pi_0", "pi_0", "base", 3)
    assert base_row.metrics == {"in_domain/greedy": 0.5, "in_domain/pass@1": 0.1, "in_domain/pass@16": 0.9,
                                "in_domain/distinct": 1.5, "ood/greedy": 0.5, "ood/pass@1": 0.1, "ood/pass@16": 0.9,
                                "ood/distinct": 1.5}
    assert [r.cell for r in rows] == [c.cell.key for c in cells]
    assert all((r.task, r.pg_share, r.steps, r.base) == ("digit_sets", 0.375, cfg.learner.steps, fingerprint(model))
               for r in [base_row, *rows])
    assert len(base_row.base) == 12 and int(base_row.base, 16) >= 0
    weights = bytearray((model / "model.safetensors").read_bytes())
    weights[-1] ^= 1  # one bit of the last MiB: another pi_0
    (model / "model.safetensors").write_bytes(bytes(weights))
    assert fingerprint(model) != base_row.base
    for row, (cell, p1, p16, g, dist, ood, reward) in zip(rows, expect, strict=False):
        assert (row.group, row.mode, row.seed) == (cell.group, cell.mode, cell.seed)
        assert (row.coeff, row.share) == (cell.factors["coeff"], cell.factors["share"])
        assert row.commit == f"abc{cell.seed - 100}" and row.date.startswith("2026-11-29") and row.load == 1.23
        assert row.resumed is (cell.seed == 101)
        m = row.metrics
        assert (m["in_domain/pass@1"], m["in_domain/pass@16"], m["in_domain/greedy"]) == (p1, p16, g)
        assert (m["in_domain/distinct"], m["ood/pass@1"], m["ood/pass@16"]) == (dist, ood, 1.0)
        assert m["reward"] == reward and m["wall_s"] == 5.5 and m["samples"] == 40.0
        # staleness 0 x3, 1 x5, 2+i x2 (9 x0 never consumed): mean (5 + 2 (2+i)) / 10, max 2+i
        assert m["staleness_mean"] == pytest.approx((5 + 2 * (2 + (cell.seed - 100))) / 10, abs=1e-15)
        assert m["staleness_max"] == 2 + (cell.seed - 100)
    assert rows[-1].commit == "" and rows[-1].load is None  # a cell from before provenance was recorded
    assert "staleness_mean" not in rows[-1].metrics  # no histogram: no figure rather than 0


HEADER = "cell,group,mode,seed,coeff,share,task,pg_share,steps,base,commit,date,load,resumed,in_domain/pass@1"


@pytest.mark.parametrize(("text", "says"), [
    ("cell,group\nx,y\n", "no column mode, seed, coeff, share, task, pg_share, steps, base, commit, date, load, "
                           "resumed"),
    (f"{HEADER}\nc,g,m,one,0,0,embedded,0,100,b,,,,0,0.5\n", "line 2"),
    (f"{HEADER}\nc,g,m,1,0,0,embedded,0,100,b,,,,0,nan\n", "in_domain/pass@1: 'nan' is not a finite number"),
    (f"{HEADER}\nc,g,m,1,0,0,embedded,0,100,b,,,,0,42\n", "in_domain/pass@1: 42.0 is not a share in"),
    (f"{HEADER}\nc,g,m,1,0,0,embedded,0,100,b,,,,0\n", "line 2: 14 fields, the header has 15"),
    (f"{HEADER},in_domain/pass@1\n", "column in_domain/pass@1 given twice"),
    ("\ufeff" + f"{HEADER}\nc,g,m,1,0,0,embedded,0,100,b,,,,0,x\n", "line 2: in_domain/pass@1: 'x' is not a number"),
    (f"{HEADER}\nc,g,m,1,0,0,embedded,0,100,b,,,inf,0,0.5\n", "load: 'inf' is not a finite number"),
    (f"{HEADER}\nc,g,m,1,0,0,embedded,0,1e2,b,,,,0,0.5\n", "line 2: steps: '1e2' is not a whole number"),
    (f"{HEADER}\nc,g,m,{'7' * 60},0,0,embedded,0,100,b,,,,0,0.5\n",
     f"line 2: seed: '{'7' * 40}' is not a whole number"),  # a long value cut at 40 characters
    (f"{HEADER},clip_frac\nc,g,m,1,0,0,embedded,0,100,b,,,,0,0.5,1.5\n", "clip_frac: 1.5 is not a share in"),
])
def test_a_file_that_is_not_a_sweeps_seeds_is_named(tmp_path, text, says):
    (tmp_path / "seeds.csv").write_text(text)
    with pytest.raises(ValueError, match=says):
        read_seeds(tmp_path / "seeds.csv")


def row(group: str, seed: int, p1: float, p16: float, sweep: int, task: str = "embedded") -> SeedRow:
    metrics = BASE_METRICS if group == "pi_0" else {"in_domain/pass@1": p1, "in_domain/pass@16": p16}
    mode = "base" if group == "pi_0" else group.split(" ")[0]
    return SeedRow(f"{group}-seed{seed}", group, mode, seed, 0.0, 0.0, task, confirm.PG_SHARE[sweep], confirm.STEPS,
                   "f00dfeedbeef", "c", "d", None, False, dict(metrics))


def arm_rows(group: str, sweep: int, p1: dict[int, float], p16: dict[int, float], task: str = "embedded"
             ) -> list[SeedRow]:
    return [row(group, s, p1[s], p16[s], sweep, task) for s in p16]


def seeds(values) -> dict[int, float]:
    return dict(zip(SEEDS, map(float, values), strict=True))


def task(a16, b16, c16, d16, a1=None, c1=None, name: str = "embedded") -> confirm.Sweeps:
    """Two sweeps from per-seed Pass@16 (and Pass@1) of the arms; B and C share their group name."""
    flat = dict.fromkeys(SEEDS, 0.5)
    a16, b16, c16, d16 = (x if isinstance(x, dict) else seeds(x) for x in (a16, b16, c16, d16))
    a1 = flat if a1 is None else seeds(a1)
    c1 = flat if c1 is None else seeds(c1)
    base = row("pi_0", 0, 0, 0, 0, name)
    first = [base, *arm_rows("grpo@d_exp", 0, {s: a1[s] for s in a16}, a16, name),
             *arm_rows("js_low_var:0.2", 0, dict.fromkeys(b16, 0.5), b16, name)]
    second = [replace_share(base), *arm_rows("js_low_var:0.2", 1, {s: c1[s] for s in c16}, c16, name),
              *arm_rows("dpef_pg", 1, dict.fromkeys(d16, 0.5), d16, name)]
    return first, second


def replace_share(r: SeedRow) -> SeedRow:
    return replace(r, pg_share=confirm.PG_SHARE[1])


def test_the_family_is_paired_differences_by_seed_as_in_closed_form():
    rng = np.random.default_rng()
    arms = {arm: rng.uniform(0.5, 1.0, len(SEEDS)) for arm in "ABCD"}
    p1 = {arm: rng.uniform(0.2, 0.6, len(SEEDS)) for arm in "AC"}
    tasks = {"embedded": task(*(arms[a] for a in "ABCD"), p1["A"], p1["C"])}
    tests = confirm.family(tasks)
    assert [(t.number, t.a, t.b, t.k) for t in tests] == [(1, "C", "A", 16), (2, "C", "A", 1), (3, "D", "A", 16),
                                                          (4, "C", "D", 16), (5, "B", "A", 16)]
    for t in tests:
        a, b = (p1 if t.k == 1 else arms)[t.a], (p1 if t.k == 1 else arms)[t.b]
        d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
        se = d.std(ddof=1) / math.sqrt(len(d))
        assert t.diff.delta == pytest.approx(d.mean(), abs=1e-12)
        assert t.diff.se == pytest.approx(se, rel=1e-12) and t.diff.df == len(d) - 1 and t.seeds == 5
        lo, hi = t.interval()
        assert (lo, hi) == pytest.approx((d.mean() - t_critical(4) * se, d.mean() + t_critical(4) * se), rel=1e-9)
    # B (first sweep) and C (second) share a group name: each test reads its own sweep's rows.
    assert tests[4].diff.delta == pytest.approx(float(np.mean(arms["B"] - arms["A"])), abs=1e-12)
    assert tests[0].diff.delta == pytest.approx(float(np.mean(arms["C"] - arms["A"])), abs=1e-12)


def with_p(p: float, sign: float = 1.0) -> np.ndarray:
    """Five paired differences whose two-sided t test has exactly p."""
    noise = np.array([-2.0, -1.0, 0.0, 1.0, 2.0]) * 0.01
    t = t_critical(4, p)
    return sign * t * noise.std(ddof=1) / math.sqrt(5) + noise


def test_the_constructed_differences_have_the_p_asked_for():
    d = with_p(0.03)
    assert t_two_sided_p(d.mean() / (d.std(ddof=1) / math.sqrt(5)), 4) == pytest.approx(0.03, rel=1e-6)


def lifted(p: float, name: str = "embedded", base: float = 0.6) -> confirm.Sweeps:
    """C and D above A by differences with p; B level with A."""
    flat = np.full(5, base)
    up = flat + with_p(p)
    return task(flat, flat, up, up, name=name)


def test_holm_runs_over_all_ten_tests_even_with_one_task():
    """p = 0.0075 would be rejected by Holm over one task's five (0.05 / 5 = 0.01), not over ten (0.005)."""
    for p, rejected in [(0.0075, False), (0.004, True)]:
        tests = confirm.family({"embedded": lifted(p)})
        assert tests[0].diff.p == pytest.approx(p, rel=1e-6)
        assert tests[0].rejected is rejected
    with pytest.raises(ValueError, match="2 tasks, got 3"):
        confirm.family({name: lifted(0.5, name) for name in ("a", "b", "c")})


def test_holm_pools_the_two_tasks_tests_in_one_family_of_ten():
    """Tests 1 and 3 of one task at p = 0.004 and of the other at 0.0054: over ten, 0.004 <= 0.05/10 and
    0.0054 <= 0.05/8 after both 0.004s, so all four are rejected; over eleven or twelve they would not be."""
    tests = confirm.family({"embedded": lifted(0.004), "digit_sets": lifted(0.0054, "digit_sets")})
    assert {(t.task, t.number): t.rejected for t in tests if t.number in (1, 3)} == {
        ("embedded", 1): True, ("embedded", 3): True, ("digit_sets", 1): True, ("digit_sets", 3): True}
    assert holm([0.004, 0.004, 0.0054, 0.0054] + [1.0] * 8)[2] is False


def test_an_incomplete_task_or_a_test_without_se_never_eases_another_rejection():
    """embedded's tests 1 and 3 at p = 0.0054 are not rejected over ten (0.0054 > 0.005). A second task
    with tiny p on four seeds, or with one seed of an arm (no p at all), must not change that."""
    alone = confirm.family({"embedded": lifted(0.0054)})
    assert not alone[0].rejected
    first, second = lifted(1e-6, "digit_sets")
    four = (first, [r for r in second if r.seed != 104 or r.group == "pi_0"])
    one = (first, [r for r in second if r.seed == 100 or r.group == "pi_0"])
    for partial in (four, one):
        tests = confirm.family({"embedded": lifted(0.0054), "digit_sets": partial})
        assert not tests[0].rejected and not tests[2].rejected
        other = [t for t in tests if t.task == "digit_sets"]
        assert all(not t.complete and t.holm_p == 1.0 and not t.rejected for t in other)
        assert confirm.verdicts(tests)[1] == confirm.Verdict("digit_sets", "incomplete", "incomplete")
        assert "| digit_sets | 1 |" in confirm.markdown(tests, {"embedded": lifted(0.0054), "digit_sets": partial})
    tests = confirm.family({"embedded": lifted(0.0054), "digit_sets": four})
    assert [t.seeds for t in tests if t.task == "digit_sets"] == [4, 4, 4, 4, 5]
    lo, hi = tests[5].interval()  # four pairs: t at df 3
    assert hi - lo == pytest.approx(2 * t_critical(3) * tests[5].diff.se, rel=1e-12)


@pytest.mark.parametrize("arm", ["A", "C"])
def test_a_task_is_complete_only_when_every_arm_has_every_seed(arm):
    first, second = lifted(0.5)
    sweep, group = confirm.ARMS[arm]
    rows = [first, second]
    rows[sweep] = [r for r in rows[sweep] if not (r.group == group and r.seed == 102)]
    assert confirm.complete(tuple(rows)) is False and confirm.complete((first, second)) is True


def test_seeds_beyond_the_pre_registered_ones_are_not_analysed(capsys):
    first, second = lifted(0.004)
    extra = [row(r.group, 105, 0.0, 0.0, i) for i, rows in enumerate((first, second)) for r in rows
             if r.seed == 100 and r.group != "pi_0"]
    grown = (first + [r for r in extra if r.pg_share == 0.0], second + [r for r in extra if r.pg_share != 0.0])
    assert [t.diff for t in confirm.family({"embedded": grown})] == [t.diff for t in confirm.family(
        {"embedded": (first, second)})]
    assert "embedded: seeds 105 ran too and are not analysed." in confirm.markdown(
        confirm.family({"embedded": grown}), {"embedded": grown})


def verdict(a16, b16, c16, d16, a1=None, c1=None) -> confirm.Verdict:
    (v,) = confirm.verdicts(confirm.family({"embedded": task(a16, b16, c16, d16, a1, c1)}))
    return v


def test_every_verdict_fixed_in_advance():
    a = np.full(5, 0.80)
    up = a + 0.10 + with_p(1e-4)  # far above the control: rejected under Holm
    level = a + with_p(0.5)  # no difference
    p1 = np.full(5, 0.45)
    # C above A, Pass@1 level; C level with D which is above A too: the PG term's.
    v = verdict(a, level, up, up + with_p(0.6) * 0.1, p1, p1 + with_p(0.5) * 0.1)
    assert (v.h1, v.h2) == ("supported", "the PG term's")
    # C above D, D level with A: the divergence adds.
    assert verdict(a, level, up, level, p1, p1).h2 == "the divergence adds"
    # C level with A: H1 not supported; D level too: undecided.
    assert verdict(a, level, level, level, p1, p1) == confirm.Verdict("embedded", "not supported", "undecided")
    # C below A (rejected, wrong side): not supported; C below D (rejected, wrong side), D above A: undecided.
    v = verdict(a, level, a - 0.1 + with_p(1e-4), up, p1, p1)
    assert (v.h1, v.h2) == ("not supported", "undecided")
    # D below A (rejected, wrong side), C level with D: undecided, not the PG term's.
    down = a - 0.1 + with_p(1e-4)
    assert verdict(a, level, down + with_p(0.6) * 0.1, down, p1, p1).h2 == "undecided"
    # Test 1 at p = 0.02: below 0.05 unadjusted, not under Holm over ten: not supported.
    assert verdict(a, level, a + with_p(0.02), level, p1, p1).h1 == "not supported"


def pass1_at(lower: float, mean: float) -> np.ndarray:
    """Five paired differences whose mean is `mean` and whose 95% interval starts at `lower`."""
    noise = np.array([-2.0, -1.0, 0.0, 1.0, 2.0])
    se_unit = noise.std(ddof=1) / math.sqrt(5)
    return mean + noise * (mean - lower) / (t_critical(4) * se_unit)


@pytest.mark.parametrize(("lower", "mean", "h1"), [(-0.029, 0.0, "supported"), (-0.031, 0.0, "not supported"),
                                                   (-0.031, -0.01, "not supported"), (-0.029, -0.02, "supported")])
def test_the_pass_at_1_bound_is_the_intervals_lower_end_against_three_points(lower, mean, h1):
    a, p1 = np.full(5, 0.80), np.full(5, 0.45)
    d = pass1_at(lower, mean)
    (t2,) = [t for t in confirm.family({"embedded": task(a, a, a + 0.1 + with_p(1e-4), a, p1, p1 + d)})
             if t.number == 2]
    assert t2.interval()[0] == pytest.approx(lower, abs=1e-9)
    assert verdict(a, a, a + 0.1 + with_p(1e-4), a, p1, p1 + d).h1 == h1


def test_rows_that_cannot_be_the_designs_are_refused_by_name():
    first, second = lifted(0.5)
    cases = [
        ((first, [replace(r, pg_share=0.0) for r in second]), "second sweep of embedded, cell pi_0-seed0: task "
                                                               "embedded, 100 steps, reference_pg_share 0"),
        (([replace(r, task="digit_sets") for r in first], second), "first sweep of embedded"),
        (([replace(r, steps=50) for r in first], second), "50 steps"),
        (([*first, first[1]], second), "group grpo@d_exp has seed 100 twice"),
        ((first, [replace(r, metrics={**r.metrics, "in_domain/pass@1": 0.41}) if r.group == "pi_0" else r
                  for r in second]), "pi_0 rows differ"),
        (([r for r in first if r.group != "pi_0"], second), "pi_0 rows differ or are missing"),
        (([replace(r, metrics={}) if r.group == "pi_0" else r for r in first],
          [replace(r, metrics={}) if r.group == "pi_0" else r for r in second]), "pi_0 rows differ or are missing"),
        ((first, [replace(r, base="0123456789ab") for r in second]), "do not start from one pi_0"),
        (([replace(r, mode="js_low_var:0.2") if r.group == "grpo@d_exp" else r for r in first], second),
         "run js_low_var:0.2 in group grpo@d_exp"),
    ]
    for sweeps, says in cases:
        with pytest.raises(ValueError, match=says):
            confirm.family({"embedded": sweeps})


def frontier_task(rng, name: str) -> tuple[confirm.Sweeps, dict]:
    """A task whose first sweep also holds the reverse-KL frontier and J; per-seed values returned."""
    def values(x: float, y: float) -> tuple[np.ndarray, np.ndarray]:
        return x + rng.normal(0, 0.01, 5), y + rng.normal(0, 0.01, 5)

    v = {f"reverse_kl:{c}": values(x, y) for c, x, y in [("0.01", 0.40, 0.95), ("0.1", 0.45, 0.92),
                                                         ("1", 0.50, 0.88)]}
    v |= {"J": values(0.43, 0.97), "B": values(0.36, 0.96), "C": values(0.47, 0.91), "D": values(0.48, 0.95),
          "A": values(0.5, 0.85)}
    groups = {"J": "js_low_var:200 share25", "B": "js_low_var:0.2", "A": "grpo@d_exp"}
    first = [row("pi_0", 0, 0, 0, 0, name)]
    for key in ("reverse_kl:0.01", "reverse_kl:0.1", "reverse_kl:1", "J", "B", "A"):
        first += arm_rows(groups.get(key, key), 0, seeds(v[key][0]), seeds(v[key][1]), name)
    second = [replace_share(first[0]), *arm_rows("js_low_var:0.2", 1, seeds(v["C"][0]), seeds(v["C"][1]), name),
              *arm_rows("dpef_pg", 1, seeds(v["D"][0]), seeds(v["D"][1]), name)]
    return (first, second), v


def test_the_secondary_gap_is_paired_by_seed_as_in_closed_form_with_holm_over_the_table():
    """g_s = y_s - (1-t) ya_s - t yb_s - b (x_s - (1-t) xa_s - t xb_s), t and b from the means: its mean is
    the arm's Pass@16 minus the chord at its Pass@1, its se sd(g)/sqrt(5) at df 4; B (left of the
    frontier's range) has none; C is read from the second sweep."""
    rng = np.random.default_rng()
    tasks, values = {}, {}
    for name in ("embedded", "digit_sets"):
        tasks[name], values[name] = frontier_task(rng, name)
    found = {(f.task, f.arm): f for f in confirm.secondary(tasks)}
    ps = []
    for name, v in values.items():
        assert found[(name, "B")].gap is None
        pts = [v[f"reverse_kl:{c}"] for c in ("0.01", "0.1", "1")]
        for arm in "JCD":
            x, y = v[arm]
            lo, hi = (pts[0], pts[1]) if x.mean() <= pts[1][0].mean() else (pts[1], pts[2])
            t = (x.mean() - lo[0].mean()) / (hi[0].mean() - lo[0].mean())
            b = (hi[1].mean() - lo[1].mean()) / (hi[0].mean() - lo[0].mean())
            g = y - (1 - t) * lo[1] - t * hi[1] - b * (x - (1 - t) * lo[0] - t * hi[0])
            gap = found[(name, arm)].gap
            assert gap.delta == pytest.approx(y.mean() - ((1 - t) * lo[1].mean() + t * hi[1].mean()), abs=1e-12)
            assert gap.delta == pytest.approx(g.mean(), abs=1e-12)
            assert gap.se == pytest.approx(g.std(ddof=1) / math.sqrt(5), rel=1e-9) and gap.df == 4
            ps.append(((name, arm), gap.p))
    # Holm over the one table of eight rows (B's two out of range count as p = 1).
    rejected = holm([p for _, p in ps] + [1.0, 1.0])
    assert {key: found[key].rejected for key, _ in ps} == {key: r for (key, _), r in zip(ps, rejected, strict=False)}


def write_csv(path, sweep: list[SeedRow]) -> None:
    lines = ["cell,group,mode,seed,coeff,share,task,pg_share,steps,base,commit,date,load,resumed,in_domain/pass@1,"
             "in_domain/pass@16"]
    lines += [f"{r.cell},{r.group},{r.mode},{r.seed},0,0,{r.task},{r.pg_share},{r.steps},{r.base},c,d,,0,"
              f"{r.metrics['in_domain/pass@1']!r},{r.metrics['in_domain/pass@16']!r}" for r in sweep]
    path.write_text("\n".join(lines) + "\n")


def test_the_command_prints_the_family_and_writes_it(tmp_path, capsys):
    a = np.full(5, 0.8)
    up = a + 0.1 + with_p(1e-4) - with_p(1e-4).mean()  # ten points above, seed by seed noise
    first, second = task(a, a, up, up)
    (tmp_path / "one").mkdir()
    write_csv(tmp_path / "one" / "seeds.csv", first)
    write_csv(tmp_path / "two.csv", second)
    out = tmp_path / "docs" / "confirm.md"
    figure = tmp_path / "figures" / "confirm.png"
    assert main(["ablate", "confirm", "--task", "embedded", str(tmp_path / "one"), str(tmp_path / "two.csv"),
                 "-o", str(out), "--figure", str(figure)]) == 0
    text = capsys.readouterr().out
    png = figure.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 6.5 * 120  # one panel
    assert "| embedded | 1 | C − A | Pass@16 | +10.0" in text and "H1 supported on 1 of 2 tasks (interim" in text
    assert "- **embedded**: H1 supported; H2 the PG term's." in text
    assert "| embedded | 2 | C − A | Pass@1 | +0.0 ± 0.0 |" in text and "bound holds: lower end +0.0 > -3" in text
    assert "| embedded | π₀ | 1 | 40.0 | 98.0 |" in text and "20 cells at c, d to d." in text
    assert out.read_text() == text
    assert main(["ablate", "confirm", "--task", "embedded", str(tmp_path / "one"), str(tmp_path / "nope")]) == 2
    assert "nope: no such file (a sweep writes seeds.csv" in capsys.readouterr().err
    write_csv(tmp_path / "two.csv", second)
    text = (tmp_path / "two.csv").read_text().splitlines()
    text[-1] = text[-1][:text[-1].rindex(",") + 1]  # the last D cell without its Pass@16
    (tmp_path / "two.csv").write_text("\n".join(text) + "\n")
    assert main(["ablate", "confirm", "--task", "embedded", str(tmp_path / "one"), str(tmp_path / "two.csv")]) == 2
    assert "no column in_domain/pass@16" in capsys.readouterr().err
    assert main(["ablate", "confirm", "--task", "digit_sets", str(tmp_path / "one"), str(tmp_path / "one")]) == 2
    assert "first sweep of digit_sets, cell pi_0-seed0: task embedded" in capsys.readouterr().err


def test_holm_rejects_at_exactly_its_threshold():
    assert holm([0.005] + [1.0] * 9) == [True] + [False] * 9
    assert holm([0.0051] + [1.0] * 9) == [False] * 10


def test_a_result_records_the_checkout_it_ran_from():
    import subprocess

    from dph_async.tools.bench import machine
    from dph_async.tools.bench.machine import commit, provenance

    root = Path(machine.__file__).resolve().parents[3]
    if (root / ".git").exists():  # a checkout: its commit
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=root).stdout.strip()
        assert commit() in (head, f"{head}+dirty")
    else:  # a copy of the package outside a checkout (an install, mutation testing's copy): none
        assert commit() is None
    record = provenance()
    assert record["commit"] == commit() and record["machine"]["cores"] >= 1 and record["date"][:2] == "20"


def test_a_task_outside_the_design_is_analysed_as_exploratory_and_not_counted():
    first, second = lifted(1e-4, "mytask")
    tasks = {"mytask": (first, second)}
    tests = confirm.family(tasks)
    assert confirm.verdicts(tests)[0].h1 == "supported (exploratory: not a pre-registered task)"
    assert "H1 supported on 0 of 2 tasks (interim: 0 of 2 tasks complete)." in confirm.markdown(tests, tasks)


def test_the_command_refuses_outputs_that_would_lose_data_before_computing(tmp_path, capsys):
    first, second = lifted(0.5)
    write_csv(tmp_path / "one.csv", first)
    write_csv(tmp_path / "two.csv", second)
    args = ["ablate", "confirm", "--task", "embedded", str(tmp_path / "one.csv"), str(tmp_path / "two.csv")]
    (tmp_path / "dir").mkdir()
    (tmp_path / "afile").write_text("x")
    for extra, says in [(["-o", str(tmp_path / "one.csv")], "one of the inputs; it would be overwritten"),
                        (["-o", str(tmp_path / "dir")], "a directory; give a file"),
                        (["-o", str(tmp_path / "afile" / "x.md")], "a parent is not a directory"),
                        (["--figure", str(tmp_path / "f.csv")], "give a .png file")]:
        assert main([*args, *extra]) == 2
        captured = capsys.readouterr()
        assert says in captured.err and captured.out == ""  # nothing computed or printed
    assert (tmp_path / "one.csv").read_text().startswith("cell,group")
    os.mkfifo(tmp_path / "fifo")
    assert main(["ablate", "confirm", "--task", "embedded", str(tmp_path / "fifo"), str(tmp_path / "two.csv")]) == 2
    assert "fifo: not a regular file" in capsys.readouterr().err
    assert main(["ablate", "confirm", "--design", "staleness", "--task", "embedded", str(tmp_path / "one.csv"),
                 "--figure", str(tmp_path / "f.png")]) == 2
    assert "the staleness design has none" in capsys.readouterr().err


def test_the_fingerprint_is_its_documented_recipe(tmp_path):
    """SHA-256 over each file's name, size, first and last MiB, files in name order: recomputed here,
    for a file of 3 MiB and one under a MiB; a byte in the middle of a large file is not read."""
    import hashlib

    rng = np.random.default_rng()
    (tmp_path / "b.bin").write_bytes(rng.bytes(3 * 2**20))
    (tmp_path / "a.json").write_bytes(rng.bytes(1000))
    (tmp_path / "sub").mkdir()  # not a file: not read

    def recipe() -> str:
        h = hashlib.sha256()
        for f in sorted(p for p in tmp_path.iterdir() if p.is_file()):
            data = f.read_bytes()
            h.update(f"{f.name}\0{len(data)}\0".encode())
            h.update(data[:2**20])
            h.update(data[max(0, len(data) - 2**20):][:2**20])
        return h.hexdigest()[:12]

    assert fingerprint(tmp_path) == recipe()
    big = bytearray((tmp_path / "b.bin").read_bytes())
    big[3 * 2**19] ^= 1  # the middle: outside both MiB read
    (tmp_path / "b.bin").write_bytes(bytes(big))
    assert fingerprint(tmp_path) == recipe()
    big[100] ^= 1  # the first MiB
    (tmp_path / "b.bin").write_bytes(bytes(big))
    assert fingerprint(tmp_path) == recipe()


def test_seeds_csv_holds_the_ood_share_and_each_evaluations_own_error_of_its_pass1(tmp_path):
    """pass@1_se: the s.d. of the per-prompt share of correct samples over the prompts / sqrt(prompts), float64."""
    from dph_async.runtime.evaluate import PromptResult

    rng = np.random.default_rng()
    correct = rng.integers(0, 17, 40)
    res = replace(split("ood", 0.3, 0.9), prompts=40,
                  per_prompt=[PromptResult(str(i), int(c), 1, False) for i, c in enumerate(correct)])
    shares = correct / 16.0
    cell = CellResult(Cell("x-seed5", "x", {}, 5, "grpo"), [1], [8.0], [1.0], [0.5],
                      [EvalPoint(0, 0.0, 0.0, {"ood": res}), EvalPoint(1, 8.0, 1.0, {"ood": res})], {}, {}, {}, False)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w").write_bytes(b"w")
    write_seeds(tmp_path / "seeds.csv", [cell], ["ood"], 16,
                load_config("default", ["task.ood_warm_share=0.15", "learner.mini_batches=3"]), tmp_path / "m")
    for r in read_seeds(tmp_path / "seeds.csv"):
        assert r.ood_share == 0.15 and r.mini_batches == 3
        assert r.metrics["ood/pass@1_se"] == pytest.approx(shares.std(ddof=1) / math.sqrt(40), rel=1e-12)
    one = replace(res, per_prompt=res.per_prompt[:1])
    assert "ood/pass@1_se" not in split_metrics("ood", one, None)  # one prompt: no spread to take


def test_a_data_file_task_never_takes_an_embedded_tasks_name(tmp_path):
    from dph_async.tools.ablate.seeds import task_name

    assert task_name(load_config("default", [f"task.data={tmp_path / 'embedded'}"])) == "data:embedded"
    assert task_name(load_config("default", ["task.name=digit_sets"])) == "digit_sets"


def test_one_cell_without_factors_or_a_date_is_written_with_empty_defaults(tmp_path):
    base = {"in_domain": split("in_domain", 0.1, 0.9)}
    final = {"in_domain": split("in_domain", 0.2, 0.8)}
    cell = CellResult(Cell("x-seed5", "x", {}, 5, "grpo"), [1], [8.0], [1.0], [0.5],
                      [EvalPoint(0, 0.0, 0.0, base), EvalPoint(1, 8.0, 1.0, final)], {}, {}, {}, False,
                      {"commit": "abc"})
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w").write_bytes(b"w")
    write_seeds(tmp_path / "seeds.csv", [cell], ["in_domain"], 16, load_config("default"), tmp_path / "m")
    raw = (tmp_path / "seeds.csv").read_text().splitlines()
    # no commit, date, load or resumed; the OOD share and mini-batch count; no reward, wall time, samples,
    # staleness or diagnostics; the split's figures, without a per-prompt standard error (no per-prompt results)
    assert raw[1].startswith("pi_0,pi_0,base,0,0.0,0.0,embedded,0.0,")
    assert ",,,,,1.0,1,,,,,,,,0.5,0.1,0.9,1.5," in raw[1]
    base_row, row = read_seeds(tmp_path / "seeds.csv")
    assert base_row.ood_share == row.ood_share == 1.0 and base_row.mini_batches == row.mini_batches == 1
    assert (base_row.commit, base_row.date, base_row.load, base_row.resumed) == ("", "", None, False)
    assert (row.coeff, row.share, row.commit, row.date) == (0.0, 0.0, "abc", "")


@pytest.mark.parametrize(("column", "value", "says"), [
    ("in_domain/greedy", "1.5", "in_domain/greedy: 1.5 is not a share in"),
    ("a/b/pass@1", "1.01", "a/b/pass@1: 1.01 is not a share in"),
    *((c, "-1", f"{c}: -1.0 is negative") for c in ("wall_s", "samples", "in_domain/distinct", "staleness_mean",
                                                     "staleness_max")),
])
def test_a_figure_out_of_its_range_is_refused(tmp_path, column, value, says):
    (tmp_path / "s.csv").write_text(f"{HEADER},{column}\nc,g,m,1,0,0,embedded,0,100,b,,,,0,0.5,{value}\n")
    with pytest.raises(ValueError, match=f"{tmp_path / 's.csv'}, line 2: {says}"):
        read_seeds(tmp_path / "s.csv")


def test_the_edges_of_each_range_are_accepted(tmp_path):
    cols = ["in_domain/greedy", "wall_s", "samples", "in_domain/distinct", "staleness_mean", "staleness_max"]
    (tmp_path / "s.csv").write_text(f"{HEADER},{','.join(cols)}\nc,g,m,1,0,0,embedded,0,100,b,,,,0,0.0,1.0,0,0,0,0,0\n")
    (row,) = read_seeds(tmp_path / "s.csv")
    assert row.metrics == {"in_domain/pass@1": 0.0, "in_domain/greedy": 1.0, **dict.fromkeys(cols[1:], 0.0)}


@pytest.mark.parametrize(("text", "says"), [
    ("", "no column cell, group"),
    (f"{HEADER},in_domain/pass@1,x,x\n", "column in_domain/pass@1, x given twice"),
    (f"{HEADER}\nc,g,m,1,inf,0,embedded,0,100,b,,,,0,0.5\n", "coeff: 'inf'"),
    (f"{HEADER}\nc,g,m,1,0,nan,embedded,0,100,b,,,,0,0.5\n", "share: 'nan'"),
    (f"{HEADER}\nc,g,m,1,0,0,embedded,-inf,100,b,,,,0,0.5\n", "pg_share: '-inf'"),
])
def test_every_refusal_names_the_file(tmp_path, text, says):
    (tmp_path / "s.csv").write_text(text)
    with pytest.raises(ValueError, match=f"^{tmp_path / 's.csv'}") as e:
        read_seeds(tmp_path / "s.csv")
    assert says in str(e.value)
    (tmp_path / "s.csv").write_bytes(b"\xff\xfe" + HEADER.encode())
    with pytest.raises(ValueError, match=f"^{tmp_path / 's.csv'}: not a CSV file of UTF-8 text"):
        read_seeds(tmp_path / "s.csv")


def test_a_quoted_field_keeps_its_line_break(tmp_path):
    (tmp_path / "s.csv").write_bytes(f'{HEADER}\r\n"c\r\nd",g,m,1,0,0,embedded,0,100,b,,,,0,0.5\r\n'.encode())
    (row,) = read_seeds(tmp_path / "s.csv")
    assert row.cell == "c\r\nd" and row.metrics == {"in_domain/pass@1": 0.5}


def _test(number: int, delta: float, se: float | None, *, complete: bool = True, rejected: bool = False,
          df: float | None = 4) -> confirm.Test:
    return confirm.Test("embedded", number, "C", "A", 16, Difference(delta, se, df if se is not None else None, True),
                        5, complete, rejected)


@pytest.mark.parametrize(("test", "reads"), [
    (_test(1, 0.02, 0.01, complete=False), "incomplete"),
    (_test(2, 0.02, 0.01, complete=False), "incomplete"),
    (_test(2, 0.02, None), "bound not judged: no interval"),
    # lower end 0.02 - 2.776 * 0.01 = -0.0078
    (_test(2, 0.02, 0.01), "bound holds: lower end -0.8 > -3"),
    # lower end -0.01 - 2.776 * 0.01 = -0.0378
    (_test(2, -0.01, 0.01), "bound fails: lower end -3.8 ≤ -3"),
    (_test(2, -0.2, 0.0), "bound fails: lower end -20.0 ≤ -3"),
    (_test(1, 0.02, 0.01), "level"),
    (_test(1, 0.02, 0.01, rejected=True), "above"),
    (_test(1, -0.02, 0.01, rejected=True), "below"),
    (_test(3, 0.02, 0.0, rejected=True), "above (s.e. 0: the same difference on every seed)"),
    (_test(3, 0.0, 0.0), "level"),
])
def test_each_test_reads_as_its_rule_says(test, reads):
    assert confirm._reads(test) == reads


def test_the_frontier_table_reads_each_gap_and_says_when_it_has_none():
    p1, p16 = Stat(0.45, 0.01, 5), Stat(0.9, 0.02, 5)
    rows = [confirm.AgainstFrontier("embedded", "J", p1, p16, Difference(0.031, 0.01, 4, True), rejected=True),
            confirm.AgainstFrontier("embedded", "B", p1, p16, Difference(-0.05, 0.0, 4, True), rejected=True),
            confirm.AgainstFrontier("digit_sets", "C", p1, p16, Difference(0.01, 0.02, 4, True)),
            confirm.AgainstFrontier("digit_sets", "D", p1, p16, None)]
    lines = confirm._against_table(rows).splitlines()
    assert lines[0] == "| task | arm | seeds | P@1 | P@16 | P@16 − reverse KL's at this P@1 | p | Holm |"
    p_j = t_two_sided_p(0.031 / 0.01, 4)
    assert lines[2:] == [f"| embedded | J | 5 | 45.0 ± 1.0 | 90.0 ± 2.0 | 3.1 ± 1.0 | {p_j:.4f} | above |",
                         "| embedded | B | 5 | 45.0 ± 1.0 | 90.0 ± 2.0 | -5.0 ± 0.0 | 0.0000 | below (s.e. 0: the "
                         "same gap on every seed) |",
                         f"| digit_sets | C | 5 | 45.0 ± 1.0 | 90.0 ± 2.0 | 1.0 ± 2.0 | {t_two_sided_p(0.5, 4):.4f} "
                         "| level |",
                         "| digit_sets | D | 5 | 45.0 ± 1.0 | 90.0 ± 2.0 | outside its Pass@1 range | - | - |"]


def test_a_group_named_with_another_separator_than_a_space_is_refused():
    first, second = lifted(0.5)
    tab = [replace(r, group="grpo@d_exp\tshare25") if r.group == "grpo@d_exp" else r for r in first]
    with pytest.raises(ValueError, match="run grpo@d_exp in group grpo@d_exp\tshare25"):
        confirm.check_task("embedded", (tab, second))
    with pytest.raises(ValueError, match=r"base_model, data, presample and eval directories, copied in$"):
        confirm.check_task("embedded", (first, [replace(r, base="0123456789ab") for r in second]))


def test_the_pass1_bound_fails_at_exactly_its_margin():
    exact = _test(2, -confirm.PASS1_MARGIN, 0.0)
    assert exact.interval() == (-confirm.PASS1_MARGIN, -confirm.PASS1_MARGIN)
    assert confirm.bound_holds(exact) is False
    assert confirm.bound_holds(_test(2, -confirm.PASS1_MARGIN + 1e-9, 0.0)) is True


def test_an_incomplete_task_before_a_complete_one_leaves_its_verdict():
    complete = confirm.family({"digit_sets": lifted(1e-4, "digit_sets")})
    incomplete = [replace(t, task="embedded", complete=False) for t in complete]
    assert confirm.verdicts(incomplete + complete) == [
        confirm.Verdict("embedded", "incomplete", "incomplete"),
        confirm.Verdict("digit_sets", "supported", "the PG term's")]


def test_a_gap_from_one_seed_is_the_arms_pass16_minus_the_chord_without_an_error():
    """One seed a cell: no standard error, the gap is y - ((1 - t) ya + t yb) at the arm's own Pass@1:
    J at (0.43, 0.97) between reverse KL's (0.40, 0.95) and (0.45, 0.92): t = 0.6, the chord 0.932."""
    class Flat:  # the frontier task without its seed-to-seed noise
        def normal(self, loc: float, scale: float, n: int) -> np.ndarray:
            return np.zeros(n)

    (first, second), _ = frontier_task(Flat(), "embedded")
    one = ([r for r in first if r.seed in (0, 100)], [r for r in second if r.seed in (0, 100)])
    (p1, p16), gap = confirm.frontier_gap(one, confirm.SECONDARY["J"])
    assert (p1.mean, p16.mean, p1.se, p16.se) == (0.43, 0.97, None, None)
    assert gap.se is None and gap.delta == pytest.approx(0.97 - (0.4 * 0.95 + 0.6 * 0.92), abs=1e-12)


def test_provenance_names_every_commit_the_date_range_the_load_and_the_resumed_cells():
    def stamp(rows: list[SeedRow]) -> list[SeedRow]:
        return [replace(r, commit="" if r.seed == 100 else "b" if r.seed == 101 else "a",
                        date=f"2026-11-29 0{r.seed - 100}:00 UTC", load=1.0 + (r.seed - 100) / 4,
                        resumed=r.seed == 103) if r.group != "pi_0" else r for r in rows]

    first, second = (stamp(rows) for rows in lifted(0.5))
    extra = row("grpo@d_exp", 105, 0.5, 0.5, 0)  # not a pre-registered seed: never counted
    text = confirm.provenance({"embedded": ([*first, replace(extra, commit="z", resumed=True)], second)})
    assert text == ("20 cells at a, b, unrecorded, 2026-11-29 00:00 UTC to 2026-11-29 04:00 UTC, 1-minute load at "
                    "most 2.0; resumed after an interruption: grpo@d_exp-seed103, js_low_var:0.2-seed103, "
                    "js_low_var:0.2-seed103, dpef_pg-seed103.")
    assert confirm.provenance({"embedded": ([first[0]], [second[0]])}) == "No cell of the pre-registered seeds."


def test_provenance_dates_run_from_the_earliest_to_the_latest_and_are_left_out_when_none_is_recorded():
    first, second = lifted(0.5)
    analysed = [r for r in first + second if r.group != "pi_0"]
    # the k-th analysed row ran on day 25 - k, the first has no date: the range is the sorted dates' ends
    dated = {r.cell + r.group: "" if k == 0 else f"2026-11-{25 - k:02d}" for k, r in enumerate(analysed)}
    stamped = tuple([replace(r, date=dated.get(r.cell + r.group, r.date)) for r in rows] for rows in (first, second))
    assert confirm.provenance({"embedded": stamped}) == "20 cells at c, 2026-11-06 to 2026-11-24."
    undated = tuple([replace(r, date="") for r in rows] for rows in (first, second))
    assert confirm.provenance({"embedded": undated}) == "20 cells at c."


def test_the_interim_line_counts_a_complete_task_beside_an_incomplete_one():
    complete = lifted(1e-4, "digit_sets")
    tests = confirm.family({"digit_sets": complete})
    incomplete = [replace(t, task="embedded", complete=False) for t in tests]
    text = confirm.markdown(incomplete + tests, {"digit_sets": complete})
    assert "H1 supported on 1 of 2 tasks (interim: 1 of 2 tasks complete)." in text


def test_the_tables_show_a_dash_where_a_figure_is_missing():
    first, second = lifted(0.5)
    no_base = [r for r in first if r.group != "pi_0"]
    described = confirm.describe({"embedded": (no_base, second)}).splitlines()
    assert described[2] == "| embedded | π₀ | 1 | - | - | - | - | - | - |"
    lacking = [replace(r, metrics={k: v for k, v in r.metrics.items() if k != "in_domain/pass@1"})
               if r.group == "grpo@d_exp" else r for r in first]
    described = confirm.describe({"embedded": (lacking, second)}).splitlines()
    assert described[3] == "| embedded | A (grpo@d_exp) | 5 | - | 60.0 ± 0.0 | - | - | - | - |"
    nan = _test(1, math.nan, None, rejected=False)
    extra = {"embedded": lifted(0.5)}
    line = confirm.markdown([nan, *confirm.family(extra)[1:]], extra).splitlines()[2]
    assert line == "| embedded | 1 | C − A | Pass@16 | - | - | 5 | - | not rejected | level |"
    one = _test(1, 0.02, None, rejected=True)
    line = confirm.markdown([one, *confirm.family(extra)[1:]], extra).splitlines()[2]
    assert line == "| embedded | 1 | C − A | Pass@16 | +2.0 | - | 5 | - | rejected | above |"
