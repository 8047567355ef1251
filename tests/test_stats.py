"""The statistics of sweeps and benchmarks (dph_async/stats.py) against textbook values and their formulas."""

from __future__ import annotations

import math
import random

import pytest

from dph_async.stats import Difference, betainc, holm, paired, ratio_interval, t_critical, t_two_sided_p, welch


@pytest.mark.parametrize(("df", "crit"), [(1, 12.7062), (2, 4.3027), (4, 2.7764), (10, 2.2281), (30, 2.0423),
                                          (1e6, 1.9600)])
def test_t_critical_values_match_the_tables(df, crit):
    assert t_critical(df) == pytest.approx(crit, abs=5e-4)


def test_the_t_distribution_against_its_closed_forms():
    rng = random.Random(7)
    for _ in range(50):
        t = rng.uniform(0.0, 8.0)
        # df 1 is Cauchy: P(|T| >= t) = 1 - 2 atan(t) / pi; df 2: 1 - t / sqrt(2 + t^2)
        assert t_two_sided_p(t, 1) == pytest.approx(1 - 2 * math.atan(t) / math.pi, abs=1e-10)
        assert t_two_sided_p(t, 2) == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-10)
    a, b = rng.uniform(0.5, 5), rng.uniform(0.5, 5)
    x = rng.uniform(0.05, 0.95)
    assert betainc(a, b, x) + betainc(b, a, 1 - x) == pytest.approx(1.0, abs=1e-12)  # symmetry
    assert betainc(1.0, 1.0, x) == pytest.approx(x, abs=1e-12)  # the uniform


def test_a_difference_is_called_at_its_own_df():
    # 2.5 se: beyond two se, but p = 0.067 at df 4, 0.031 at df 10
    assert Difference(0.025, 0.01, 4).verdict == "level"
    assert Difference(0.025, 0.01, 10).verdict == "above"
    assert Difference(-0.025, 0.01, 10).verdict == "below"
    assert Difference(0.3, None).verdict.startswith("one seed")


def test_welch_satterthwaite_and_paired():
    se, df = welch([(0.04, 3), (0.01, 5)])
    assert se == pytest.approx(math.sqrt(0.05))
    assert df == pytest.approx(0.05**2 / (0.04**2 / 2 + 0.01**2 / 4))
    d = paired({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.5, 1: 1.0, 2: 3.0, 9: 7.0})
    diffs = [0.5, 1.0, 1.0]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / 2)
    assert (d.delta, d.df, d.paired) == (pytest.approx(mean), 2, True) and d.se == pytest.approx(sd / math.sqrt(3))


def test_holm_steps_down_and_stops_at_the_first_kept_hypothesis():
    # sorted 0.001 <= 0.05/4, 0.013 <= 0.05/3, 0.03 > 0.05/2: stop; 0.04 kept although < 0.05
    assert holm([0.03, 0.001, None, 0.04, 0.013]) == [False, True, False, False, True]
    assert holm([0.2, 0.3]) == [False, False] and holm([]) == []


def test_a_ratio_interval_from_runs_made_side_by_side():
    # a drift that slows both systems alike cancels in the pairs: the ratio is 1.5 in every repeat
    pairs = [(1.5 * r, r) for r in (1000.0, 800.0, 1200.0, 900.0, 1100.0)]
    ci = ratio_interval(pairs)
    assert ci.n == 5 and ci.ratio == pytest.approx(1.5) and ci.low == pytest.approx(1.5) == ci.high
    rng = random.Random(3)
    pairs = [(1.2 * math.exp(rng.gauss(0, 0.05)), 1.0) for _ in range(6)]
    ci = ratio_interval(pairs)
    logs = [math.log(a / b) for a, b in pairs]
    mean, sd = sum(logs) / 6, math.sqrt(sum((x - sum(logs) / 6) ** 2 for x in logs) / 5)
    half = 2.5706 * sd / math.sqrt(6)  # t at df 5
    assert ci.ratio == pytest.approx(math.exp(mean)) and ci.low == pytest.approx(math.exp(mean - half), rel=1e-4)
    assert ci.high == pytest.approx(math.exp(mean + half), rel=1e-4) and ci.low < ci.ratio < ci.high
    assert ratio_interval([(2.0, 1.0)]) is None
