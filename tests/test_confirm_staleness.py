"""The pre-registered staleness test (docs/preregistration.md, design 2): what binds, each reading's
edges and precedence, coupled's reading at 99%, throughput ratios against their float64 closed form
(not judged while a cell is resumed), a missing seed named and never silently skipped, the best fixed
eta by geometric mean among binding ones, S1's and S2's verdicts, refused rows, and the command.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from dph_async.app.ablate import confirm_staleness as cs
from dph_async.app.ablate.seeds import SeedRow
from dph_async.app.cli import main
from dph_async.stats import t_critical

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
                      ([rows[0], rows[0]], "has seed 200 twice")]:
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
