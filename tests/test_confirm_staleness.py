"""The pre-registered staleness test (docs/preregistration.md, design 2): what binds, each reading's
edges and precedence, coupled's reading at 99%, throughput ratios against their float64 closed form
(not judged while a cell is resumed), a missing seed named and never silently skipped, the best fixed
eta by geometric mean among binding ones, S1's and S2's verdicts, refused rows, and the command.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from dph_async.cli.main import main
from dph_async.stats import t_critical
from dph_async.tools.ablate import confirm_staleness as cs
from dph_async.tools.ablate.seeds import SeedRow

SEEDS = list(cs.SEEDS)
NOISE = np.array([-2.0, -1.0, 0.0, 1.0, 2.0])


def diffs(lower: float, mean: float, level: float = 0.95) -> np.ndarray:
    """Five paired differences with this mean whose `level` interval starts at `lower`."""
    se_unit = NOISE.std(ddof=1) / math.sqrt(5)
    return mean + NOISE * (mean - lower) / (t_critical(4, 1 - level) * se_unit)


def cell(eta, corr: str, seed: int, p1: float, rate: float = 10.0, stale: float | None = None,
         largest: float | None = None, resumed: bool = False) -> SeedRow:
    metrics = {"in_domain/pass@1": p1, "samples": rate * 50.0, "wall_s": 50.0}
    if eta != "auto":
        metrics["staleness_mean"] = float(eta) if stale is None else stale
        metrics["staleness_max"] = float(eta) if largest is None else largest
    return SeedRow(f"eta{eta}-{corr}-seed{seed}", f"eta{eta}-{corr}", "grpo", seed, 0.0, 0.0, "embedded", 0.0, 100,
                   "f00dfeedbeef", "c", "d", 1.0, resumed, metrics)


def sweep(p1: dict | None = None, rate: dict | None = None, kw: dict | None = None) -> list[SeedRow]:
    """Every (eta, correction) at Pass@1 0.5 and 10 samples/s unless given: p1[(eta, corr)] and
    rate[(eta, corr)] are per-seed arrays, kw[(eta, corr)] `cell`'s keywords."""
    p1, rate, cells_kw = p1 or {}, rate or {}, kw or {}
    rows = []
    for corr in ("behavior", "decoupled"):
        for eta in (*cs.ETAS, "auto"):
            ps = p1.get((eta, corr), np.full(5, 0.5))
            rs = rate.get((eta, corr), np.full(5, 10.0))
            kw = cells_kw.get((eta, corr), {})
            rows += [cell(eta, corr, s, float(ps[i]), float(rs[i]), **kw) for i, s in enumerate(SEEDS)]
    return rows


@pytest.mark.parametrize(("stale", "largest", "bound"), [(3.0, 4.0, True), (2.99, 4.0, False), (4.0, 3.0, False)])
def test_eta_binds_when_every_seed_reaches_three_quarters_of_it_and_eta_itself(stale, largest, bound):
    rows = sweep(kw={(4, "decoupled"): {"stale": stale, "largest": largest}})
    assert cs.binds(rows, 4, "decoupled") is bound
    assert cs.read(rows, 4, "decoupled").outcome == ("keeps" if bound else "not judged: did not bind")
    one_short = [r for r in rows if not (r.group == "eta4-decoupled" and r.seed == 204)]
    one_short = [replace(r, metrics={**r.metrics, "staleness_mean": 1.0}) if r.cell == "eta4-decoupled-seed203"
                 else r for r in one_short]
    assert cs.binds(one_short, 4, "decoupled") is False  # one seed of four below the share


@pytest.mark.parametrize(("lower", "mean", "outcome"), [
    (-0.029, 0.0, "keeps"), (-0.031, 0.0, "undecided"), (-0.025, -0.015, "keeps"),  # lower but within: keeps
    (-0.04, -0.03, "degrades"), (-0.031, -0.02, "degrades"), (-0.04, 0.0, "undecided")])
def test_a_reading_is_exclusive_with_its_edges(lower, mean, outcome):
    rows = sweep({(2, "decoupled"): 0.5 + diffs(lower, mean)})
    r = cs.read(rows, 2, "decoupled")
    assert (r.low, r.delta) == pytest.approx((lower, mean), abs=1e-12) and r.outcome == outcome
    assert r.high == pytest.approx(2 * mean - lower, abs=1e-12)


