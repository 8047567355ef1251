"""The frontier sweep's grid and its comparisons (dph_async/tools/ablate/cells.py, frontier.py), on
given figures: the cells a ladder and a share axis make, the rival frontier interpolated at a
group's Pass@1 with its standard error, differences with sqrt(se_1^2 + se_2^2) and their verdicts,
and the table rows that carry them. The sweep itself runs in tests/test_ablate.py's way (slow)."""

from __future__ import annotations

import math
import statistics

import pytest

from dph_async.config import ConfigError
from dph_async.stats import t_two_sided_p
from dph_async.tools.ablate import frontier
from dph_async.tools.ablate.cells import Cell, frontier_sweep, share_ratio
from dph_async.tools.ablate.results import CellResult, Group, Stat


def test_ladder_multiplies_each_reference_coefficient_and_keeps_given_ones():
    sweep = frontier_sweep(["grpo@d_exp", "js_low_var", "reverse_kl", "forward:0.3"], [0.1, 3, 100], [0, 1], 0.125)
    ladder = {(c.factors["mode"], c.factors["coeff"]) for c in sweep.cells}
    assert ladder == {("grpo@d_exp", 0.0), ("js_low_var", 0.02), ("js_low_var", 0.6), ("js_low_var", 20.0),
                      ("reverse_kl", 0.001), ("reverse_kl", 0.03), ("reverse_kl", 1.0), ("forward", 0.3)}
    assert len(sweep.cells) == 2 * len(ladder)
    # Seed-major, so that a sweep stopped early has whole frontiers on its first seeds.
    assert [c.seed for c in sweep.cells] == [0] * len(ladder) + [1] * len(ladder)
    by_key = {c.key: c for c in sweep.cells}
    js = by_key["js_low_var-c0.6-seed1"]
    assert (js.group, js.mode, js.overrides) == ("js_low_var:0.6", "js_low_var:0.6", ("seed=1",))
    # The reference pool's share of the batch: 0.125 reference samples per fresh one is 1/9 of it.
    assert js.factors["share"] == 0.111 and by_key["reverse_kl-c1-seed0"].factors["share"] == 0.0


def test_share_axis_sets_the_reference_ratio_for_each_share():
    sweep = frontier_sweep(["grpo@d_exp"], [1], [4], 0.125, shares=[0.25, 0.5], share_specs=["forward:0.1"])
    shared = [c for c in sweep.cells if c.mode == "forward:0.1"]
    assert [(c.key, c.group, c.factors["share"], c.overrides) for c in shared] == [
        ("forward-c0.1-share25-seed4", "forward:0.1 share25", 0.25, ("seed=4", "replay.reference_ratio=0.333333")),
        ("forward-c0.1-share50-seed4", "forward:0.1 share50", 0.5, ("seed=4", "replay.reference_ratio=1")),
    ]
    for share in (0.11, 0.25, 0.5, 0.9):
        r = share_ratio(share)
        assert r / (1 + r) == pytest.approx(share)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"shares": [0.5], "share_specs": ["reverse_kl:0.1"]}, "reference pool"),
    ({"shares": [1.0], "share_specs": ["forward:0.1"]}, "share of the batch"),
    ({"multipliers": [0.0]}, "multipliers"),
])
def test_bad_grids_are_refused_by_name(kwargs, match):
    args = {"specs": ["forward"], "multipliers": [1.0], "seeds": [0], "base_ratio": 0.125, **kwargs}
    with pytest.raises(ValueError, match=match):
        frontier_sweep(**args)


def test_an_unknown_objective_is_refused():
    with pytest.raises(ConfigError, match="unknown objective"):
        frontier_sweep(["nope"], [1.0], [0], 0.125)


def s(mean: float, se: float | None) -> Stat:
    return Stat(mean, se, 3)


def test_interpolation_between_the_nearest_bracketing_points():
    points = [(s(0.40, 0.01), s(0.95, 0.01)), (s(0.50, 0.01), s(0.85, 0.02)), (s(0.44, 0.01), s(0.90, 0.03))]
    # 0.47 lies between 0.44 and 0.50: t = 0.5, so 0.875 with sqrt(0.25 * 0.03^2 + 0.25 * 0.02^2).
    at = frontier.interpolate(points, 0.47)
    assert at.mean == pytest.approx(0.875)
    assert at.se == pytest.approx(math.sqrt(0.25 * 0.03**2 + 0.25 * 0.02**2))
    assert frontier.interpolate(points, 0.44).mean == pytest.approx(0.90)  # on a point: that point
    assert frontier.interpolate(points, 0.39) is None and frontier.interpolate(points, 0.51) is None
    assert frontier.interpolate(points[:1], 0.40).mean == pytest.approx(0.95)


