"""Design 3's verdicts (docs/preregistration.md §3) are computed as written: the differences against
float64 closed forms, pi_0's own error carried, Holm over six, every verdict branch, refusals."""

from __future__ import annotations

import csv
import math
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dph_async.cli.main import main
from dph_async.stats import t_critical
from dph_async.tools.ablate import confirm_forgetting as cf
from dph_async.tools.ablate.seeds import BASE, SeedRow, read_seeds

ROOT = Path(__file__).resolve().parents[1]
ZERO_MEAN = np.array([-2.0, -1.0, 0.0, 1.0, 2.0])  # deviations with mean 0 and s.d. sqrt(2.5)


def p_df4(t: float) -> float:
    """Two-sided p of Student's t at df 4 in closed form: F(t) = 1/2 + 3u/4 - u^3/4, u = t / sqrt(t^2 + 4)."""
    u = abs(t) / math.sqrt(t * t + 4.0)
    return 1.0 - 1.5 * u + 0.5 * u ** 3


def row(group: str, seed: int, ood: float, ind: float = 0.5, task: str = "digit_sets", **kw) -> SeedRow:
    metrics = {"ood/pass@1": ood, "in_domain/pass@1": ind}
    if group == BASE:
        metrics["ood/pass@1_se"] = kw.pop("se", 0.01)
    r = SeedRow(f"{group}-seed{seed}", group, "base" if group == BASE else group, seed, 0.0, 0.0, task, 0.0, 400,
                "f00dfeedbeef", "c", "d", None, False, metrics, cf.SHARES[task])
    return replace(r, **kw)


def sweep(g, j, r, base: float = 0.5, se: float = 0.01, task: str = "digit_sets", gi=None, ji=None) -> list[SeedRow]:
    """pi_0 and the three arms' per-seed OOD Pass@1 (in-domain: 0.5 unless given)."""
    flat = [0.5] * 5
    rows = [row(BASE, 0, base, task=task, se=se)]
    for name, ood, ind in (("G", g, gi or flat), ("J", j, ji or flat), ("R", r, flat)):
        rows += [row(cf.ARMS[name], s, float(o), float(i), task) for s, o, i in zip(cf.SEEDS, ood, ind, strict=True)]
    return rows


def test_each_difference_is_its_closed_form_with_pi_0s_error_in_quadrature():
    rng = np.random.default_rng(random.randrange(1 << 30))
    g, j, r = (rng.uniform(0.2, 0.8, 5) for _ in range(3))
    base, se = rng.uniform(0.3, 0.7), rng.uniform(0.005, 0.02)
    t1, t2, t3 = cf.tests_of("digit_sets", sweep(g, j, r, base, se))
    d = g - base
    want_se = math.sqrt(d.var(ddof=1) / 5 + se * se)  # float64, numpy's
    assert (t1.diff.delta, t1.diff.se) == (pytest.approx(d.mean(), abs=1e-12), pytest.approx(want_se, rel=1e-12))
    assert t1.diff.p == pytest.approx(p_df4(d.mean() / want_se), abs=1e-9)
    for t, arm in ((t2, j), (t3, r)):
        diff = arm - g
        want = diff.std(ddof=1) / math.sqrt(5)
        assert (t.diff.delta, t.diff.se) == (pytest.approx(diff.mean(), abs=1e-12), pytest.approx(want, rel=1e-12))
        assert t.diff.p == pytest.approx(p_df4(diff.mean() / want), abs=1e-9)
    assert [t.label for t in (t1, t2, t3)] == ["G − π₀", "J − G", "R − G"]


def shifted_to_p(p: float) -> float:
    """The mean c at which c + ZERO_MEAN / 100 has two-sided p = `p` at df 4 (bisection on the closed form)."""
    se = math.sqrt(2.5) / 100 / math.sqrt(5)
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if p_df4(mid / se) > p else (lo, mid)
    return (lo + hi) / 2


@pytest.mark.parametrize(("p", "rejected"), [(0.05 / 6 * 0.99, True), (0.05 / 6 * 1.01, False)])
def test_holm_runs_over_all_six_even_with_one_task(p, rejected):
    """p just under 0.05 / 6 is rejected, just over is not: over one task's three it would be (0.0167)."""
    g = np.full(5, 0.4)
    j = g + shifted_to_p(p) + ZERO_MEAN / 100
    tests = cf.family({"digit_sets": sweep(g, j, g, base=0.4, se=0.0)})
    assert tests[1].diff.p == pytest.approx(p, rel=1e-6) and tests[1].rejected is rejected
    assert not tests[0].rejected and not tests[2].rejected  # no difference: p = 1