def test_a_missing_seed_is_named_and_leaves_what_needs_it_not_judged():
    """Deleting a seed's row must never change a verdict silently: the reading, binding and S2 that
    need it say which seed is missing."""
    rows = [r for r in sweep() if not (r.group == "eta4-decoupled" and r.seed == 204)]
    assert cs.read(rows, 4, "decoupled").outcome == "not judged: seed 204 missing"
    assert cs.binds(rows, 4, "decoupled") is False
    assert cs.s1_parts(rows)["(i)"] is None and cs.s1_verdict(cs.s1_parts(rows)).startswith("not judged: (i)")
    assert cs.s2_verdict(rows) == "not judged: decoupled eta 4 lacks seeds"
    no16 = [r for r in sweep() if r.group != "eta16-decoupled"]
    assert cs.s2_verdict(no16) == "not judged: decoupled eta 16 lacks seeds"
    base = [r for r in sweep() if not (r.group == "eta0-behavior" and r.seed == 200)]
    assert cs.read(base, 2, "behavior").outcome == "not judged: seed 200 missing"


@pytest.mark.parametrize(("change", "says"), [
    ({"wall_s": 0.0}, "wall_s 0.0 is not a positive time"), ({"wall_s": None}, "no wall_s"),
    ({"in_domain/pass@1": None}, "no in_domain/pass@1"), ({"staleness_max": None}, "no staleness_max")])
def test_a_cell_without_the_figures_its_verdicts_read_is_refused(change, says):
    rows = sweep()
    metrics = {k: v for k, v in {**rows[7].metrics, **change}.items() if v is not None}
    rows[7] = replace(rows[7], metrics=metrics)
    with pytest.raises(ValueError, match=says):
        cs.verdict("embedded", rows)


def test_coupled_degrades_on_its_99_percent_interval():
    """Coupled at 95% degrades but not at 99%: S1 (ii) fails; at 99% too: it holds."""
    for upper99, part in [(0.001, False), (-0.001, True)]:
        d = diffs(-0.05, (upper99 - 0.05) / 2, level=0.99)  # 99% interval [-0.05, upper99]
        rows = sweep({(8, "behavior"): 0.5 + d})
        assert cs.read(rows, 8, "behavior").outcome == "degrades"
        assert cs.s1_parts(rows)["(ii)"] is part


def test_the_throughput_ratio_is_the_geometric_mean_of_paired_ratios_without_resumed_cells():
    rng = np.random.default_rng()
    fast, slow = rng.uniform(12, 16, 5), rng.uniform(8, 10, 5)
    rows = sweep(rate={(4, "decoupled"): fast, (0, "decoupled"): slow})
    ratio = cs.throughput_ratio(rows, (4, "decoupled"), (0, "decoupled"))
    logs = np.log(fast / slow)
    half = t_critical(4) * logs.std(ddof=1) / math.sqrt(5)
    assert (ratio.ratio, ratio.low, ratio.high) == pytest.approx(
        (math.exp(logs.mean()), math.exp(logs.mean() - half), math.exp(logs.mean() + half)), rel=1e-12)
    resumed = [replace(r, resumed=True) if r.cell == "eta4-decoupled-seed200" else r for r in rows]
    assert cs.throughput_ratio(resumed, (4, "decoupled"), (0, "decoupled")) is None  # until run again
    assert cs.s1_parts(resumed)["(iii)"] is None
    assert cs.s1_parts(rows)["(iii)"] is True
    assert cs.s1_parts(sweep(rate={(4, "decoupled"): slow, (0, "decoupled"): slow * 1.01}))["(iii)"] is False


def test_s1_verdicts():
    degrade = 0.5 + diffs(-0.08, -0.05, level=0.99)
    shaped = sweep({(16, "behavior"): degrade}, rate={(4, "decoupled"): np.array([12.0, 13, 12.5, 14, 12])})
    assert cs.verdict("embedded", shaped).s1 == "reproduced"
    flat = sweep()  # every rate equal: (iii) fails; nothing degrades: (ii) fails
    assert cs.verdict("embedded", flat).s1 == "partly: (i)"
    unbound = sweep({(16, "behavior"): degrade}, kw={(4, "decoupled"): {"stale": 1.0}})
    v = cs.verdict("embedded", unbound)
    assert v.s1 == "not judged: (i), (iii)" and v.parts["(ii)"] is True
    worse = sweep({(2, "decoupled"): 0.5 + diffs(-0.1, -0.06)})
    assert cs.verdict("embedded", worse).s1 == "not reproduced"


