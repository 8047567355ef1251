"""The pre-registered forgetting test of docs/preregistration.md (design 3), from a sweep's seeds.csv.

One `ablate divergence` sweep per task, its pi_0 warm-started at the task's OOD share (SHARES), with
the arms G (`grpo@d_exp`), J (`js_low_var:0.2`) and R (`reverse_kl:0.1`); only the pre-registered
SEEDS are analysed, at one step count of STEPS (the calibrated T). The family, on the final model's
OOD Pass@1, two-sided Student's t at df = n - 1:

    1  G - pi_0   each seed's figure minus pi_0's; its standard error the seeds' and pi_0's own (the
                  s.d. of pi_0's per-prompt Pass@1 over the prompts / sqrt(prompts), seeds.csv's
                  ood/pass@1_se) in quadrature
    2  J - G      paired by seed
    3  R - G      paired by seed

Holm over the whole family (two tasks x three); a test of a task not given, or with an arm that lacks
one of the SEEDS, enters as p = 1. Outside the family, the bound: J - G on in-domain Pass@1, its 95%
interval's lower end above -MARGIN. Verdicts, fixed in advance: F holds when test 1 is rejected with
G below pi_0; K holds for JS when test 2 is rejected with J above G and the bound holds, for reverse KL
when test 3 is rejected with R above G.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from dph_async.pipeline.report import markdown_table
from dph_async.stats import Difference, holm, paired, t_critical
from dph_async.tools.ablate.seeds import BASE, SeedRow, repeated_seed

SEEDS = (300, 301, 302, 303, 304)
TASKS = ("embedded", "digit_sets")
SHARES = {"embedded": 0.1, "digit_sets": 0.15}  # task.ood_warm_share: pi_0 off the OOD ceiling
STEPS = (200, 400, 800)  # the calibration's choices of T
ARMS = {"G": "grpo@d_exp", "J": "js_low_var:0.2", "R": "reverse_kl:0.1"}
MARGIN = 0.03
OOD, IN_DOMAIN = "ood/pass@1", "in_domain/pass@1"
FAMILY_SIZE = len(TASKS) * 3


def check_rows(task: str, rows: list[SeedRow]) -> None:
    """Refuse rows that cannot be the design's: another task, OOD share or reference_pg_share, a step
    count outside STEPS or two of them, a seed twice, more than one pi_0, an analysed cell without the
    figures its tests read, or a pi_0 without its per-prompt standard error."""
    if twice := repeated_seed(rows):
        raise ValueError(f"{task}: group {twice[0]} has seed {twice[1]} twice")
    if task not in SHARES:
        raise ValueError(f"{task}: not a task of the design ({', '.join(TASKS)})")
    for r in rows:
        if r.task != task or r.ood_share != SHARES[task] or r.steps not in STEPS or r.pg_share:
            raise ValueError(f"{task}, cell {r.cell}: task {r.task}, OOD share {r.ood_share:g}, {r.steps} steps, "
                             f"reference_pg_share {r.pg_share:g}; the design runs {task} at OOD share "
                             f"{SHARES[task]:g}, {' or '.join(map(str, STEPS))} steps, reference_pg_share 0")
        if r.group != BASE and r.seed in SEEDS and r.group not in ARMS.values():
            raise ValueError(f"{task}, cell {r.cell}: group {r.group} is not an arm of the design")
        need = [OOD, f"{OOD}_se"] if r.group == BASE else [OOD, IN_DOMAIN] if r.seed in SEEDS else []
        if lacking := [k for k in need if k not in r.metrics]:
            raise ValueError(f"{task}, cell {r.cell}: no column {', '.join(lacking)}")
    if len({r.steps for r in rows}) > 1:
        raise ValueError(f"{task}: the rows ran {sorted({r.steps for r in rows})} steps; one T per task")
    if len({r.base for r in rows}) > 1:
        raise ValueError(f"{task}: the rows start from more than one pi_0 (base fingerprints differ)")
    if sum(r.group == BASE for r in rows) != 1:
        raise ValueError(f"{task}: {sum(r.group == BASE for r in rows)} rows of pi_0; a sweep has one")


def arm(rows: list[SeedRow], name: str, metric: str) -> dict[int, float]:
    """seed -> the arm's `metric`, over the pre-registered seeds."""
    return {r.seed: r.metrics[metric] for r in rows if r.group == ARMS[name] and r.seed in SEEDS}


