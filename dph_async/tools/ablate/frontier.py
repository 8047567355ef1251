"""The Pass@1-Pass@k frontier of each objective over its coefficient, and comparisons at matched Pass@1.

A frontier is one objective's groups at the sweep's base share of reference samples, ordered by
coefficient: each point is (Pass@1, Pass@k) of the final models, mean ± standard error over seeds.
Two comparisons (dph_async/stats.py has the tests):

- against the control (GRPO on D_exp): Pass@1 and Pass@k of every group minus the control's, paired
  by seed where both have the same seeds (same pi_0, same prompts), else Welch;
- against a rival frontier (reverse KL) at the same Pass@1: the rival's Pass@k is interpolated
  linearly between its two points whose Pass@1 bracket the group's, y = (1 - t) y_a + t y_b. Every
  Pass@1 is an estimate too, so its error is carried through the chord's slope b = (y_b - y_a) /
  (x_b - x_a). Where the group and both points ran the same seeds (one pi_0, the same prompts), per
  seed g_s = y_s - (1 - t) y_a,s - t y_b,s - b (x_s - (1 - t) x_a,s - t x_b,s), t and b from the
  means: its mean is the gap, and a paired t on g (df n - 1) carries every error and the covariances
  between a run's Pass@1 and Pass@k and across runs of one seed. Otherwise, as independent means:
  var = se_k^2 + (1 - t)^2 se_ya^2 + t^2 se_yb^2 + b^2 (se_x^2 + (1 - t)^2 se_xa^2 + t^2 se_xb^2), df
  by Welch-Satterthwaite. A group outside the rival's range of Pass@1 has no such comparison (a
  straight chord also understates a frontier that bows outward: a margin above it is an upper bound).

Above or below: p < 0.05 at the difference's own df; the table also gives Holm's verdict over the
table's comparisons, the one to quote when a sweep makes many.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import TypeVar

from dph_async.pipeline.report import markdown_table
from dph_async.stats import Difference, holm, paired, welch
from dph_async.tools.ablate.results import Group, Stat

CONTROL = "grpo@d_exp"
K = TypeVar("K")
RIVAL = "reverse_kl"


def fmt(d: Difference, scale: float = 100.0, digits: int = 1) -> str:
    return Stat(d.delta, d.se, 0).fmt(scale, digits)


def difference(a: Stat, b: Stat) -> Difference:
    """a - b of two independent means (Welch)."""
    if a.se is None or b.se is None:
        return Difference(a.mean - b.mean, None)
    se, df = welch([(a.se**2, a.n), (b.se**2, b.n)])
    return Difference(a.mean - b.mean, se, df)


def versus(a: Group, b: Group, metric: str) -> Difference:
    """a - b on `metric`, paired by seed when both groups ran the same seeds."""
    sa, sb = a.by_seed.get(metric, {}), b.by_seed.get(metric, {})
    if len(sa) > 1 and sa.keys() == sb.keys():
        return paired(sa, sb)
    return difference(a.metrics[metric], b.metrics[metric])


def is_ladder(g: Group) -> bool:
    """A group of the coefficient ladder, at the base share (a share cell's name has its share after
    the run spec)."""
    return " " not in g.name


def lines(groups: list[Group]) -> dict[str, list[Group]]:
    """Per mode, its ladder's groups ordered by coefficient."""
    out: dict[str, list[Group]] = {}
    for g in filter(is_ladder, groups):
        out.setdefault(str(g.factors["mode"]), []).append(g)
    return {mode: sorted(members, key=lambda g: float(g.factors["coeff"])) for mode, members in out.items()}


@dataclass(frozen=True)
class Chord:
    """The rival frontier at Pass@1 = x: y = (1 - t) y_a + t y_b between its bracketing points a, b."""

    a: tuple[Stat, Stat]
    b: tuple[Stat, Stat]
    t: float

    @property
    def slope(self) -> float:
        gap = self.b[0].mean - self.a[0].mean
        return 0.0 if gap == 0 else (self.b[1].mean - self.a[1].mean) / gap

    @property
    def at(self) -> Stat:
        """The interpolated Pass@k, its se from the points' Pass@k alone (their Pass@1 taken as exact)."""
        (_, ya), (_, yb), t = self.a, self.b, self.t
        se = ((1 - t) ** 2 * ya.se**2 + t**2 * yb.se**2) ** 0.5 if ya.se is not None and yb.se is not None else None
        return Stat((1 - t) * ya.mean + t * yb.mean, se, min(ya.n, yb.n))

    def gap(self, x: Stat, y: Stat) -> Difference:
        """y minus the chord at x, every Pass@1's and Pass@k's error carried (the module's formula)."""
        (xa, ya), (xb, yb), t, b = self.a, self.b, self.t, self.slope
        parts = [(y, 1.0), (ya, (1 - t) ** 2), (yb, t**2), (x, b * b), (xa, b * b * (1 - t) ** 2),
                 (xb, b * b * t**2)]
        if any(s.se is None for s, _ in parts):
            return Difference(y.mean - self.at.mean, None)
        se, df = welch([(w * s.se**2, s.n) for s, w in parts if w > 0])
        return Difference(y.mean - self.at.mean, se, df)


