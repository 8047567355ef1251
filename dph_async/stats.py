"""The statistics of sweeps and benchmarks, as a reviewer would test them: differences between groups
of seeds by Student's t at the real degrees of freedom, paired by seed where two groups share pi_0
and data order, Holm's adjustment over a table's comparisons; ratios of rates from runs made side by
side, with their interval (`ratio_interval`).

- Paired (the same seeds on both sides: a sweep's cells of one seed start from the same pi_0 and
  draw the same prompts): d_s = a_s - b_s, se = sd(d) / sqrt(n), df = n - 1.
- Otherwise Welch: se^2 = sum of the parts' se^2, df by Welch-Satterthwaite,
  df = (sum v_i)^2 / sum(v_i^2 / df_i), v_i a part's variance of the mean, df_i = n_i - 1.
- Two-sided p = 2 (1 - T_df(|delta| / se)); a difference is called at level 0.05 where p < 0.05 (the
  t critical value at df, 2.78 at df 4, not 2), and again after Holm's step-down over a family.

No scipy here: T_df is computed through the regularised incomplete beta function,
T_df(t) = 1 - I_{df / (df + t^2)}(df / 2, 1 / 2) / 2 for t > 0, by its continued fraction.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

ALPHA = 0.05


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function, 0 <= x <= 1."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T_df| >= |t|)."""
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_critical(df: float, alpha: float = ALPHA) -> float:
    """The two-sided critical value: P(|T_df| >= c) = alpha (bisection)."""
    lo, hi = 0.0, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class Difference:
    """a - b with its standard error and degrees of freedom (None with a single seed)."""

    delta: float
    se: float | None
    df: float | None = None
    paired: bool = False

    @property
    def p(self) -> float | None:
        if self.se is None or self.df is None:
            return None
        if self.se == 0.0:
            return 0.0 if self.delta else 1.0
        return t_two_sided_p(self.delta / self.se, self.df)

    @property
    def verdict(self) -> str:
        if self.p is None:
            return "one seed: no standard error"
        if self.p >= ALPHA:
            return "level"
        return "above" if self.delta > 0 else "below"


def welch(parts: list[tuple[float, int]]) -> tuple[float, float]:
    """(se, df) of a sum of independent means: parts are (variance of the mean, seeds)."""
    var = sum(v for v, _ in parts)
    denom = sum(v * v / (n - 1) for v, n in parts if n > 1 and v > 0)
    return math.sqrt(var), (var * var / denom if denom > 0 else float(min(n for _, n in parts) - 1))


def paired(a: dict[int, float], b: dict[int, float]) -> Difference:
    """Mean of a_s - b_s over the seeds s both have, se = sd / sqrt(n), df = n - 1."""
    d = [a[s] - b[s] for s in sorted(a.keys() & b.keys())]
    if len(d) < 2:
        return Difference(statistics.fmean(d) if d else math.nan, None)
    return Difference(statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d)), len(d) - 1.0, True)


def holm(ps: list[float | None], alpha: float = ALPHA) -> list[bool]:
    """Which of the family's hypotheses Holm's step-down rejects (None: not tested, never rejected)."""
    order = sorted((p, i) for i, p in enumerate(ps) if p is not None)
    out = [False] * len(ps)
    for rank, (p, i) in enumerate(order):
        if p > alpha / (len(order) - rank):
            break
        out[i] = True
    return out


@dataclass(frozen=True)
class RatioInterval:
    """A ratio of rates measured in n pairs of runs: the geometric mean of the pairs' ratios and its
    (1 - alpha) interval, exp(mean log r +- t_{n-1} sd / sqrt(n)). Pairs, because two runs side by
    side share the machine's drift, which a ratio of separate medians does not cancel."""

    ratio: float
    low: float
    high: float
    n: int

    def fmt(self) -> str:
        return f"{self.ratio:.2f}x ({self.low:.2f}-{self.high:.2f}, n {self.n})"


def ratio_interval(pairs: list[tuple[float, float]], alpha: float = ALPHA) -> RatioInterval | None:
    """pairs: (a, b) rates of runs made side by side; the interval of a / b. None under two pairs."""
    logs = [math.log(a / b) for a, b in pairs if a > 0 and b > 0]
    if len(logs) < 2:
        return None
    n = len(logs)
    mean, half = statistics.fmean(logs), t_critical(n - 1, alpha) * statistics.stdev(logs) / math.sqrt(n)
    return RatioInterval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)