def test_differences_combine_standard_errors_and_test_at_welchs_df():
    d = frontier.difference(s(0.86, 0.018), s(0.83, 0.015))
    assert d.delta == pytest.approx(0.03) and d.se == pytest.approx(math.sqrt(0.018**2 + 0.015**2))
    # Welch-Satterthwaite with 3 seeds a side: (v1 + v2)^2 / (v1^2 / 2 + v2^2 / 2)
    v1, v2 = 0.018**2, 0.015**2
    assert d.df == pytest.approx((v1 + v2) ** 2 / (v1**2 / 2 + v2**2 / 2)) and d.verdict == "level"
    # 0.05 is 3.5 se at df 4: above; 2.5 se at df 4 is not (p 0.066), though it is beyond two se
    assert frontier.difference(s(0.90, 0.01), s(0.85, 0.01)).verdict == "above"
    assert frontier.difference(s(0.80, 0.01), s(0.85, 0.01)).verdict == "below"
    assert frontier.difference(s(0.8854, 0.01), s(0.85, 0.01)).verdict == "level"
    assert frontier.difference(s(0.80, None), s(0.85, 0.01)).verdict == "one seed: no standard error"


def test_groups_with_the_same_seeds_are_compared_paired():
    a = group("a", "forward", 1.0, 0.1, s(0.5, 0.05), s(0.9, 0.05))
    b = group("b", "grpo@d_exp", 0.0, 0.0, s(0.4, 0.05), s(0.8, 0.05))
    # seed effects shared by both groups cancel in the paired difference
    a.by_seed["in_domain/pass@1"] = {0: 0.45, 1: 0.50, 2: 0.58}
    b.by_seed["in_domain/pass@1"] = {0: 0.36, 1: 0.40, 2: 0.47}
    d = frontier.versus(a, b, "in_domain/pass@1")
    diffs = [0.09, 0.10, 0.11]
    assert d.paired and d.df == 2 and d.delta == pytest.approx(0.10)
    assert d.se == pytest.approx(statistics.stdev(diffs) / math.sqrt(3))
    b.by_seed["in_domain/pass@1"] = {0: 0.36, 1: 0.40, 5: 0.47}  # other seeds: Welch on the means
    assert not frontier.versus(a, b, "in_domain/pass@1").paired


def group(name: str, mode: str, coeff: float, share: float, p1: Stat, p16: Stat, seeds: int = 3) -> Group:
    cells = [CellResult(Cell(f"{name}-seed{i}", name, {}, i, name), [], [], [], [], [], {}, {}, {}, False)
             for i in range(seeds)]
    metrics = {"in_domain/pass@1": p1, "in_domain/pass@16": p16, "in_domain/distinct": s(2.5, 0.1)}
    return Group(name, {"mode": mode, "coeff": coeff, "share": share}, cells, metrics)