def seed_gap(c: Chord, x: dict[int, float], y: dict[int, float], xa: dict[int, float], ya: dict[int, float],
             xb: dict[int, float], yb: dict[int, float]) -> Difference | None:
    """The chord's gap per seed, paired (module docstring), over the seeds all six share; None under two."""
    t, b = c.t, c.slope
    common = sorted(x.keys() & y.keys() & xa.keys() & ya.keys() & xb.keys() & yb.keys())
    g = [y[s] - (1 - t) * ya[s] - t * yb[s] - b * (x[s] - (1 - t) * xa[s] - t * xb[s]) for s in common]
    if len(g) < 2:
        return None
    return Difference(statistics.fmean(g), statistics.stdev(g) / math.sqrt(len(g)), len(g) - 1.0, True)


def bracketing(c: Chord, points: dict[K, tuple[Stat, Stat]]) -> tuple[K, K]:
    """The keys of the two points `c` runs between (`c` made by `chord` from `points`' values)."""
    a, b = (next(key for key, p in points.items() if p is end) for end in (c.a, c.b))
    return a, b


def chord(points: list[tuple[Stat, Stat]], x: float) -> Chord | None:
    """The narrowest pair of a frontier's (Pass@1, Pass@k) points whose Pass@1 bracket x; None outside."""
    best: Chord | None = None
    for p, q in ((p, q) for p in points for q in points if p[0].mean <= x <= q[0].mean):
        gap = q[0].mean - p[0].mean
        if best is not None and gap >= best.b[0].mean - best.a[0].mean:
            continue
        best = Chord(p, q, 0.0 if gap == 0 else (x - p[0].mean) / gap)
    return best


def interpolate(points: list[tuple[Stat, Stat]], x: float) -> Stat | None:
    """The Pass@k of a frontier at Pass@1 = x (linear between the nearest bracketing points)."""
    c = chord(points, x)
    return None if c is None else c.at


@dataclass(frozen=True)
class Comparison:
    group: str
    split: str
    k: int
    pass1: Stat
    passk: Stat
    vs_control: tuple[Difference, Difference] | None  # (Pass@1, Pass@k) minus the control's
    rival_at_pass1: Stat | None  # the rival frontier's Pass@k at this group's Pass@1
    vs_rival: Difference | None  # this group's Pass@k minus rival_at_pass1


def compare(groups: list[Group], split: str, k: int, control: str = CONTROL, rival: str = RIVAL) -> list[Comparison]:
    """Every group against the control and (except the rival's own) against the rival's frontier."""
    p1, pk = f"{split}/pass@1", f"{split}/pass@{k}"
    have = [g for g in groups if p1 in g.metrics and pk in g.metrics]
    ctrl = next((g for g in have if g.factors["mode"] == control), None)
    rivals = lines(have).get(rival, [])
    rival_points = [(g.metrics[p1], g.metrics[pk]) for g in rivals]
    out = []
    for g in have:
        a1, ak = g.metrics[p1], g.metrics[pk]
        vs_control = None if ctrl is None or g is ctrl else (versus(g, ctrl, p1), versus(g, ctrl, pk))
        c = None if g.factors["mode"] == rival else chord(rival_points, a1.mean)
        gap = None
        if c is not None:
            ends = [rivals[i] for i in bracketing(c, dict(enumerate(rival_points)))]
            by_seed = [h.by_seed.get(m, {}) for h in (g, *ends) for m in (p1, pk)]
            gap = seed_gap(c, *by_seed) or c.gap(a1, ak)
        out.append(Comparison(g.name, split, k, a1, ak, vs_control, None if c is None else c.at, gap))
    return out


def table(groups: list[Group], comparisons: list[Comparison], control: str = CONTROL, rival: str = RIVAL) -> str:
    """One row per group of one split's comparisons (in %): Pass@1, Pass@k, distinct correct answers,
    the differences to the control, the rival frontier's Pass@k at the group's Pass@1 and the
    difference to it, with its verdict."""
    by_name = {g.name: g for g in groups}
    k, split = comparisons[0].k, comparisons[0].split
    header = ["mode", "coeff", "share", "seeds", "P@1", f"P@{k}", "distinct", f"P@1 − {control}",
              f"P@{k} − {control}", f"{rival} P@{k} at this P@1", f"P@{k} − {rival}", f"vs {rival}", "p",
              f"vs {rival}, Holm"]
    family = [d for c in comparisons for d in (*(c.vs_control or ())[1:], c.vs_rival) if d is not None]
    rejected = dict(zip(map(id, family), holm([d.p for d in family]), strict=True))
    rows = []
    for c in comparisons:
        g = by_name[c.group]
        distinct = g.metrics.get(f"{split}/distinct")
        rows.append([str(g.factors["mode"]), f"{g.factors['coeff']:g}", f"{100 * float(g.factors['share']):.0f}%",
                     str(len(g.cells)), c.pass1.fmt(100, 1), c.passk.fmt(100, 1),
                     "-" if distinct is None else distinct.fmt(1, 2),
                     *(("-", "-") if c.vs_control is None else (fmt(d) for d in c.vs_control)),
                     "-" if c.rival_at_pass1 is None else c.rival_at_pass1.fmt(100, 1),
                     "-" if c.vs_rival is None else fmt(c.vs_rival),
                     "-" if c.vs_rival is None else c.vs_rival.verdict,
                     "-" if c.vs_rival is None or c.vs_rival.p is None else f"{c.vs_rival.p:.3f}",
                     "-" if c.vs_rival is None else _holm_verdict(c.vs_rival, rejected[id(c.vs_rival)])])
    return markdown_table(header, rows) + (f"\n\nHolm over this table's {len(family)} comparisons "
                                           f"(P@{k} against {control} and against {rival}).")


def _holm_verdict(d: Difference, rejected: bool) -> str:
    if d.p is None:
        return d.verdict
    return ("above" if d.delta > 0 else "below") if rejected else "level"
