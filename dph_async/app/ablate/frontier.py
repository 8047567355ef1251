"""The Pass@1-Pass@k frontier of each objective over its coefficient, and comparisons at matched Pass@1.

A frontier is one objective's groups at the sweep's base share of reference samples, ordered by
coefficient: each point is (Pass@1, Pass@k) of the final models, mean ± standard error over seeds.
Two comparisons, each difference with the standard error sqrt(se_1^2 + se_2^2):

- against the control (GRPO on D_exp): Pass@1 and Pass@k of every group minus the control's;
- against a rival frontier (reverse KL) at the same Pass@1: the rival's Pass@k is interpolated
  linearly between its two points whose Pass@1 bracket the group's, with standard error
  sqrt((1 - t)^2 se_a^2 + t^2 se_b^2) (the points' Pass@1 taken as exact); a group outside the
  rival's range of Pass@1 has no such comparison.

A difference beyond two standard errors is called above or below; within two, level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dph_async.app.ablate.results import Group, Stat
from dph_async.app.report import markdown_table

CONTROL = "grpo@d_exp"
RIVAL = "reverse_kl"


@dataclass(frozen=True)
class Difference:
    delta: float
    se: float | None

    @property
    def verdict(self) -> str:
        if self.se is None:
            return "one seed: no standard error"
        if self.delta > 2 * self.se:
            return "above"
        return "below" if self.delta < -2 * self.se else "level"

    def fmt(self, scale: float = 100.0, digits: int = 1) -> str:
        return Stat(self.delta, self.se, 0).fmt(scale, digits)


def difference(a: Stat, b: Stat) -> Difference:
    """a - b, with sqrt(se_a^2 + se_b^2)."""
    se = math.sqrt(a.se**2 + b.se**2) if a.se is not None and b.se is not None else None
    return Difference(a.mean - b.mean, se)


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


def interpolate(points: list[tuple[Stat, Stat]], x: float) -> Stat | None:
    """The Pass@k (with its standard error) of a frontier given as (Pass@1, Pass@k) points, at Pass@1 = x,
    linearly between the two nearest points on either side; None outside their range of Pass@1."""
    best: tuple[float, Stat] | None = None
    for (x1, y1), (x2, y2) in ((p, q) for p in points for q in points if p[0].mean <= x <= q[0].mean):
        gap = x2.mean - x1.mean
        if best is not None and gap >= best[0]:
            continue
        t = 0.0 if gap == 0 else (x - x1.mean) / gap
        se = (math.sqrt((1 - t) ** 2 * y1.se**2 + t**2 * y2.se**2)
              if y1.se is not None and y2.se is not None else None)
        best = (gap, Stat((1 - t) * y1.mean + t * y2.mean, se, 0))
    return None if best is None else best[1]


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
    rival_points = [(g.metrics[p1], g.metrics[pk]) for g in lines(have).get(rival, [])]
    out = []
    for g in have:
        a1, ak = g.metrics[p1], g.metrics[pk]
        vs_control = None if ctrl is None or g is ctrl else (difference(a1, ctrl.metrics[p1]),
                                                              difference(ak, ctrl.metrics[pk]))
        at = None if g.factors["mode"] == rival else interpolate(rival_points, a1.mean)
        out.append(Comparison(g.name, split, k, a1, ak, vs_control, at, None if at is None else difference(ak, at)))
    return out


def table(groups: list[Group], comparisons: list[Comparison], control: str = CONTROL, rival: str = RIVAL) -> str:
    """One row per group of one split's comparisons (in %): Pass@1, Pass@k, distinct correct answers,
    the differences to the control, the rival frontier's Pass@k at the group's Pass@1 and the
    difference to it, with its verdict."""
    by_name = {g.name: g for g in groups}
    k, split = comparisons[0].k, comparisons[0].split
    header = ["mode", "coeff", "share", "seeds", "P@1", f"P@{k}", "distinct", f"P@1 − {control}",
              f"P@{k} − {control}", f"{rival} P@{k} at this P@1", f"P@{k} − {rival}", f"vs {rival}"]
    rows = []
    for c in comparisons:
        g = by_name[c.group]
        distinct = g.metrics.get(f"{split}/distinct")
        rows.append([str(g.factors["mode"]), f"{g.factors['coeff']:g}", f"{100 * float(g.factors['share']):.0f}%",
                     str(len(g.cells)), c.pass1.fmt(100, 1), c.passk.fmt(100, 1),
                     "-" if distinct is None else distinct.fmt(1, 2),
                     *(("-", "-") if c.vs_control is None else (d.fmt() for d in c.vs_control)),
                     "-" if c.rival_at_pass1 is None else c.rival_at_pass1.fmt(100, 1),
                     "-" if c.vs_rival is None else c.vs_rival.fmt(),
                     "-" if c.vs_rival is None else c.vs_rival.verdict])
    return markdown_table(header, rows)
