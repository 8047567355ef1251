"""The pre-registered confirmatory test of docs/preregistration.md (design 1), from the sweeps' seeds.csv.

Per task two sweeps from one pi_0: the first holds A (`grpo@d_exp`, the control) and B
(`js_low_var:0.2`, DPH-JS as written), the second, run with `learner.loss.reference_pg_share=0.375`,
holds C (`js_low_var:0.2`: DPH-JS as the official script's batches train it) and D (`dpef_pg`: that
policy-gradient term alone). B and C share a group name; which sweep a row came from tells them
apart, and each sweep's rows must say the share they ran at (`check_task` refuses a mix-up, another
pi_0, another task or step count, a seed twice).

The family, per task, on the final model's in-domain Pass@k (paired by seed over the pre-registered
SEEDS only, two-sided Student's t at df = n - 1, `dph_async.stats`):

    1  C - A  Pass@16        3  D - A  Pass@16        5  B - A  Pass@16
    2  C - A  Pass@1         4  C - D  Pass@16

Holm's step-down over the whole family of FAMILY_SIZE tests (two tasks x five) at 0.05. A test of a
task not given, or of a task whose arms lack some of the SEEDS ("incomplete"), enters as p = 1: a
rejection made early stands once the data are complete, and missing data never make one easier.
Verdicts, fixed in advance, for complete tasks:

    H1 supported         test 1 rejected with C above A, and test 2's 95% interval above -PASS1_MARGIN
    H2 "divergence adds" test 4 rejected with C above D
    H2 "PG term's"       test 3 rejected with D above A, test 4 not rejected
    H2 "undecided"       otherwise

Secondary, outside the family: J (`js_low_var:200 share25`), B, C and D against the first sweep's
reverse-KL frontier (`reverse_kl` at 0.01, 0.1, 1) at their own Pass@1. Per seed s, with the chord's
position t and slope b from the means, g_s = y_s - (1-t) ya_s - t yb_s - b (x_s - (1-t) xa_s - t xb_s)
(x Pass@1, y Pass@16; a, b the bracketing frontier points): its mean is Pass@16 minus the chord at
the arm's Pass@1, and a paired t on g carries every Pass@1's and Pass@16's error and their
covariances across seeds, at df = n - 1. Holm over the one table (both tasks), a row outside the
frontier's Pass@1 range entering as p = 1. Also descriptive: every arm's in-domain and OOD Pass@1,
Pass@16 and distinct correct answers, pi_0's beside them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from dph_async.pipeline.report import markdown_table
from dph_async.stats import Difference, holm, paired, t_critical
from dph_async.tools.ablate.frontier import bracketing, chord, fmt, seed_gap
from dph_async.tools.ablate.results import Stat, stat
from dph_async.tools.ablate.seeds import BASE, SeedRow, repeated_seed

SEEDS = (100, 101, 102, 103, 104)
FAMILY_SIZE = 10
PASS1_MARGIN = 0.03  # "rises like GRPO's": at most 3 points of Pass@1 below the control
STEPS = 100
TASKS = ("embedded", "digit_sets")
PG_SHARE = (0.0, 0.375)  # learner.loss.reference_pg_share of the first and the second sweep
SPLIT = "in_domain"
K = 16
Arm = tuple[int, str]  # (sweep: 0 first, 1 second; group name in its seeds.csv)
ARMS: dict[str, Arm] = {"A": (0, "grpo@d_exp"), "B": (0, "js_low_var:0.2"), "C": (1, "js_low_var:0.2"),
                        "D": (1, "dpef_pg")}
SECONDARY: dict[str, Arm] = {"J": (0, "js_low_var:200 share25"), "B": ARMS["B"], "C": ARMS["C"], "D": ARMS["D"]}
RIVAL: tuple[Arm, ...] = tuple((0, f"reverse_kl:{c}") for c in ("0.01", "0.1", "1"))
# (number, a, b, k): a - b on Pass@k
TESTS = ((1, "C", "A", K), (2, "C", "A", 1), (3, "D", "A", K), (4, "C", "D", K), (5, "B", "A", K))
Sweeps = tuple[list[SeedRow], list[SeedRow]]


def check_task(name: str, sweeps: Sweeps) -> None:
    """Refuse rows that cannot be the design's: another task or step count, a sweep at the other's
    reference_pg_share, a row whose run is not its group's, a seed twice in a group, or two sweeps
    from different pi_0s (their base fingerprints, or pi_0's evaluations, differ or are missing)."""
    for i, rows in enumerate(sweeps):
        which = ("first", "second")[i]
        for r in rows:
            if r.task != name or r.steps != STEPS or r.pg_share != PG_SHARE[i]:
                raise ValueError(f"{which} sweep of {name}, cell {r.cell}: task {r.task}, {r.steps} steps, "
                                 f"reference_pg_share {r.pg_share:g}; the design runs {name}, {STEPS} steps, "
                                 f"{PG_SHARE[i]:g}")
            if r.group != BASE and r.mode != r.group.split(" ")[0]:
                raise ValueError(f"{which} sweep of {name}, cell {r.cell}: run {r.mode} in group {r.group}")
        if twice := repeated_seed(rows):
            raise ValueError(f"{which} sweep of {name}: group {twice[0]} has seed {twice[1]} twice")
    bases = [next((r.metrics for r in rows if r.group == BASE), None) for rows in sweeps]
    prints = {r.base for rows in sweeps for r in rows}
    if not bases[0] or bases[0] != bases[1] or len(prints) != 1 or not next(iter(prints)):
        raise ValueError(f"{name}: the two sweeps do not start from one pi_0 (their base fingerprints or pi_0 rows "
                         "differ or are missing); the second sweep must start from the first's base_model, data, "
                         "presample and eval directories, copied in")


def preregistered(name: str) -> bool:
    """The design's tasks; another task runs the same analysis, reported as exploratory."""
    return name in TASKS


def arm_values(sweeps: Sweeps, arm: str | Arm, metric: str) -> dict[int, float]:
    """seed -> the arm's `metric` ("in_domain/pass@16"), over the pre-registered seeds only; a column
    the rows lack is named."""
    sweep, group = ARMS[arm] if isinstance(arm, str) else arm
    out = {}
    for r in sweeps[sweep]:
        if r.group == group and r.seed in SEEDS:
            if metric not in r.metrics:
                raise ValueError(f"arm {arm} ({group}), cell {r.cell}: no column {metric}")
            out[r.seed] = r.metrics[metric]
    return out


def pass_key(k: int) -> str:
    return f"{SPLIT}/pass@{k}"


def other_seeds(sweeps: Sweeps) -> list[int]:
    """Seeds some arm ran beyond the pre-registered ones: never analysed, only named."""
    return sorted({r.seed for rows in sweeps for r in rows if r.group != BASE and r.seed not in SEEDS})


def complete(sweeps: Sweeps) -> bool:
    """Every arm of the family holds every pre-registered seed."""
    return all(set(SEEDS) <= arm_values(sweeps, arm, pass_key(K)).keys() for arm in ARMS)


@dataclass(frozen=True)
class Test:
    task: str
    number: int
    a: str
    b: str
    k: int
    diff: Difference
    seeds: int
    complete: bool  # the task's every arm holds every seed: else p = 1 in Holm, no verdict
    rejected: bool = False  # by Holm over the family

    def interval(self) -> tuple[float, float] | None:
        """The unadjusted 95% interval of a - b (t at the test's df)."""
        if self.diff.se is None or self.diff.df is None:
            return None
        half = t_critical(self.diff.df) * self.diff.se
        return self.diff.delta - half, self.diff.delta + half

    @property
    def holm_p(self) -> float:
        """The p Holm takes: 1 for an incomplete task or a test without a standard error."""
        return self.diff.p if self.complete and self.diff.p is not None else 1.0


@dataclass(frozen=True)
class Verdict:
    task: str
    h1: str
    h2: str


def family(tasks: dict[str, Sweeps]) -> list[Test]:
    """The five tests of every task given, with Holm's decisions over FAMILY_SIZE."""
    if len(tasks) * len(TESTS) > FAMILY_SIZE:
        raise ValueError(f"the pre-registered family has {FAMILY_SIZE // len(TESTS)} tasks, got {len(tasks)}")
    tests = []
    for task, sweeps in tasks.items():
        check_task(task, sweeps)
        done = complete(sweeps)
        for number, a, b, k in TESTS:
            va, vb = arm_values(sweeps, a, pass_key(k)), arm_values(sweeps, b, pass_key(k))
            tests.append(Test(task, number, a, b, k, paired(va, vb), len(va.keys() & vb.keys()), done))
    rejected = holm([t.holm_p for t in tests] + [1.0] * (FAMILY_SIZE - len(tests)))
    return [replace(t, rejected=r) for t, r in zip(tests, rejected, strict=False)]


def bound_holds(test: Test) -> bool:
    """Test 2's rule: the 95% interval of C - A on Pass@1 lies above -PASS1_MARGIN."""
    iv = test.interval()
    return iv is not None and iv[0] > -PASS1_MARGIN


def verdicts(tests: list[Test]) -> list[Verdict]:
    out = []
    for task in dict.fromkeys(t.task for t in tests):
        t = {x.number: x for x in tests if x.task == task}
        if not t[1].complete:
            out.append(Verdict(task, "incomplete", "incomplete"))
            continue
        h1 = t[1].rejected and t[1].diff.delta > 0 and bound_holds(t[2])
        if t[4].rejected and t[4].diff.delta > 0:
            h2 = "the divergence adds"
        elif t[3].rejected and t[3].diff.delta > 0 and not t[4].rejected:
            h2 = "the PG term's"
        else:
            h2 = "undecided"
        tag = "" if preregistered(task) else " (exploratory: not a pre-registered task)"
        out.append(Verdict(task, ("supported" if h1 else "not supported") + tag, h2 + tag))
    return out


@dataclass(frozen=True)
class AgainstFrontier:
    task: str
    arm: str
    pass1: Stat
    pass16: Stat
    gap: Difference | None  # Pass@16 minus the reverse-KL frontier's at this Pass@1; None outside its range
    rejected: bool = False  # by Holm over the table


def point(sweeps: Sweeps, arm: Arm) -> tuple[Stat, Stat] | None:
    p1, p16 = arm_values(sweeps, arm, pass_key(1)), arm_values(sweeps, arm, pass_key(K))
    return (stat(list(p1.values())), stat(list(p16.values()))) if p1 and p16 else None


def frontier_gap(sweeps: Sweeps, arm: Arm) -> tuple[tuple[Stat, Stat], Difference | None] | None:
    """The arm's (Pass@1, Pass@16) and its per-seed gap to the reverse-KL chord (module docstring)."""
    if (at := point(sweeps, arm)) is None:
        return None
    rival = {a: p for a in RIVAL if (p := point(sweeps, a)) is not None}
    c = chord(list(rival.values()), at[0].mean)
    if c is None:
        return at, None
    by_seed = [arm_values(sweeps, a, pass_key(k)) for a in (arm, *bracketing(c, rival)) for k in (1, K)]
    return at, seed_gap(c, *by_seed) or Difference(at[1].mean - c.at.mean, None)  # under two seeds: no se


def secondary(tasks: dict[str, Sweeps]) -> list[AgainstFrontier]:
    """J, B, C and D against the first sweep's reverse-KL frontier at matched Pass@1, Holm over the table."""
    found = []
    for task, sweeps in tasks.items():
        for name, arm in SECONDARY.items():
            if (res := frontier_gap(sweeps, arm)) is not None:
                found.append(AgainstFrontier(task, name, *res[0], res[1]))
    rejected = holm([1.0 if f.gap is None or f.gap.p is None else f.gap.p for f in found])
    return [replace(f, rejected=r) for f, r in zip(found, rejected, strict=True)]


DESCRIBED = (("in-dom. P@1", f"{SPLIT}/pass@1", 100, 1), (f"in-dom. P@{K}", f"{SPLIT}/pass@{K}", 100, 1),
             ("in-dom. distinct", f"{SPLIT}/distinct", 1, 2), ("OOD P@1", "ood/pass@1", 100, 1),
             (f"OOD P@{K}", f"ood/pass@{K}", 100, 1), ("OOD distinct", "ood/distinct", 1, 2))


def describe(tasks: dict[str, Sweeps]) -> str:
    """Every arm's mean ± s.e. over the pre-registered seeds, pi_0's row first (one evaluation)."""
    rows = []
    for task, sweeps in tasks.items():
        base = next((r.metrics for r in sweeps[0] if r.group == BASE), {})
        rows.append([task, "π₀", "1", *(f"{scale * base[key]:.{d}f}" if key in base else "-"
                                        for _, key, scale, d in DESCRIBED)])
        for name, arm in {**ARMS, "J": SECONDARY["J"], **{f"R {a[1]}": a for a in RIVAL}}.items():
            cells = []
            for _, key, scale, d in DESCRIBED:
                values = [r.metrics[key] for r in sweeps[arm[0]]
                          if r.group == arm[1] and r.seed in SEEDS and key in r.metrics]
                cells.append(stat(values).fmt(scale, d) if values else "-")
            n = len(arm_values(sweeps, arm, pass_key(K)))
            if n:
                rows.append([task, f"{name} ({arm[1]})" if len(name) == 1 else name, str(n), *cells])
    return markdown_table(["task", "arm", "seeds", *(h for h, *_ in DESCRIBED)], rows)


def _reads(t: Test) -> str:
    if not t.complete:
        return "incomplete"
    if t.number == 2:
        iv = t.interval()
        if iv is None:
            return "bound not judged: no interval"
        holds = bound_holds(t)
        return (f"bound {'holds' if holds else 'fails'}: lower end {100 * iv[0]:+.1f} "
                f"{'>' if holds else '≤'} -{100 * PASS1_MARGIN:g}")
    reading = ("above" if t.diff.delta > 0 else "below") if t.rejected else "level"
    return reading + (" (s.e. 0: the same difference on every seed)" if t.diff.se == 0 and t.diff.delta else "")


def provenance(tasks: dict[str, Sweeps]) -> str:
    """The commits, dates and highest load the analysed rows ran at, and any resumed cell."""
    rows = [r for sweeps in tasks.values() for rs in sweeps for r in rs if r.group != BASE and r.seed in SEEDS]
    commits = sorted({r.commit or "unrecorded" for r in rows})
    dates = sorted(r.date for r in rows if r.date)
    loads = [r.load for r in rows if r.load is not None]
    resumed = [r.cell for r in rows if r.resumed]
    if not rows:
        return "No cell of the pre-registered seeds."
    return (f"{len(rows)} cells at {', '.join(commits)}" + (f", {dates[0]} to {dates[-1]}" if dates else "")
            + (f", 1-minute load at most {max(loads):.1f}" if loads else "")
            + (f"; resumed after an interruption: {', '.join(resumed)}" if resumed else "") + ".")


def markdown(tests: list[Test], tasks: dict[str, Sweeps]) -> str:
    """The family's table (points of Pass@k), the verdicts, the secondary and descriptive tables."""
    rows = []
    for t in tests:
        d, iv = t.diff, t.interval()
        diff = f"{100 * d.delta:+.1f}" + ("" if d.se is None else f" ± {100 * d.se:.1f}")
        rows.append([t.task, str(t.number), f"{t.a} − {t.b}", f"Pass@{t.k}", "-" if math.isnan(d.delta) else diff,
                     "-" if iv is None else f"[{100 * iv[0]:+.1f}, {100 * iv[1]:+.1f}]",
                     str(t.seeds), "-" if d.p is None else f"{d.p:.4f}",
                     "rejected" if t.rejected else "not rejected", _reads(t)])
    found = verdicts(tests)
    n_tasks = FAMILY_SIZE // len(TESTS)
    supported = sum(v.h1 == "supported" and preregistered(v.task) for v in found)
    decided = sum(v.h1 != "incomplete" and preregistered(v.task) for v in found)
    lines = [markdown_table(["task", "test", "arms", "metric", "difference (points) ± s.e.", "95% interval",
                             "seeds", "p", f"Holm over {FAMILY_SIZE}", "reads"], rows), "",
             *(f"- **{v.task}**: H1 {v.h1}; H2 {v.h2}." for v in found), "",
             f"H1 supported on {supported} of {n_tasks} tasks"
             + ("." if decided == n_tasks else f" (interim: {decided} of {n_tasks} tasks complete).")]
    for task, sweeps in tasks.items():
        if extra := other_seeds(sweeps):
            lines.append(f"{task}: seeds {', '.join(map(str, extra))} ran too and are not analysed.")
    against = secondary(tasks)
    lines += ["", "Secondary (outside the family): Pass@16 minus the reverse-KL frontier's at the arm's own Pass@1, "
              "paired by seed (every Pass@1's and Pass@16's error carried), Holm over the table.", "",
              _against_table(against), "", "Every arm, mean ± s.e. over the seeds (%; distinct: distinct correct "
              "answers per prompt among 16):", "", describe(tasks), "", provenance(tasks)]
    return "\n".join(lines)


def _against_table(against: list[AgainstFrontier]) -> str:
    rows = []
    for f in against:
        verdict = ("-" if f.gap is None else "no p: one seed" if f.gap.p is None
                   else ("above" if f.gap.delta > 0 else "below") if f.rejected else "level")
        if f.gap is not None and f.gap.se == 0 and f.gap.delta:
            verdict += " (s.e. 0: the same gap on every seed)"
        rows.append([f.task, f.arm, str(f.pass1.n), f.pass1.fmt(100, 1), f.pass16.fmt(100, 1),
                     "outside its Pass@1 range" if f.gap is None else fmt(f.gap),
                     "-" if f.gap is None or f.gap.p is None else f"{f.gap.p:.4f}", verdict])
    return markdown_table(["task", "arm", "seeds", "P@1", "P@16", "P@16 − reverse KL's at this P@1", "p", "Holm"],
                          rows)