def test_s2_takes_the_best_binding_fixed_eta_by_geometric_mean():
    """eta 8's rates (1, 100, ...) have the higher arithmetic mean, eta 4's the higher geometric one; eta
    16 is fastest but does not bind."""
    r4, r8 = np.array([20.0, 20, 20, 20, 20]), np.array([1.0, 100, 1, 1, 1])
    rates = {(4, "decoupled"): r4, (8, "decoupled"): r8, (16, "decoupled"): np.full(5, 50.0),
             ("auto", "decoupled"): r4 * 0.95}
    rows = sweep(rate=rates, kw={(16, "decoupled"): {"stale": 2.0}})
    assert cs.best_fixed(rows) == 4
    assert cs.s2_verdict(rows).startswith("passes (Pass@1 − eta 1's lower end +0.0 points; throughput 0.95x eta 4's")
    rates[("auto", "decoupled")] = r4 * 0.85
    assert cs.s2_verdict(sweep(rate=rates, kw={(16, "decoupled"): {"stale": 2.0}})).startswith("fails")
    lower = sweep({("auto", "decoupled"): 0.5 + diffs(-0.031, 0.0)}, rate=rates)
    assert cs.s2_verdict(lower).startswith("fails (Pass@1 − eta 1's lower end -3.1")
    assert cs.s2_verdict([r for r in rows if not r.group.startswith("etaauto")]) == "not judged: no auto cells"


def test_rows_that_cannot_be_the_designs_are_refused():
    rows = sweep()
    for bad, says in [([replace(rows[0], mode="js_low_var")], "objective js_low_var"),
                      ([replace(rows[0], steps=50)], "50 steps"), ([replace(rows[0], task="digit_sets")], "task"),
                      ([rows[0], rows[0]], "embedded: group eta0-behavior has seed 200 twice")]:
        with pytest.raises(ValueError, match=says):
            cs.verdict("embedded", bad)


def test_only_the_pre_registered_seeds_count():
    rows = [*sweep(), cell(2, "decoupled", 205, 0.0)]
    assert cs.read(rows, 2, "decoupled").delta == 0.0 and cs.read(rows, 2, "decoupled").seeds == 5