def test_each_group_against_the_control_and_the_rival_frontier():
    groups = [
        group("grpo@d_exp", "grpo@d_exp", 0.0, 0.0, s(0.48, 0.019), s(0.83, 0.015)),
        group("js_low_var:2", "js_low_var", 2.0, 0.111, s(0.46, 0.01), s(0.90, 0.01)),
        group("js_low_var:20", "js_low_var", 20.0, 0.111, s(0.38, 0.01), s(0.96, 0.01)),
        group("reverse_kl:1", "reverse_kl", 1.0, 0.0, s(0.40, 0.01), s(0.97, 0.01)),
        group("reverse_kl:0.1", "reverse_kl", 0.1, 0.0, s(0.50, 0.01), s(0.93, 0.01)),
        group("js_low_var:2 share50", "js_low_var", 2.0, 0.5, s(0.45, 0.01), s(0.95, 0.01)),
    ]
    assert [g.name for g in frontier.lines(groups)["reverse_kl"]] == ["reverse_kl:0.1", "reverse_kl:1"]
    assert [g.name for g in frontier.lines(groups)["js_low_var"]] == ["js_low_var:2", "js_low_var:20"]
    out = {c.group: c for c in frontier.compare(groups, "in_domain", 16)}
    assert out["grpo@d_exp"].vs_control is None
    d1, d16 = out["js_low_var:2"].vs_control
    assert (d1.delta, d16.delta) == (pytest.approx(-0.02), pytest.approx(0.07))
    assert d16.se == pytest.approx(math.sqrt(0.01**2 + 0.015**2))
    # Reverse KL at Pass@1 0.46: 0.4 of the way from 0.50 (0.93) to 0.40 (0.97), i.e. 0.946.
    js = out["js_low_var:2"]
    assert js.rival_at_pass1.mean == pytest.approx(0.946)
    assert js.vs_rival.delta == pytest.approx(0.90 - 0.946) and js.vs_rival.verdict == "below"
    # Every Pass@1's error carried through the chord's slope b = -0.4 (t = 0.6 from x_a = 0.40)
    b, t = -0.4, 0.6
    var = 0.01**2 * (1 + (1 - t) ** 2 + t**2 + b * b * (1 + (1 - t) ** 2 + t**2))
    assert js.vs_rival.se == pytest.approx(math.sqrt(var))
    assert out["js_low_var:20"].rival_at_pass1 is None  # Pass@1 0.38: outside reverse KL's 0.40-0.50
    assert out["reverse_kl:1"].rival_at_pass1 is None  # the rival is not compared with itself
    assert out["js_low_var:2 share50"].vs_rival.verdict == "level"  # 0.95 against 0.95

    text = frontier.table(groups, list(out.values()))
    lines = text.splitlines()
    rows = {line.split("|")[2].strip() + " " + line.split("|")[3].strip(): line
            for line in lines[2:] if line.startswith("|")}
    # the family: Pass@16 against the control (5 groups) and against the rival (3 with a chord)
    assert lines[-1] == "Holm over this table's 8 comparisons (P@16 against grpo@d_exp and against reverse_kl)."
    cols = [c.strip() for c in rows["2 11%"].strip("|").split("|")]
    p = t_two_sided_p(js.vs_rival.delta / js.vs_rival.se, js.vs_rival.df)
    assert 0.001 < p < 0.05
    assert cols == ["js_low_var", "2", "11%", "3", "46.0 ± 1.0", "90.0 ± 1.0", "2.50 ± 0.10",
                    "-2.0 ± 2.1", "7.0 ± 1.8", "94.6 ± 0.7", "-4.6 ± 1.3", "below", f"{p:.3f}",
                    "below"]
    # Holm steps down through the family: five p-values under 0.008 go first, then this one (0.0166)
    # meets 0.05 / 3; with a ninth, weaker comparison in the family it would not
    family = [c.vs_control[1] for c in out.values() if c.vs_control] + [c.vs_rival for c in out.values() if c.vs_rival]
    ps = sorted(d.p for d in family)
    assert ps.index(p) == 5 and p <= 0.05 / 3 and p > 0.05 / 4
    assert rows["2 50%"].rstrip(" |").endswith("level")


def test_groups_that_share_seeds_are_compared_with_the_frontier_paired_by_seed():
    """Per seed g = y - (1-t) ya - t yb - b (x - (1-t) xa - t xb), t and b from the means: its mean is the
    chord's gap, its se sd(g)/sqrt(n) at df n - 1, against the float64 closed form on fresh data; a
    group whose seeds differ from the frontier's falls back to independent means (Welch)."""
    import numpy as np

    rng = np.random.default_rng()

    def seeded(name: str, mode: str, coeff: float, x: float, y: float) -> tuple[Group, np.ndarray, np.ndarray]:
        xs, ys = x + rng.normal(0, 0.01, 5), y + rng.normal(0, 0.01, 5)
        g = group(name, mode, coeff, 0.0, Stat(xs.mean(), xs.std(ddof=1) / math.sqrt(5), 5),
                  Stat(ys.mean(), ys.std(ddof=1) / math.sqrt(5), 5), seeds=5)
        g.by_seed = {"in_domain/pass@1": dict(enumerate(xs)), "in_domain/pass@16": dict(enumerate(ys))}
        return g, xs, ys

    (ra, xa, ya), (rb, xb, yb) = seeded("reverse_kl:1", "reverse_kl", 1.0, 0.40, 0.97), \
        seeded("reverse_kl:0.1", "reverse_kl", 0.1, 0.50, 0.90)
    js, x, y = seeded("js_low_var:2", "js_low_var", 2.0, 0.46, 0.95)
    other, _, _ = seeded("forward:1", "forward", 1.0, 0.45, 0.95)
    other.by_seed = {k: {s + 10: v for s, v in d.items()} for k, d in other.by_seed.items()}
    out = {c.group: c for c in frontier.compare([ra, rb, js, other], "in_domain", 16)}
    t = (x.mean() - xa.mean()) / (xb.mean() - xa.mean())
    b = (yb.mean() - ya.mean()) / (xb.mean() - xa.mean())
    g = y - (1 - t) * ya - t * yb - b * (x - (1 - t) * xa - t * xb)
    gap = out["js_low_var:2"].vs_rival
    assert gap.paired and gap.df == 4
    assert gap.delta == pytest.approx(y.mean() - ((1 - t) * ya.mean() + t * yb.mean()), abs=1e-12)
    assert gap.delta == pytest.approx(g.mean(), abs=1e-12)
    assert gap.se == pytest.approx(g.std(ddof=1) / math.sqrt(5), rel=1e-9)
    assert not out["forward:1"].vs_rival.paired  # other seeds: Welch on the means
