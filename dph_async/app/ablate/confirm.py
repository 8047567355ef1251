"""The pre-registered confirmatory test of docs/preregistration.md, from the sweeps' seeds.csv.

Per task two sweeps: the first holds A (`grpo@d_exp`, the control) and B (`js_low_var:0.2`, DPH-JS as
written), the second, run with `learner.loss.reference_pg_share=0.375`, holds C (`js_low_var:0.2`:
DPH-JS as the official script's batches train it) and D (`dpef_pg`: that policy-gradient term alone).
B and C share a group name; which sweep a row came from tells them apart.

The family, per task, on the final model's in-domain Pass@k (paired by seed, two-sided Student's t at
df = n - 1, `dph_async.stats`):

    1  C - A  Pass@16        3  D - A  Pass@16        5  B - A  Pass@16
    2  C - A  Pass@1         4  C - D  Pass@16

Holm's step-down over the whole family of FAMILY_SIZE tests (two tasks x five) at 0.05; a test whose
task was not given counts as p = 1, so fewer tasks never make a rejection easier. Verdicts, fixed in
advance:

    H1 supported     test 1 rejected with C above A, and test 2's 95% interval above -PASS1_MARGIN
    H2 "PG term"     test 3 rejected with D above A, test 4 not rejected
    H2 "divergence adds"   test 4 rejected with C above D
    H2 "undecided"   otherwise

A task whose arms do not all hold the pre-registered seeds gets no verdict ("incomplete"), only its
differences so far.

Secondary, outside the family: J (`js_low_var:200 share25`), B, C and D against the reverse-KL
frontier of the first sweep (`reverse_kl` at 0.01, 0.1, 1) at their own Pass@1, every Pass@1's and
Pass@16's error carried (`frontier.Chord.gap`), Holm within each task's table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from dph_async.app.ablate.frontier import chord, fmt
from dph_async.app.ablate.results import Stat, stat
from dph_async.app.ablate.seeds import BASE, SeedRow
from dph_async.app.plot_colours import colour_map, pyplot
from dph_async.app.report import markdown_table
from dph_async.stats import Difference, holm, paired, t_critical

SEEDS = (100, 101, 102, 103, 104)
FAMILY_SIZE = 10
PASS1_MARGIN = 0.03  # "rises like GRPO's": at most 3 points of Pass@1 below the control
SPLIT = "in_domain"
K = 16
# arm -> (sweep: 0 first, 1 second, group name in its seeds.csv)
ARMS = {"A": (0, "grpo@d_exp"), "B": (0, "js_low_var:0.2"), "C": (1, "js_low_var:0.2"), "D": (1, "dpef_pg")}
SECONDARY = {"J": (0, "js_low_var:200 share25"), "B": ARMS["B"], "C": ARMS["C"], "D": ARMS["D"]}
RIVAL = tuple((0, f"reverse_kl:{c}") for c in ("0.01", "0.1", "1"))
# (number, a, b, k): a - b on Pass@k
TESTS = ((1, "C", "A", K), (2, "C", "A", 1), (3, "D", "A", K), (4, "C", "D", K), (5, "B", "A", K))


@dataclass(frozen=True)
class Test:
    task: str
    number: int
    a: str
    b: str
    k: int
    diff: Difference
    seeds: int
    rejected: bool = False  # by Holm over the family

    def interval(self) -> tuple[float, float] | None:
        """The unadjusted 95% interval of a - b (t at the test's df)."""
        if self.diff.se is None or self.diff.df is None:
            return None
        half = t_critical(self.diff.df) * self.diff.se
        return self.diff.delta - half, self.diff.delta + half


@dataclass(frozen=True)
class Verdict:
    task: str
    h1: str
    h2: str


def arm_values(sweeps: tuple[list[SeedRow], list[SeedRow]], arm: str | tuple[int, str], k: int) -> dict[int, float]:
    """seed -> the arm's final in-domain Pass@k (an arm by its letter, or as (sweep, group)); a column
    the rows lack is named."""
    sweep, group = ARMS[arm] if isinstance(arm, str) else arm
    key = f"{SPLIT}/pass@{k}"
    out = {}
    for r in sweeps[sweep]:
        if r.group == group:
            if key not in r.metrics:
                raise ValueError(f"arm {arm} ({group}), cell {r.cell}: no column {key}")
            out[r.seed] = r.metrics[key]
    return out


def family(tasks: dict[str, tuple[list[SeedRow], list[SeedRow]]]) -> list[Test]:
    """The five tests of every task given, with Holm's decisions over FAMILY_SIZE."""
    if len(tasks) * len(TESTS) > FAMILY_SIZE:
        raise ValueError(f"the pre-registered family has {FAMILY_SIZE // len(TESTS)} tasks, got {len(tasks)}")
    tests = []
    for task, sweeps in tasks.items():
        for number, a, b, k in TESTS:
            va, vb = arm_values(sweeps, a, k), arm_values(sweeps, b, k)
            tests.append(Test(task, number, a, b, k, paired(va, vb), len(va.keys() & vb.keys())))
    ps = [t.diff.p for t in tests] + [1.0] * (FAMILY_SIZE - len(tests))
    rejected = holm(ps)
    return [replace(t, rejected=r) for t, r in zip(tests, rejected, strict=False)]


def complete(sweeps: tuple[list[SeedRow], list[SeedRow]]) -> bool:
    """Every arm holds every pre-registered seed."""
    return all(set(SEEDS) <= arm_values(sweeps, arm, K).keys() for arm in ARMS)


def verdicts(tests: list[Test], tasks: dict[str, tuple[list[SeedRow], list[SeedRow]]]) -> list[Verdict]:
    out = []
    for task, sweeps in tasks.items():
        if not complete(sweeps):
            out.append(Verdict(task, "incomplete", "incomplete"))
            continue
        t = {x.number: x for x in tests if x.task == task}
        low = (t[2].interval() or (float("-inf"), 0.0))[0]
        h1 = t[1].rejected and t[1].diff.delta > 0 and low > -PASS1_MARGIN
        if t[4].rejected and t[4].diff.delta > 0:
            h2 = "the divergence adds"
        elif t[3].rejected and t[3].diff.delta > 0 and not t[4].rejected:
            h2 = "the PG term's"
        else:
            h2 = "undecided"
        out.append(Verdict(task, "supported" if h1 else "not supported", h2))
    return out


@dataclass(frozen=True)
class AgainstFrontier:
    task: str
    arm: str
    pass1: Stat
    pass16: Stat
    gap: Difference | None  # Pass@16 minus the reverse-KL frontier's at this Pass@1; None outside its range
    rejected: bool = False  # by Holm within the task's table


def _point(sweeps: tuple[list[SeedRow], list[SeedRow]], arm: tuple[int, str]) -> tuple[Stat, Stat] | None:
    p1, p16 = arm_values(sweeps, arm, 1), arm_values(sweeps, arm, K)
    return (stat(list(p1.values())), stat(list(p16.values()))) if p1 and p16 else None


def secondary(tasks: dict[str, tuple[list[SeedRow], list[SeedRow]]]) -> list[AgainstFrontier]:
    """J, B, C and D against the first sweep's reverse-KL frontier at matched Pass@1."""
    out = []
    for task, sweeps in tasks.items():
        rival = [p for arm in RIVAL if (p := _point(sweeps, arm)) is not None]
        found = []
        for name, arm in SECONDARY.items():
            if (point := _point(sweeps, arm)) is None:
                continue
            c = chord(rival, point[0].mean)
            found.append(AgainstFrontier(task, name, *point, None if c is None else c.gap(*point)))
        rejected = holm([None if f.gap is None else f.gap.p for f in found])
        out += [replace(f, rejected=r) for f, r in zip(found, rejected, strict=True)]
    return out


def markdown(tests: list[Test], found: list[Verdict], against: list[AgainstFrontier] | None = None) -> str:
    """The family's table (points of Pass@k), the verdicts, and the secondary table when given."""
    rows = []
    for t in tests:
        d, iv = t.diff, t.interval()
        rows.append([t.task, str(t.number), f"{t.a} − {t.b}", f"Pass@{t.k}",
                     f"{100 * d.delta:+.1f}" + ("" if d.se is None else f" ± {100 * d.se:.1f}"),
                     "-" if iv is None else f"[{100 * iv[0]:+.1f}, {100 * iv[1]:+.1f}]",
                     str(t.seeds), "-" if d.p is None else f"{d.p:.4f}", "rejected" if t.rejected else "not rejected"])
    lines = [markdown_table(["task", "test", "arms", "metric", "difference (points) ± s.e.", "95% interval", "seeds",
                             "p", f"Holm over {FAMILY_SIZE}"], rows), ""]
    lines += [f"- **{v.task}**: H1 {v.h1}; H2 {v.h2}." for v in found]
    supported = sum(v.h1 == "supported" for v in found)
    lines += ["", f"H1 supported on {supported} of {len(found)} tasks."]
    if against:
        lines += ["", "Secondary (outside the family): Pass@16 against the reverse-KL frontier at the arm's own "
                  "Pass@1, every Pass@1's and Pass@16's error carried, Holm within each task.", "",
                  _against_table(against)]
    return "\n".join(lines)


def _against_table(against: list[AgainstFrontier]) -> str:
    rows = []
    for f in against:
        verdict = "-" if f.gap is None else ("above" if f.gap.delta > 0 else "below") if f.rejected else "level"
        rows.append([f.task, f.arm, str(f.pass1.n), f.pass1.fmt(100, 1), f.pass16.fmt(100, 1),
                     "outside its Pass@1 range" if f.gap is None else fmt(f.gap),
                     "-" if f.gap is None or f.gap.p is None else f"{f.gap.p:.4f}", verdict])
    return markdown_table(["task", "arm", "seeds", "P@1", "P@16", "P@16 − reverse KL's at this P@1", "p", "Holm"],
                          rows)


ARM_LABELS = {"A": "A grpo@d_exp (control)", "B": "B DPH-JS 0.2 as written", "C": "C DPH-JS 0.2 as run",
              "D": "D PG on D_pef alone", "J": "J DPH-JS 200, pool 25%"}


def plot(tasks: dict[str, tuple[list[SeedRow], list[SeedRow]]], out: Path) -> None:
    """One panel per task: in-domain Pass@16 against Pass@1 of the final models, mean ± s.e. over seeds
    on both axes; the reverse-KL frontier as a line through its three coefficients, the arms as
    points, pi_0 as a star."""
    plt = pyplot()
    colour = colour_map(["reverse KL", *ARM_LABELS])
    fig, axes = plt.subplots(1, len(tasks), figsize=(6.5 * len(tasks), 5), squeeze=False)
    for ax, (task, sweeps) in zip(axes[0], tasks.items(), strict=True):
        rival = [(arm[1].split(":")[1], p) for arm in RIVAL if (p := _point(sweeps, arm)) is not None]
        if rival:
            _errorbar(ax, [p for _, p in rival], colour["reverse KL"], "reverse KL (0.01, 0.1, 1)", "-o")
            for coeff, (x, y) in rival:
                ax.annotate(coeff, (100 * x.mean, 100 * y.mean), textcoords="offset points", xytext=(4, 4),
                            fontsize=7)
        for name, arm in {"A": ARMS["A"], **SECONDARY}.items():
            if (point := _point(sweeps, arm)) is not None:
                _errorbar(ax, [point], colour[name], ARM_LABELS[name], "s")
        base = next((r.metrics for r in sweeps[0] if r.group == BASE), None)
        if base is not None and f"{SPLIT}/pass@{K}" in base:
            ax.plot(100 * base[f"{SPLIT}/pass@1"], 100 * base[f"{SPLIT}/pass@{K}"], "k*", ms=12, label="π₀")
        ax.set(title=f"{task}: in-domain Pass@{K} against Pass@1", xlabel="Pass@1 (%)", ylabel=f"Pass@{K} (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _errorbar(ax, points: list[tuple[Stat, Stat]], colour: str, label: str, fmt: str) -> None:
    ax.errorbar([100 * x.mean for x, _ in points], [100 * y.mean for _, y in points],
                xerr=[100 * (x.se or 0.0) for x, _ in points], yerr=[100 * (y.se or 0.0) for _, y in points],
                fmt=fmt, color=colour, label=label, capsize=2, ms=5)
