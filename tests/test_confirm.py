"""The pre-registered confirmatory test (docs/preregistration.md) and the raw per-seed data it reads:
seeds.csv written from finished cells and read back exactly; the family's paired differences against
their float64 closed form; Holm over all ten tests even when one task is given; every verdict branch
fixed in advance; an arm of one sweep never taken for the same-named arm of the other; a task without
every seed gets no verdict; the command names a missing file or column.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dph_async.app.ablate import confirm
from dph_async.app.ablate.cells import Cell
from dph_async.app.ablate.results import CellResult, EvalPoint
from dph_async.app.ablate.seeds import SeedRow, read_seeds, write_seeds
from dph_async.app.cli import main
from dph_async.app.evaluate import SplitResult
from dph_async.stats import t_critical, t_two_sided_p

SEEDS = list(confirm.SEEDS)


def split(name: str, p1: float, p16: float, greedy: float = 0.5, distinct: float = 1.5) -> SplitResult:
    return SplitResult(name, 10, greedy, {1: p1, 16: p16}, p1, distinct, 1.0, samples=16)


def test_seeds_csv_holds_each_cells_final_figures_and_provenance(tmp_path):
    rng = np.random.default_rng()
    cells, expect = [], []
    for i, (group, mode) in enumerate([("grpo@d_exp", "grpo@d_exp"), ("js_low_var:200 share25", "js_low_var:200")]):
        p1, p16, g, dist = (float(x) for x in rng.uniform(0, 1, 4))
        ood = float(rng.uniform(0, 1))
        final = {"in_domain": split("in_domain", p1, p16, g, dist), "ood": split("ood", ood, 1.0)}
        base = {s: split(s, 0.1, 0.9) for s in final}
        prov = {"commit": f"abc{i}", "date": "2026-11-29 07:00 UTC", "machine": {"load_avg": [1.234, 1.0, 1.0]}}
        cell = Cell(f"{group}-seed{100 + i}", group, {"mode": mode, "coeff": 200.0 * i, "share": 0.25 * i}, 100 + i,
                    mode)
        reward = [0.1, 0.2, 0.3, 0.4, 0.5 + i]
        cells.append(CellResult(cell, [1, 2, 3, 4, 5], [8.0, 16.0, 24.0, 32.0, 40.0], [1.0, 2.0, 3.0, 4.0, 5.5],
                                reward, [EvalPoint(0, 0.0, 0.0, base), EvalPoint(5, 40.0, 5.5, final)], {}, {}, {},
                                False, prov))
        expect.append((cell, p1, p16, g, dist, ood, 0.5 + i))
    cells.append(CellResult(Cell("old-seed0", "old", {}, 0, "grpo"), [1], [8.0], [1.0], [0.0],
                            [EvalPoint(0, 0.0, 0.0, base), EvalPoint(1, 8.0, 1.0, final)], {}, {}, {}, False))
    write_seeds(tmp_path / "seeds.csv", cells, ["in_domain", "ood"], 16, base_seed=0)
    base_row, *rows = read_seeds(tmp_path / "seeds.csv")
    assert (base_row.cell, base_row.group, base_row.mode, base_row.seed) == ("pi_0", "pi_0", "base", 0)
    assert base_row.metrics == {"in_domain/greedy": 0.5, "in_domain/pass@1": 0.1, "in_domain/pass@16": 0.9,
                                "in_domain/distinct": 1.5, "ood/greedy": 0.5, "ood/pass@1": 0.1, "ood/pass@16": 0.9,
                                "ood/distinct": 1.5}
    assert [r.cell for r in rows] == [c.cell.key for c in cells]
    for row, (cell, p1, p16, g, dist, ood, reward) in zip(rows, expect, strict=False):
        assert (row.group, row.mode, row.seed) == (cell.group, cell.mode, cell.seed)
        assert (row.coeff, row.share) == (cell.factors["coeff"], cell.factors["share"])
        assert row.commit == f"abc{cell.seed - 100}" and row.date.startswith("2026-11-29") and row.load == 1.23
        m = row.metrics
        assert (m["in_domain/pass@1"], m["in_domain/pass@16"], m["in_domain/greedy"]) == (p1, p16, g)
        assert (m["in_domain/distinct"], m["ood/pass@1"], m["ood/pass@16"]) == (dist, ood, 1.0)
        assert m["reward"] == reward and m["wall_s"] == 5.5 and m["samples"] == 40.0
    assert rows[-1].commit == "" and rows[-1].load is None  # a cell from before provenance was recorded


@pytest.mark.parametrize(("text", "says"), [
    ("cell,group\nx,y\n", "no column mode, seed, coeff, share, commit, date, load"),
    ("cell,group,mode,seed,coeff,share,commit,date,load,reward\nc,g,m,one,0,0,,,,0.5\n", "line 2"),
])
def test_a_file_that_is_not_a_sweeps_seeds_is_named(tmp_path, text, says):
    (tmp_path / "seeds.csv").write_text(text)
    with pytest.raises(ValueError, match=says):
        read_seeds(tmp_path / "seeds.csv")


def rows(group: str, p1: dict[int, float], p16: dict[int, float]) -> list[SeedRow]:
    return [SeedRow(f"{group}-seed{s}", group, group.split(":")[0], s, 0.0, 0.0, "c", "d", None,
                    {"in_domain/pass@1": p1[s], "in_domain/pass@16": p16[s]}) for s in p1]


def task(a16, b16, c16, d16, a1=None, c1=None) -> tuple[list[SeedRow], list[SeedRow]]:
    """Two sweeps from per-seed Pass@16 (and Pass@1) of the arms; B and C share their group name."""
    flat = dict.fromkeys(SEEDS, 0.5)
    first = rows("grpo@d_exp", a1 or flat, a16) + rows("js_low_var:0.2", flat, b16)
    second = rows("js_low_var:0.2", c1 or flat, c16) + rows("dpef_pg", flat, d16)
    return first, second


def seeds(values) -> dict[int, float]:
    return dict(zip(SEEDS, map(float, values), strict=True))


def test_the_family_is_paired_differences_by_seed_as_in_closed_form():
    rng = np.random.default_rng()
    arms = {arm: rng.uniform(0.5, 1.0, len(SEEDS)) for arm in "ABCD"}
    p1 = {arm: rng.uniform(0.2, 0.6, len(SEEDS)) for arm in "AC"}
    tasks = {"embedded": task(*(seeds(arms[a]) for a in "ABCD"), seeds(p1["A"]), seeds(p1["C"]))}
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


def test_holm_runs_over_all_ten_tests_even_with_one_task():
    """p = 0.0075 would be rejected by Holm over one task's five (0.05 / 5 = 0.01), not over ten (0.005)."""
    base = np.full(5, 0.6)
    for p, rejected in [(0.0075, False), (0.004, True)]:
        c16 = base + with_p(p)
        tests = confirm.family({"embedded": task(seeds(base), seeds(base), seeds(c16), seeds(c16))})
        assert tests[0].diff.p == pytest.approx(p, rel=1e-6)
        assert tests[0].rejected is rejected
    with pytest.raises(ValueError, match="2 tasks, got 3"):
        confirm.family({name: task(*[seeds(base)] * 4) for name in ("a", "b", "c")})