def test_the_command_reads_one_sweep_per_task(tmp_path, capsys):
    fast = np.array([12.0, 13, 12.5, 14, 12])
    rows = sweep({(16, "behavior"): 0.5 + diffs(-0.08, -0.05, level=0.99)},
                 rate={(4, "decoupled"): fast, ("auto", "decoupled"): fast})
    metrics = ["in_domain/pass@1", "samples", "wall_s", "staleness_mean", "staleness_max"]
    lines = ["cell,group,mode,seed,coeff,share,task,pg_share,steps,base,commit,date,load,resumed," + ",".join(metrics)]
    lines += [f"{r.cell},{r.group},{r.mode},{r.seed},0,0,{r.task},0,100,{r.base},c,d,{r.load},0,"
              + ",".join(repr(r.metrics[m]) if m in r.metrics else "" for m in metrics) for r in rows]
    (tmp_path / "seeds.csv").write_text("\n".join(lines) + "\n")
    assert main(["ablate", "confirm", "--design", "staleness", "--task", "embedded", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "- **embedded**: S1 reproduced ((i) holds, (ii) holds, (iii) holds); S2 auto passes" in out
    assert "| embedded | behavior | 16 | yes | 16.00 | -5.0 [" in out
    assert main(["ablate", "confirm", "--design", "staleness", "--task", "embedded", str(tmp_path),
                 str(tmp_path)]) == 2
    assert "the staleness design takes 1 sweep(s), got 2" in capsys.readouterr().err


def pi0(base: str = "f00dfeedbeef") -> SeedRow:
    return SeedRow("pi_0", "pi_0", "base", 0, 0.0, 0.0, "embedded", 0.0, 100, base, "", "", None, False,
                   {"in_domain/pass@1": 0.4})


def test_pi_0s_row_is_taken_as_it_is_and_every_other_row_checked():
    """pi_0's row has no run figures and is not checked for them; a row after it still is; two
    fingerprints are two pi_0s; a wall time under one second is a time."""
    rows = [pi0(), *sweep()]
    assert cs.verdict("embedded", rows).task == "embedded"
    last = rows[-1]
    with pytest.raises(ValueError, match=r"cell etaauto-decoupled-seed204: no samples, wall_s"):
        cs.verdict("embedded", [*rows[:-1], replace(last, metrics={"in_domain/pass@1": 0.5})])
    with pytest.raises(ValueError, match=r"embedded: the rows start from more than one pi_0 \(base fingerprints "
                                         r"differ\)"):
        cs.verdict("embedded", [pi0("0123456789ab"), *sweep()])
    short = [replace(r, metrics={**r.metrics, "wall_s": 0.5, "samples": 5.0}) for r in sweep()]
    assert cs.verdict("embedded", short).s1 == "partly: (i)"


def test_every_field_of_a_reading_and_every_message_names_what_it_is():
    rows = [r for r in sweep() if not (r.group == "eta2-decoupled" and r.seed in (203, 204))]
    assert cs.read(rows, 2, "decoupled") == cs.Reading("decoupled", 2, None, None, None, 3,
                                                       "not judged: seed 203, 204 missing")
    unbound = sweep(kw={(8, "behavior"): {"stale": 1.0}})
    assert cs.read(unbound, 8, "behavior") == cs.Reading("behavior", 8, None, None, None, 5,
                                                         "not judged: did not bind")
    r = cs.read(sweep({(1, "behavior"): 0.5 + diffs(-0.02, 0.0)}), 1, "behavior")
    assert (r.correction, r.eta, r.seeds, r.outcome) == ("behavior", 1, 5, "keeps")
    assert cs.binds(sweep(kw={(1, "decoupled"): {"stale": 0.7}}), 1, "decoupled") is False


def test_the_throughput_ratio_pairs_only_seeds_both_sides_have():
    rows = [r for r in sweep() if not (r.group == "eta0-decoupled" and r.seed == 202)]
    assert cs.throughput_ratio(rows, (4, "decoupled"), (0, "decoupled")) is None
    # wall time varies: samples / wall_s, not their product
    rates = {(4, "decoupled"): np.array([12.0, 13, 12.5, 14, 12])}
    def wall(r: SeedRow) -> float:  # seconds differ by seed and between eta 4 and eta 0
        return 25.0 + r.seed - 200 + 7.0 * r.group.startswith("eta4")

    walls = [replace(r, metrics={**r.metrics, "wall_s": wall(r), "samples": r.metrics["samples"] / 50.0 * wall(r)})
             for r in sweep(rate=rates)]
    ratio = cs.throughput_ratio(walls, (4, "decoupled"), (0, "decoupled"))
    assert ratio.ratio == pytest.approx(math.exp(np.log(rates[(4, "decoupled")] / 10.0).mean()), rel=1e-12)


def test_s1_parts_read_exactly_their_etas():
    # (i) is decoupled at 1, 2 and 4: a fall at 1 alone fails it
    assert cs.s1_parts(sweep({(1, "decoupled"): 0.5 + diffs(-0.1, -0.06)}))["(i)"] is False
    # (ii) counts eta 1 too, and is False (not "") when nothing degrades
    assert cs.s1_parts(sweep({(1, "behavior"): 0.5 + diffs(-0.08, -0.05, level=0.99)}))["(ii)"] is True
    assert cs.s1_parts(sweep())["(ii)"] is False
    # a coupled eta that cannot be read, and no degradation elsewhere: (ii) not judged
    gap = [r for r in sweep() if not (r.group == "eta16-behavior" and r.seed == 200)]
    assert cs.s1_parts(gap)["(ii)"] is None
    gap = [r for r in sweep() if not (r.group == "eta16-decoupled" and r.seed == 200)]
    assert cs.s1_parts(gap)["(ii)"] is None
    # (iii) is eta 4 over eta 0, not over eta 1
    fast = np.array([12.0, 13, 12.5, 14, 12])
    assert cs.s1_parts(sweep(rate={(4, "decoupled"): fast, (1, "decoupled"): fast}))["(iii)"] is True
    two = sweep({(2, "decoupled"): 0.5 + diffs(-0.1, -0.06)}, rate={(4, "decoupled"): fast})
    assert cs.s1_verdict(cs.s1_parts(two)) == "partly: (iii)"  # decoupled falls at 2; nothing coupled degrades
    held = {"(i)": True, "(ii)": False, "(iii)": True}
    assert cs.s1_verdict(held) == "partly: (i), (iii)"


def test_s2_edges():
    r = np.full(5, 10.0)
    nothing_binds = sweep(kw={(eta, "decoupled"): {"stale": 0.1} for eta in cs.ETAS[1:]})
    assert cs.best_fixed(nothing_binds) is None
    assert cs.s2_verdict(nothing_binds) == "not judged: no fixed eta binds"
    assert cs.best_fixed(sweep(rate={(1, "decoupled"): r * 2})) == 1
    no1 = [x for x in sweep() if x.group != "eta1-decoupled"]
    assert cs.s2_verdict(no1) == "not judged: decoupled eta 1 lacks seeds"
    two = [x for x in sweep() if x.group not in ("eta1-decoupled", "eta2-decoupled")]
    assert cs.s2_verdict(two) == "not judged: decoupled eta 1, 2 lacks seeds"
    # auto's accuracy is read against decoupled eta 1's (0.4, as auto's), not eta 0's or 2's (0.5)
    level = np.full(5, 0.4) + diffs(-0.01, 0.0)
    against = sweep({(1, "decoupled"): level, ("auto", "decoupled"): level + 0.001})
    assert cs.s2_verdict(against).startswith("passes (Pass@1 − eta 1's lower end +0.1 points")
    lacking = [x for x in sweep() if not (x.group == "etaauto-decoupled" and x.seed == 204)]
    assert cs.s2_verdict(lacking) == "not judged: not judged: seed 204 missing"
    resumed = [replace(x, resumed=True) if x.cell == "etaauto-decoupled-seed200" else x for x in sweep()]
    best = cs.best_fixed(resumed)
    assert cs.s2_verdict(resumed) == (f"not judged: a seed of auto or eta {best} missing or resumed (its "
                                      "throughput is run again)")
    low = sweep({("auto", "decoupled"): 0.5 + diffs(-0.05, -0.01)})
    best = cs.best_fixed(low)
    assert cs.s2_verdict(low) == f"fails (Pass@1 − eta 1's lower end -5.0 points; throughput 1.00x eta {best}'s)"


def table_rows(text: str) -> dict[tuple[str, str], list[str]]:
    out = {}
    for line in text.splitlines():
        cols = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| embedded |"):
            out[(cols[1], cols[2])] = cols
    return out


def test_the_rendered_table_holds_every_reading_ratio_and_note():
    fast = np.array([12.0, 13, 12.5, 14, 12])
    rows = sweep({(16, "behavior"): 0.5 + diffs(-0.26, -0.2, level=0.99),
                  (8, "behavior"): 0.5 + diffs(-0.05, (0.001 - 0.05) / 2, level=0.99),  # degrades at 95%, not 99%
                  (1, "behavior"): 0.5 + diffs(0.01, 0.02), (1, "decoupled"): 0.5 + diffs(0.01, 0.02),  # not eta 0's
                  ("auto", "behavior"): 0.5 + diffs(-0.14, -0.12), ("auto", "decoupled"): 0.5 + diffs(-0.14, -0.12)},
                 rate={(4, "decoupled"): fast, ("auto", "decoupled"): fast},
                 kw={(8, "decoupled"): {"stale": 2.0}})
    rows = [replace(x, load=5.0) if x.cell in ("eta2-behavior-seed201", "eta2-behavior-seed202") else x for x in rows]
    rows = [replace(x, load=4.0) if x.cell == "eta4-behavior-seed201" else x for x in rows]  # at the limit: not above
    rows = [replace(x, resumed=True) if x.cell in ("eta1-behavior-seed203", "eta1-behavior-seed204") else x
            for x in rows]
    rows = [x for x in rows if x.group != "eta2-decoupled"]  # a group with no cell at all
    rows = [x for x in rows if x.cell != "etaauto-behavior-seed204"]  # auto's reading not judged there
    base = replace(pi0(), seed=200, load=9.0, resumed=True)  # pi_0 is never a listed cell, whatever its seed
    text = cs.markdown({"embedded": [base, *rows]})
    lines = text.splitlines()
    assert lines[0] == ("| task | correction | η | binds | staleness (mean) | Pass@1 − η 0's (points, 95%) | "
                        "reading (95%) | reading (99%) | throughput ratio (against η 0; auto: η 1) |")
    got = table_rows(text)
    assert len(got) == 2 * (len(cs.ETAS) - 1) + 2
    for correction in ("behavior", "decoupled"):
        for eta in cs.ETAS[1:]:
            cols = got[(correction, str(eta))]
            r95, r99 = cs.read(rows, eta, correction), cs.read(rows, eta, correction, 0.99)
            ratio = cs.throughput_ratio(rows, (eta, correction), (0, correction))
            have = cs.cells(rows, eta, correction)
            stale = np.mean([x.metrics["staleness_mean"] for x in have.values()]) if have else None
            assert cols[3] == ("yes" if cs.binds(rows, eta, correction) else "no")
            assert cols[4] == ("-" if stale is None else f"{stale:.2f}")
            assert cols[5] == ("-" if r95.delta is None else
                               f"{100 * r95.delta:+.1f} [{100 * r95.low:+.1f}, {100 * r95.high:+.1f}]")
            assert cols[6] == r95.outcome and cols[7] == (r99.outcome if correction == "behavior" else "-")
            assert cols[8] == ("-" if ratio is None else ratio.fmt())
        auto = got[(correction, "auto (against η 1)")]
        a = cs.read(rows, "auto", correction, against=(1, correction))
        ratio = cs.throughput_ratio(rows, ("auto", correction), (1, correction))
        assert auto[3:5] == ["-", "-"] and auto[6:8] == [a.outcome, "-"]
        assert auto[5] == ("-" if a.delta is None else
                           f"{100 * a.delta:+.1f} [{100 * a.low:+.1f}, {100 * a.high:+.1f}]")
        assert auto[8] == ("-" if ratio is None else ratio.fmt())
    assert got[("behavior", "auto (against η 1)")][5:7] == ["-", "not judged: seed 204 missing"]
    assert got[("decoupled", "auto (against η 1)")][5].startswith("-14.0 [")  # against eta 1's +2, not eta 0's
    assert got[("decoupled", "8")][3] == "no" and got[("behavior", "1")][8] == "-"  # unbound; resumed pair
    assert got[("behavior", "8")][6:8] == ["degrades", "undecided"] and got[("decoupled", "2")][4] == "-"
    assert got[("behavior", "16")][5].startswith("-20.0 [")
    n = len(got) + 2  # header, rule, rows
    assert lines[n] == "" and lines[n + 2] == "" and lines[n + 1] == (
        "- **embedded**: S1 not judged: (i) ((i) not judged, (ii) holds, (iii) holds); S2 auto not judged: decoupled "
        "eta 2 lacks seeds.")
    assert lines[n + 3:] == [
        "embedded: 1-minute load above 4 at the end of eta2-behavior-seed201, eta2-behavior-seed202.",
        "embedded: resumed (throughput left out until run again): eta1-behavior-seed203, eta1-behavior-seed204."]
    assert "S1 partly: (i) ((i) holds, (ii) fails, (iii) fails)" in cs.markdown({"embedded": sweep()})
    two = cs.markdown({"embedded": sweep(), "digits": [replace(x, task="digits") for x in sweep()]})
    assert two.count("| task | correction |") == 2 and "- **embedded**:" in two and "- **digits**:" in two


def test_design_4_is_design_2_at_four_mini_batches_and_refuses_the_others_rows():
    """The mini-batch count is the design's: rows of one design are refused by the other, by name."""
    rows = sweep()
    four = [replace(r, mini_batches=4) for r in rows]
    assert cs.verdict("embedded", four, mini_batches=4) == cs.verdict("embedded", rows)
    with pytest.raises(ValueError, match=r"cell eta0-behavior-seed200: learner.mini_batches=1; the design runs 4"):
        cs.verdict("embedded", rows, mini_batches=4)
    with pytest.raises(ValueError, match=r"cell eta0-behavior-seed200: learner.mini_batches=4; the design runs 1"):
        cs.markdown({"embedded": four})
    # the same tables and verdicts; design 4 adds its premise's line (no clip fraction recorded here)
    assert cs.markdown({"embedded": four}, 4).splitlines()[:-2] == cs.markdown({"embedded": rows}).splitlines()


def test_the_clip_fraction_and_mismatch_kl_are_shown_where_the_rows_record_them():
    rng = np.random.default_rng()
    rows = sweep()
    assert "clip fraction" not in cs.markdown({"embedded": rows})
    clips = {r.cell: float(rng.uniform(0, 0.2)) for r in rows}
    kls = {r.cell: float(rng.uniform(-0.01, 0.5)) for r in rows}
    clipped = [replace(r, metrics={**r.metrics, "clip_frac": clips[r.cell], "mismatch_kl_k1": kls[r.cell]})
               for r in rows if r.cell != "eta4-behavior-seed202"]  # one seed's figures absent: the mean of the others
    clipped = [replace(r, metrics={k: v for k, v in r.metrics.items() if k != "clip_frac"})
               if r.group == "eta8-decoupled" else r for r in clipped]  # a group without one of them: "-"
    text = cs.markdown({"embedded": clipped})
    assert text.splitlines()[0].endswith("| throughput ratio (against η 0; auto: η 1) | clip fraction (mean) | "
                                         "mismatch KL (mean) |")
    got = table_rows(text)
    for correction in ("behavior", "decoupled"):
        for eta in (*cs.ETAS[1:], "auto"):
            key = (correction, str(eta) if eta != "auto" else "auto (against η 1)")
            group = [r for r in clipped if r.group == f"eta{eta}-{correction}"]
            have = [clips[r.cell] for r in group if "clip_frac" in r.metrics]
            assert got[key][9] == (f"{np.mean(have):.3f}" if have else "-")
            assert got[key][10] == f"{np.mean([kls[r.cell] for r in group]):.3f}"
    assert got[("decoupled", "8")][9] == "-" and got[("decoupled", "8")][10] != "-"
    only_kl = [replace(r, metrics={k: v for k, v in r.metrics.items() if k != "clip_frac"}) for r in clipped]
    header = cs.markdown({"embedded": only_kl}).splitlines()[0]
    assert header.endswith("(against η 0; auto: η 1) | mismatch KL (mean) |")


def test_the_command_takes_the_trust_region_design(tmp_path, capsys):
    metrics = ["in_domain/pass@1", "samples", "wall_s", "staleness_mean", "staleness_max"]
    for n in (4, 1):
        lines = ["cell,group,mode,seed,coeff,share,task,pg_share,steps,base,commit,date,load,resumed,mini_batches,"
                 + ",".join(metrics)]
        lines += [f"{r.cell},{r.group},{r.mode},{r.seed},0,0,{r.task},0,100,{r.base},c,d,{r.load},0,{n},"
                  + ",".join(repr(r.metrics[m]) if m in r.metrics else "" for m in metrics) for r in sweep()]
        (tmp_path / "seeds.csv").write_text("\n".join(lines) + "\n")
        rc = main(["ablate", "confirm", "--design", "staleness-trust", "--task", "embedded", str(tmp_path)])
        out, err = capsys.readouterr()
        if n == 4:
            assert rc == 0 and "- **embedded**: S1 " in out
        else:
            assert rc == 2 and "learner.mini_batches=1; the design runs 4" in err


def test_files_from_before_the_mini_batch_count_was_recorded_read_as_one(tmp_path):
    from dph_async.tools.ablate.seeds import read_seeds

    path = Path(__file__).resolve().parents[1] / "docs" / "data" / "prereg" / "embedded.csv"  # before the column
    assert {r.mini_batches for r in read_seeds(path)} == {1}
    lines = path.read_text().splitlines()
    for n, says in (("0", "0 is not at least 1"), ("2.5", "'2.5' is not a whole number"), ("x", "'x' is not a whole")):
        (tmp_path / "s.csv").write_text("\n".join([lines[0] + ",mini_batches", lines[1] + f",{n}"]) + "\n")
        with pytest.raises(ValueError, match=f"line 2: mini_batches: {says}"):
            read_seeds(tmp_path / "s.csv")
    (tmp_path / "s.csv").write_text("\n".join([lines[0] + ",mini_batches", lines[1] + ",8"]) + "\n")
    assert read_seeds(tmp_path / "s.csv")[0].mini_batches == 8


def test_design_4s_premise_is_checked_beside_its_verdicts():
    """The clip must act in every decoupled cell with eta >= 1 (auto included); a cell without it, or
    without a record of it, is named, and the verdicts are then not what the design tests."""
    rows = [replace(r, mini_batches=4, metrics={**r.metrics, "clip_frac": 0.02}) for r in sweep()]
    assert cs.premise(rows) == "premise holds: decoupled's clip acted in all 30 decoupled cells with eta >= 1."
    idle = [replace(r, metrics={**r.metrics, "clip_frac": 0.0}) if r.cell in ("eta4-decoupled-seed201",
            "eta0-decoupled-seed200", "eta4-behavior-seed200") else r for r in rows]  # eta 0 and coupled: no matter
    bare = [replace(r, metrics={k: v for k, v in r.metrics.items() if k != "clip_frac"})
            if r.cell == "etaauto-decoupled-seed204" else r for r in idle]
    assert cs.premise(bare) == ("premise not met: the design did not test what it means to; no clip in "
                                "eta4-decoupled-seed201; clip fraction not recorded in etaauto-decoupled-seed204.")
    assert cs.premise([r for r in rows if "decoupled" not in r.group]).startswith("premise not checked")
    two_idle = [replace(r, metrics={**r.metrics, "clip_frac": 0.0}) if r.cell in ("eta1-decoupled-seed200",
                "eta2-decoupled-seed203") else r for r in rows]
    assert cs.premise(two_idle) == ("premise not met: the design did not test what it means to; no clip in "
                                    "eta1-decoupled-seed200, eta2-decoupled-seed203.")
    two_bare = [replace(r, metrics={k: v for k, v in r.metrics.items() if k != "clip_frac"})
                if r.cell in ("eta8-decoupled-seed200", "eta16-decoupled-seed201") else r for r in rows]
    assert cs.premise(two_bare) == ("premise not met: the design did not test what it means to; clip fraction "
                                    "not recorded in eta8-decoupled-seed200, eta16-decoupled-seed201.")
    twos = [replace(r, mini_batches=2) for r in rows]  # any design of more than one update per batch is checked
    assert cs.markdown({"embedded": twos}, 2).splitlines()[-1] == f"embedded: {cs.premise(twos)}"
    assert cs.markdown({"embedded": bare}, 4).splitlines()[-1] == f"embedded: {cs.premise(bare)}"
    assert "premise" not in cs.markdown({"embedded": sweep()})  # design 2 has none


@pytest.mark.parametrize(("value", "says"), [(" 4", "' 4' is not a whole number"), ("+4", "'+4'"), ("04", "'04'"),
                                             ("4_0", "'4_0'"), ("٤", "'٤'"), ("", "'' is not a whole number"),
                                             ("4.0", "'4.0'"), ("0", "0 is not at least 1")])
def test_a_mini_batch_count_is_written_digits_only_and_an_empty_one_is_refused(tmp_path, value, says):
    from dph_async.tools.ablate.seeds import read_seeds

    lines = (Path(__file__).resolve().parents[1] / "docs/data/prereg/embedded.csv").read_text().splitlines()
    (tmp_path / "s.csv").write_text("\n".join([lines[0] + ",mini_batches", lines[1] + f",{value}"]) + "\n")
    with pytest.raises(ValueError, match=re.escape(f"line 2: mini_batches: {says}")):
        read_seeds(tmp_path / "s.csv")


def test_a_bad_field_names_its_column_and_the_file_line_after_a_quoted_line_break(tmp_path):
    from dph_async.tools.ablate.seeds import read_seeds

    lines = (Path(__file__).resolve().parents[1] / "docs/data/prereg/embedded.csv").read_text().splitlines()
    header = lines[0].split(",")
    row = lines[2].split(",")
    quoted = row.copy()
    quoted[header.index("commit")] = '"abc\ndef"'
    bad = row.copy()
    bad[header.index("reward")] = "x"
    (tmp_path / "s.csv").write_text("\n".join([lines[0], ",".join(quoted), ",".join(bad)]) + "\n")
    with pytest.raises(ValueError, match=r"s\.csv, line 4: reward: 'x' is not a number"):  # the third record, line 4
        read_seeds(tmp_path / "s.csv")
    seed = row.copy()
    seed[header.index("seed")] = "2_00"
    (tmp_path / "s.csv").write_text("\n".join([lines[0], ",".join(seed)]) + "\n")
    with pytest.raises(ValueError, match=r"line 2: seed: '2_00' is not a whole number"):
        read_seeds(tmp_path / "s.csv")