def against_base(rows: list[SeedRow]) -> Difference:
    """G - pi_0 on OOD Pass@1: the seeds' spread and pi_0's per-prompt error in quadrature, df n - 1."""
    base = next(r for r in rows if r.group == BASE)
    d = [x - base.metrics[OOD] for x in arm(rows, "G", OOD).values()]
    if len(d) < 2:
        return Difference(statistics.fmean(d) if d else math.nan, None)
    se = math.sqrt(statistics.variance(d) / len(d) + base.metrics[f"{OOD}_se"] ** 2)
    return Difference(statistics.fmean(d), se, len(d) - 1.0)


@dataclass(frozen=True)
class Test:
    task: str
    number: int
    label: str
    diff: Difference
    complete: bool  # every arm it reads has every seed
    rejected: bool = False

    @property
    def p(self) -> float:
        """The p Holm takes: 1 for an incomplete test or one without a standard error."""
        return self.diff.p if self.complete and self.diff.p is not None else 1.0


def tests_of(task: str, rows: list[SeedRow]) -> list[Test]:
    check_rows(task, rows)
    full = {name: set(arm(rows, name, OOD)) == set(SEEDS) for name in ARMS}
    g = arm(rows, "G", OOD)
    return [Test(task, 1, "G − π₀", against_base(rows), full["G"]),
            Test(task, 2, "J − G", paired(arm(rows, "J", OOD), g), full["J"] and full["G"]),
            Test(task, 3, "R − G", paired(arm(rows, "R", OOD), g), full["R"] and full["G"])]


def family(tasks: dict[str, list[SeedRow]]) -> list[Test]:
    """Every task's three tests, Holm over FAMILY_SIZE (a task not given fills its place with p = 1)."""
    tests = [t for task, rows in tasks.items() for t in tests_of(task, rows)]
    absent = FAMILY_SIZE - len(tests)
    rejected = holm([t.p for t in tests] + [1.0] * max(0, absent))
    return [Test(t.task, t.number, t.label, t.diff, t.complete, r) for t, r in zip(tests, rejected, strict=False)]


def bound(rows: list[SeedRow]) -> tuple[float, float] | None:
    """J - G on in-domain Pass@1: the 95% interval (None without every seed on both sides)."""
    j, g = arm(rows, "J", IN_DOMAIN), arm(rows, "G", IN_DOMAIN)
    if set(j) != set(SEEDS) or set(g) != set(SEEDS):
        return None
    d = paired(j, g)
    half = t_critical(d.df) * d.se
    return d.delta - half, d.delta + half


def verdicts(tests: list[Test], tasks: dict[str, list[SeedRow]]) -> dict[str, str]:
    """Per task: F, K for JS, K for reverse KL; "incomplete" while an arm lacks a seed."""
    out = {}
    for task, rows in tasks.items():
        t = {x.number: x for x in tests if x.task == task}
        if not all(x.complete for x in t.values()):
            out[task] = "incomplete"
            continue
        iv = bound(rows)
        f = t[1].rejected and t[1].diff.delta < 0
        kj = t[2].rejected and t[2].diff.delta > 0 and iv is not None and iv[0] > -MARGIN
        kr = t[3].rejected and t[3].diff.delta > 0
        out[task] = (f"F {'holds' if f else 'does not hold'}; K for JS {'holds' if kj else 'does not hold'} "
                     f"(in-domain bound {'-' if iv is None else f'{100 * iv[0]:+.1f}'}); "
                     f"K for reverse KL {'holds' if kr else 'does not hold'}")
    return out


def markdown(tasks: dict[str, list[SeedRow]]) -> str:
    """The family's table (points of OOD Pass@1) and the verdicts."""
    tests = family(tasks)
    rows = []
    for t in tests:
        d, half = t.diff, None if t.diff.se is None else t_critical(t.diff.df) * t.diff.se
        rows.append([t.task, str(t.number), t.label, f"{100 * d.delta:+.1f}" + ("" if d.se is None else
                     f" ± {100 * d.se:.1f}"), "-" if half is None else
                     f"[{100 * (d.delta - half):+.1f}, {100 * (d.delta + half):+.1f}]",
                     "-" if d.p is None else f"{d.p:.4f}", "rejected" if t.rejected else "not rejected",
                     "" if t.complete else "incomplete"])
    lines = [markdown_table(["task", "test", "arms", "OOD Pass@1 difference (points) ± s.e.", "95% interval", "p",
                             f"Holm over {FAMILY_SIZE}", ""], rows), ""]
    lines += [f"- **{task}**: {v}." for task, v in verdicts(tests, tasks).items()]
    return "\n".join(lines)