def test_the_verdicts_follow_the_rules_fixed_in_advance():
    g = np.full(5, 0.40) + ZERO_MEAN / 1000
    up = g + 0.08 + ZERO_MEAN / 500
    rows = sweep(g, up, up, base=0.50, se=0.005)
    found = cf.verdicts(cf.family({"digit_sets": rows}), {"digit_sets": rows})
    assert found == {"digit_sets": "F holds; K for JS holds (in-domain bound +0.0); K for reverse KL holds"}
    costly = sweep(g, up, up, base=0.50, se=0.005, ji=list(0.5 - 0.05 + ZERO_MEAN / 100))  # JS 5 points lower
    found = cf.verdicts(cf.family({"digit_sets": costly}), {"digit_sets": costly})["digit_sets"]
    assert found.startswith("F holds; K for JS does not hold (in-domain bound -7.0)")
    level = sweep(g, g + ZERO_MEAN / 100, g, base=0.40, se=0.005)  # no forgetting, no keeping
    found = cf.verdicts(cf.family({"digit_sets": level}), {"digit_sets": level})["digit_sets"]
    assert found.startswith("F does not hold; K for JS does not hold")
    assert found.endswith("K for reverse KL does not hold")


def test_a_large_error_of_pi_0_alone_keeps_forgetting_unproven():
    """The same seeds 10 points under pi_0: with pi_0's error 0.01 rejected, with 0.1 not."""
    g = np.full(5, 0.40) + ZERO_MEAN / 1000
    for se, rejected in ((0.01, True), (0.1, False)):
        assert cf.family({"digit_sets": sweep(g, g, g, base=0.5, se=se)})[0].rejected is rejected


def test_an_arm_missing_a_seed_makes_its_tests_incomplete_at_p_1():
    g = np.full(5, 0.40) + ZERO_MEAN / 1000
    rows = [r for r in sweep(g, g + 0.1, g + 0.1, base=0.5, se=0.001) if r.cell != "js_low_var:0.2-seed303"]
    t1, t2, t3 = cf.family({"digit_sets": rows})
    assert (t1.complete, t2.complete, t3.complete) == (True, False, True)
    assert t2.p == 1.0 and not t2.rejected and t3.rejected and t1.rejected
    assert cf.verdicts([t1, t2, t3], {"digit_sets": rows}) == {"digit_sets": "incomplete"}
    assert "| digit_sets | 2 | J − G |" in cf.markdown({"digit_sets": rows}) and "incomplete" in cf.markdown(
        {"digit_sets": rows})


@pytest.mark.parametrize(("change", "message"), [
    (lambda rows: [replace(rows[1], ood_share=1.0), *rows[2:], rows[0]],
     "OOD share 1, 400 steps, reference_pg_share 0; the design runs digit_sets at OOD share 0.15, 200 or 400 or "
     "800 steps, reference_pg_share 0"),
    (lambda rows: [replace(r, steps=300) for r in rows], "300 steps"),
    (lambda rows: [*rows[:-1], replace(rows[-1], steps=200)], r"ran \[200, 400\] steps; one T per task"),
    (lambda rows: [*rows, replace(rows[1], cell="x")], "has seed 300 twice"),
    (lambda rows: [*rows, replace(rows[1], group="grpo", cell="grpo-seed300")], "group grpo is not an arm"),
    (lambda rows: [replace(rows[0], metrics={"ood/pass@1": 0.5}), *rows[1:]], "pi_0-seed0: no column ood/pass@1_se"),
    (lambda rows: [*rows, replace(rows[0], seed=1)], "2 rows of pi_0"),
    (lambda rows: [*rows[:-1], replace(rows[-1], base="other")], "more than one pi_0"),
    (lambda rows: [*rows[:-1], replace(rows[-1], pg_share=0.375)], "reference_pg_share 0.375; the design runs"),
    (lambda rows: [r if r.group == BASE else replace(r, task="embedded", ood_share=0.1) for r in rows],
     "task embedded"),
])
def test_rows_that_cannot_be_the_designs_are_refused_by_name(change, message):
    g = np.full(5, 0.4)
    with pytest.raises(ValueError, match=message):
        cf.tests_of("digit_sets", change(sweep(g, g, g)))