def verdict(a16, b16, c16, d16, a1=None, c1=None) -> confirm.Verdict:
    tasks = {"embedded": task(*(seeds(x) for x in (a16, b16, c16, d16)), None if a1 is None else seeds(a1),
                             None if c1 is None else seeds(c1))}
    (v,) = confirm.verdicts(confirm.family(tasks), tasks)
    return v


def test_every_verdict_fixed_in_advance():
    a = np.full(5, 0.80)
    up = a + 0.10 + with_p(1e-4)  # far above the control: rejected under Holm
    level = a + with_p(0.5)  # no difference
    p1 = np.full(5, 0.45)
    # C above A, Pass@1 level; C level with D which is above A too: the PG term's.
    v = verdict(a, level, up, up + with_p(0.6) * 0.1, p1, p1 + with_p(0.5) * 0.1)
    assert (v.h1, v.h2) == ("supported", "the PG term's")
    # The same, but C's Pass@1 four points below the control: H1's second half fails.
    assert verdict(a, level, up, up, p1, p1 - 0.04 + with_p(0.5) * 0.01).h1 == "not supported"
    # C above D, D level with A: the divergence adds.
    assert verdict(a, level, up, level, p1, p1).h2 == "the divergence adds"
    # C level with A: H1 not supported; D level too: undecided.
    v = verdict(a, level, level, level, p1, p1)
    assert (v.h1, v.h2) == ("not supported", "undecided")
    # C below A (rejected, wrong side): not supported.
    assert verdict(a, level, a - 0.1 + with_p(1e-4), level, p1, p1).h1 == "not supported"


def test_a_task_without_every_seed_gets_no_verdict():
    a = np.full(5, 0.8)
    first, second = task(*(seeds(x) for x in (a, a, a + 0.1, a)))
    second = [r for r in second if not (r.group == "dpef_pg" and r.seed == 104)]
    tasks = {"embedded": (first, second)}
    tests = confirm.family(tasks)
    assert [t.seeds for t in tests] == [5, 5, 4, 4, 5]
    assert confirm.verdicts(tests, tasks) == [confirm.Verdict("embedded", "incomplete", "incomplete")]


def write_csv(path, sweep: list[SeedRow]) -> None:
    lines = ["cell,group,mode,seed,coeff,share,commit,date,load,in_domain/pass@1,in_domain/pass@16"]
    lines += [f"{r.cell},{r.group},{r.mode},{r.seed},0,0,c,d,,{r.metrics['in_domain/pass@1']!r},"
              f"{r.metrics['in_domain/pass@16']!r}" for r in sweep]
    path.write_text("\n".join(lines) + "\n")


def test_the_command_prints_the_family_and_writes_it(tmp_path, capsys):
    a = np.full(5, 0.8)
    up = a + 0.1 + with_p(1e-4) - with_p(1e-4).mean()  # ten points above, seed by seed noise
    first, second = task(*(seeds(x) for x in (a, a, up, up)))
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
    assert "| embedded | 1 | C − A | Pass@16 | +10.0" in text and "H1 supported on 1 of 1 tasks." in text
    assert "- **embedded**: H1 supported; H2 the PG term's." in text
    assert out.read_text() == text
    assert main(["ablate", "confirm", "--task", "embedded", str(tmp_path / "one"), str(tmp_path / "nope")]) == 2
    assert "nope: no such file (a sweep writes seeds.csv" in capsys.readouterr().err
    write_csv(tmp_path / "two.csv", [SeedRow("x", "dpef_pg", "dpef_pg", 100, 0, 0, "", "", None,
                                             {"in_domain/pass@1": 0.1, "in_domain/pass@16": 0.2})])
    (tmp_path / "two.csv").write_text((tmp_path / "two.csv").read_text().replace(",in_domain/pass@16", ",other"))
    assert main(["ablate", "confirm", "--task", "embedded", str(tmp_path / "one"), str(tmp_path / "two.csv")]) == 2
    assert "no column in_domain/pass@16" in capsys.readouterr().err


def test_p_of_the_constructed_differences_is_the_one_asked_for():
    d = with_p(0.03)
    t = d.mean() / (d.std(ddof=1) / math.sqrt(5))
    assert t_two_sided_p(t, 4) == pytest.approx(0.03, rel=1e-6)


def test_the_secondary_table_matches_arms_to_the_reverse_kl_frontier_at_their_pass_at_1():
    """Each arm's Pass@16 minus the frontier's chord at its Pass@1, the variance every point's Pass@1
    and Pass@16 error carried through the chord, in float64 closed form; an arm outside the frontier's
    Pass@1 range gets no comparison; C is read from the second sweep, B from the first."""
    rng = np.random.default_rng()

    def arm(group: str, x: float, y: float) -> tuple[list[SeedRow], np.ndarray, np.ndarray]:
        p1, p16 = x + rng.normal(0, 0.01, 5), y + rng.normal(0, 0.01, 5)
        return rows(group, seeds(p1), seeds(p16)), p1, p16

    frontier = [arm(f"reverse_kl:{c}", x, y) for c, x, y in [("0.01", 0.40, 0.95), ("0.1", 0.45, 0.92),
                                                             ("1", 0.50, 0.88)]]
    j, b, c, d = arm("js_low_var:200 share25", 0.43, 0.97), arm("js_low_var:0.2", 0.36, 0.96), \
        arm("js_low_var:0.2", 0.47, 0.91), arm("dpef_pg", 0.48, 0.95)
    first = [r for f in frontier for r in f[0]] + j[0] + b[0]
    found = {f.arm: f for f in confirm.secondary({"embedded": (first, c[0] + d[0])})}
    assert found["B"].gap is None  # Pass@1 0.36: left of the frontier's range
    for name, (_, x, y) in {"J": j, "C": c, "D": d}.items():
        se = lambda v: v.std(ddof=1) / math.sqrt(5)  # noqa: E731
        pts = [(f[1], f[2]) for f in frontier]
        lo, hi = (pts[0], pts[1]) if x.mean() <= pts[1][0].mean() else (pts[1], pts[2])
        t = (x.mean() - lo[0].mean()) / (hi[0].mean() - lo[0].mean())
        slope = (hi[1].mean() - lo[1].mean()) / (hi[0].mean() - lo[0].mean())
        var = (se(y) ** 2 + (1 - t) ** 2 * se(lo[1]) ** 2 + t**2 * se(hi[1]) ** 2
               + slope**2 * (se(x) ** 2 + (1 - t) ** 2 * se(lo[0]) ** 2 + t**2 * se(hi[0]) ** 2))
        gap = found[name].gap
        assert gap.delta == pytest.approx(y.mean() - ((1 - t) * lo[1].mean() + t * hi[1].mean()), abs=1e-12)
        assert gap.se == pytest.approx(math.sqrt(var), rel=1e-9)
        assert found[name].pass1.mean == pytest.approx(x.mean(), abs=1e-12)
    # Holm within the table: J, C and D are tested, B is not.
    ps = [found[a].gap.p for a in "JCD"]
    rejected = [p <= 0.05 / (3 - rank) for rank, p in enumerate(sorted(ps))]
    expect = {a: all(rejected[: sorted(ps).index(found[a].gap.p) + 1]) for a in "JCD"}
    assert {a: found[a].rejected for a in "JCD"} == expect