def test_a_task_outside_the_design_is_refused():
    with pytest.raises(ValueError, match="mytask: not a task of the design"):
        cf.tests_of("mytask", [])


def test_files_from_before_the_share_was_recorded_read_as_share_1(tmp_path):
    rows = read_seeds(ROOT / "docs" / "data" / "prereg" / "embedded.csv")
    assert rows and {r.ood_share for r in rows} == {1.0}
    lines = (ROOT / "docs" / "data" / "prereg" / "embedded.csv").read_text().splitlines()
    for share in ("0", "1.5", "nan"):
        (tmp_path / "s.csv").write_text("\n".join([lines[0] + ",ood_share", lines[1] + f",{share}"]) + "\n")
        with pytest.raises(ValueError, match="line 2: ood_share"):
            read_seeds(tmp_path / "s.csv")


def test_the_command_reads_the_sweep_and_prints_the_family(tmp_path, capsys):
    g = np.full(5, 0.40) + ZERO_MEAN / 1000
    rows = sweep(g, g + 0.08 + ZERO_MEAN / 500, g, base=0.5, se=0.005)
    header = ["cell", "group", "mode", "seed", "coeff", "share", "task", "pg_share", "steps", "base", "commit",
              "date", "load", "resumed", "ood_share", "ood/pass@1", "in_domain/pass@1", "ood/pass@1_se"]
    with (tmp_path / "seeds.csv").open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(header)
        for r in rows:
            out.writerow([r.cell, r.group, r.mode, r.seed, r.coeff, r.share, r.task, r.pg_share, r.steps, r.base,
                          r.commit, r.date, "", "0", r.ood_share, r.metrics["ood/pass@1"],
                          r.metrics["in_domain/pass@1"], r.metrics.get("ood/pass@1_se", "")])
    assert read_seeds(tmp_path / "seeds.csv") == rows
    assert main(["ablate", "confirm", "--design", "forgetting", "--task", "digit_sets", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    se = math.sqrt(np.var(ZERO_MEAN / 1000, ddof=1) / 5 + 0.005 ** 2)
    half = t_critical(4) * se
    lines = text.splitlines()
    assert lines[0] == ("| task | test | arms | OOD Pass@1 difference (points) ± s.e. | 95% interval | p | "
                        "Holm over 6 |  |")
    assert lines[2] == (f"| digit_sets | 1 | G − π₀ | -10.0 ± 0.5 | [{100 * (-0.1 - half):+.1f}, "
                        f"{100 * (-0.1 + half):+.1f}] | {p_df4(-0.1 / se):.4f} | rejected |  |")
    assert lines[4] == "| digit_sets | 3 | R − G | +0.0 ± 0.0 | [+0.0, +0.0] | 1.0000 | not rejected |  |"
    assert lines[5] == "" and len(lines) == 7
    assert "- **digit_sets**: F holds; K for JS holds (in-domain bound +0.0); K for reverse KL does not hold." in text
    assert main(["ablate", "confirm", "--design", "forgetting", "--task", "digit_sets", str(tmp_path),
                 "--figure", str(tmp_path / "f.png")]) == 2
    assert "the forgetting design has none" in capsys.readouterr().err


def test_a_verdict_needs_its_test_rejected_and_its_sign():
    """GRPO 10 points under pi_0 that pi_0's own error (0.1) leaves unproven, JS clearly above GRPO,
    reverse KL one point above with noise: F does not hold, K for JS holds, K for reverse KL does not."""
    g = np.full(5, 0.40) + ZERO_MEAN / 1000
    rows = sweep(g, g + 0.08 + ZERO_MEAN / 500, g + 0.01 + ZERO_MEAN / 20, base=0.5, se=0.1)
    t1, t2, t3 = cf.family({"digit_sets": rows})
    assert (t1.rejected, t1.diff.delta < 0, t2.rejected, t3.rejected, t3.diff.delta > 0) == (False, True, True, False,
                                                                                             True)
    assert cf.verdicts([t1, t2, t3], {"digit_sets": rows}) == {
        "digit_sets": "F does not hold; K for JS holds (in-domain bound +0.0); K for reverse KL does not hold"}
    short = [r for r in rows if r.cell != "js_low_var:0.2-seed303"]
    line = next(x for x in cf.markdown({"digit_sets": short}).splitlines() if x.startswith("| digit_sets | 2 |"))
    assert line.endswith("| not rejected | incomplete |")
