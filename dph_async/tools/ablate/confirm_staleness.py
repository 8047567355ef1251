"""The pre-registered staleness tests of docs/preregistration.md, from a sweep's seeds.csv: design 2
(one PPO update per batch) and design 4 (the same with `learner.mini_batches=4`, so decoupled PPO's
clip acts); the computation is one, the rows' mini-batch count is the design's.

One staleness sweep per task (`ablate staleness`, plain GRPO, groups `eta<η>-<correction>`); only
the pre-registered SEEDS are analysed. Per task:

- **binds** (correction, η > 0): on each of the five seeds the consumed groups' mean staleness is >=
  BIND_SHARE x η and the largest is η (seeds.csv's staleness_mean, staleness_max);
- **reading** of (correction, η > 0) against η = 0 of the same correction, paired by seed on in-domain
  Pass@1, at interval level L: degrades when the interval's upper end is below 0 and its lower end at
  or below -MARGIN; keeps when its lower end is above -MARGIN; undecided otherwise; not judged when
  a seed is missing on either side (named) or it does not bind;
- **S1**, AReaL's shape: (i) decoupled keeps at η = 1, 2, 4 (95%); (ii) coupled (`behavior`) degrades
  at some η at which decoupled keeps, coupled's reading at 99% (Bonferroni over its five η > 0);
  (iii) decoupled's throughput at η = 4 over η = 0, the 95% interval of the per-seed ratios'
  geometric mean above 1 (a resumed cell's pair is left out: its wall time holds the pause);
- **S2**, auto: its Pass@1 minus decoupled η = 1's has its 95% interval's lower end above -MARGIN, and
  the geometric mean of its per-seed throughput over the best binding fixed η >= 1's (decoupled, by
  geometric mean throughput) is at least AUTO_RATIO; not judged while a fixed η's cells are missing.

Throughput: fresh samples per wall second of the training steps (seeds.csv's samples / wall_s).
The clip fraction and the behaviour-to-learner KL (seeds.csv's clip_frac and mismatch_kl_k1, where
recorded) are shown beside, not judged.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from dph_async.pipeline.report import markdown_table
from dph_async.stats import paired, ratio_interval, t_critical
from dph_async.tools.ablate.seeds import BASE, SeedRow, repeated_seed

SEEDS = (200, 201, 202, 203, 204)
ETAS = (0, 1, 2, 4, 8, 16)
BIND_SHARE = 0.75
MARGIN = 0.03
AUTO_RATIO = 0.9
STEPS = 100
MODE = "grpo"
PASS1 = "in_domain/pass@1"
LOAD_LIMIT = 4.0  # cells ending above this 1-minute load are listed
# Diagnostics shown beside the readings where the rows have them (means over a cell's steps, then seeds).
DIAGNOSED = {"clip_frac": "clip fraction (mean)", "mismatch_kl_k1": "mismatch KL (mean)"}


def check_rows(task: str, rows: list[SeedRow], mini_batches: int) -> None:
    """Refuse rows that cannot be the design's: another task, step count, objective or mini-batch count,
    a seed twice, or a cell without the figures its verdicts read (Pass@1, a positive wall time,
    staleness)."""
    if twice := repeated_seed(rows):
        raise ValueError(f"{task}: group {twice[0]} has seed {twice[1]} twice")
    for r in rows:
        if r.task != task or r.steps != STEPS or (r.group != BASE and r.mode != MODE):
            raise ValueError(f"{task}, cell {r.cell}: task {r.task}, {r.steps} steps, objective {r.mode}; the design "
                             f"runs {task}, {STEPS} steps, {MODE}")
        if r.mini_batches != mini_batches:
            raise ValueError(f"{task}, cell {r.cell}: learner.mini_batches={r.mini_batches}; the design runs "
                             f"{mini_batches} (another design's rows?)")
        if r.group == BASE or r.seed not in SEEDS:
            continue
        need = [PASS1, "samples", "wall_s", *(() if r.group.startswith("etaauto") else ("staleness_mean",
                                                                                       "staleness_max"))]
        if lacking := [k for k in need if k not in r.metrics]:
            raise ValueError(f"{task}, cell {r.cell}: no {', '.join(lacking)}")
        if r.metrics["wall_s"] <= 0:
            raise ValueError(f"{task}, cell {r.cell}: wall_s {r.metrics['wall_s']!r} is not a positive time")
    if len({r.base for r in rows}) > 1:
        raise ValueError(f"{task}: the rows start from more than one pi_0 (base fingerprints differ)")


def missing(rows: list[SeedRow], eta: int | str, correction: str) -> list[int]:
    """Pre-registered seeds without a cell of (η, correction)."""
    return sorted(set(SEEDS) - cells(rows, eta, correction).keys())


def cells(rows: list[SeedRow], eta: int | str, correction: str) -> dict[int, SeedRow]:
    """seed -> the cell of (η, correction), over the pre-registered seeds."""
    return {r.seed: r for r in rows if r.group == f"eta{eta}-{correction}" and r.seed in SEEDS}


def throughput(r: SeedRow) -> float:
    return r.metrics["samples"] / r.metrics["wall_s"]


def binds(rows: list[SeedRow], eta: int, correction: str) -> bool:
    """Every seed's consumed groups reach BIND_SHARE x eta on average and eta at most (eta > 0)."""
    return not missing(rows, eta, correction) and all(
        r.metrics["staleness_mean"] >= BIND_SHARE * eta and r.metrics["staleness_max"] == eta
        for r in cells(rows, eta, correction).values())


@dataclass(frozen=True)
class Reading:
    correction: str
    eta: int | str
    delta: float | None  # Pass@1 minus the reference's, mean over the paired seeds
    low: float | None
    high: float | None
    seeds: int
    outcome: str  # degrades, keeps, undecided, not judged: <why>


def read(rows: list[SeedRow], eta: int | str, correction: str, level: float = 0.95,
         against: tuple[int, str] | None = None) -> Reading:
    """(η, correction) against η = 0 of the same correction (or `against`: (η, correction)) on Pass@1."""
    ref_eta, ref_corr = against or (0, correction)
    a = {s: r.metrics[PASS1] for s, r in cells(rows, eta, correction).items()}
    b = {s: r.metrics[PASS1] for s, r in cells(rows, ref_eta, ref_corr).items()}
    n = len(a.keys() & b.keys())
    if lacking := sorted(set(missing(rows, eta, correction)) | set(missing(rows, ref_eta, ref_corr))):
        return Reading(correction, eta, None, None, None, n,
                       f"not judged: seed {', '.join(map(str, lacking))} missing")
    if isinstance(eta, int) and not binds(rows, eta, correction):
        return Reading(correction, eta, None, None, None, n, "not judged: did not bind")
    d = paired(a, b)
    half = t_critical(d.df, 1.0 - level) * d.se
    low, high = d.delta - half, d.delta + half
    if high < 0 and low <= -MARGIN:
        outcome = "degrades"
    elif low > -MARGIN:
        outcome = "keeps"
    else:
        outcome = "undecided"
    return Reading(correction, eta, d.delta, low, high, n, outcome)


def throughput_ratio(rows: list[SeedRow], a: tuple[int | str, str], b: tuple[int | str, str]):
    """The geometric mean of per-seed throughput a / b and its 95% interval; resumed cells left out."""
    ca, cb = cells(rows, *a), cells(rows, *b)
    pairs = [(throughput(ca[s]), throughput(cb[s])) for s in sorted(ca.keys() & cb.keys())
             if not ca[s].resumed and not cb[s].resumed]
    return ratio_interval(pairs) if len(pairs) == len(SEEDS) else None


@dataclass(frozen=True)
class TaskVerdict:
    task: str
    parts: dict[str, bool | None]  # S1's (i), (ii), (iii): True, False, or None (not judged)
    s1: str
    s2: str


def s1_parts(rows: list[SeedRow]) -> dict[str, bool | None]:
    keeps = [read(rows, eta, "decoupled").outcome for eta in (1, 2, 4)]
    part1 = None if any(o.startswith("not judged") for o in keeps) else all(o == "keeps" for o in keeps)
    pairs = [(read(rows, eta, "behavior", level=0.99).outcome, read(rows, eta, "decoupled").outcome)
             for eta in ETAS[1:]]
    if any(c == "degrades" and d == "keeps" for c, d in pairs):
        part2 = True
    elif any(c.startswith("not judged") or d.startswith("not judged") for c, d in pairs):
        part2 = None
    else:
        part2 = False
    ratio = throughput_ratio(rows, (4, "decoupled"), (0, "decoupled")) if binds(rows, 4, "decoupled") else None
    part3 = None if ratio is None else ratio.low > 1.0
    return {"(i)": part1, "(ii)": part2, "(iii)": part3}


def s1_verdict(parts: dict[str, bool | None]) -> str:
    if any(v is None for v in parts.values()):
        return "not judged: " + ", ".join(k for k, v in parts.items() if v is None)
    held = [k for k, v in parts.items() if v]
    if len(held) == len(parts):
        return "reproduced"
    return f"partly: {', '.join(held)}" if held else "not reproduced"


def best_fixed(rows: list[SeedRow]) -> int | None:
    """Decoupled's binding η >= 1 with the highest geometric mean throughput over its seeds."""
    scored = {}
    for eta in ETAS[1:]:
        have = cells(rows, eta, "decoupled")
        if binds(rows, eta, "decoupled"):
            scored[eta] = statistics.fmean(math.log(throughput(r)) for r in have.values())
    return max(scored, key=scored.__getitem__) if scored else None


def s2_verdict(rows: list[SeedRow]) -> str:
    if not cells(rows, "auto", "decoupled"):
        return "not judged: no auto cells"
    if absent := [str(eta) for eta in ETAS[1:] if missing(rows, eta, "decoupled")]:
        return f"not judged: decoupled eta {', '.join(absent)} lacks seeds"
    accuracy = read(rows, "auto", "decoupled", against=(1, "decoupled"))
    best = best_fixed(rows)
    if accuracy.low is None or best is None:
        return "not judged: " + (accuracy.outcome if accuracy.low is None else "no fixed eta binds")
    ratio = throughput_ratio(rows, ("auto", "decoupled"), (best, "decoupled"))
    if ratio is None:
        return f"not judged: a seed of auto or eta {best} missing or resumed (its throughput is run again)"
    ok = accuracy.low > -MARGIN and ratio.ratio >= AUTO_RATIO
    return (f"{'passes' if ok else 'fails'} (Pass@1 − eta 1's lower end {100 * accuracy.low:+.1f} points; "
            f"throughput {ratio.ratio:.2f}x eta {best}'s)")


def verdict(task: str, rows: list[SeedRow], mini_batches: int = 1) -> TaskVerdict:
    check_rows(task, rows, mini_batches)
    parts = s1_parts(rows)
    return TaskVerdict(task, parts, s1_verdict(parts), s2_verdict(rows))


def markdown(tasks: dict[str, list[SeedRow]], mini_batches: int = 1) -> str:
    """Per task: every (correction, η) with its staleness, reading and throughput ratio (and clip
    fraction and mismatch KL, where the rows record them); the verdicts."""
    lines = []
    for task, rows in tasks.items():
        v = verdict(task, rows, mini_batches)
        shown = [k for k in DIAGNOSED if any(k in r.metrics for r in rows)]
        table = []
        for correction in ("behavior", "decoupled"):
            auto = read(rows, "auto", correction, against=(1, correction))
            auto_ratio = throughput_ratio(rows, ("auto", correction), (1, correction))
            if cells(rows, "auto", correction):
                table.append([task, correction, "auto (against η 1)", "-", "-",
                              "-" if auto.delta is None else f"{100 * auto.delta:+.1f} [{100 * auto.low:+.1f}, "
                                                             f"{100 * auto.high:+.1f}]",
                              auto.outcome, "-", "-" if auto_ratio is None else auto_ratio.fmt(),
                              *(_mean(cells(rows, "auto", correction), k) for k in shown)])
            for eta in ETAS[1:]:
                have = cells(rows, eta, correction)
                r95 = read(rows, eta, correction)
                ratio = throughput_ratio(rows, (eta, correction), (0, correction))
                stale = [r.metrics["staleness_mean"] for r in have.values()]
                table.append([task, correction, str(eta), "yes" if binds(rows, eta, correction) else "no",
                              f"{statistics.fmean(stale):.2f}" if stale else "-",
                              "-" if r95.delta is None else f"{100 * r95.delta:+.1f} [{100 * r95.low:+.1f}, "
                                                            f"{100 * r95.high:+.1f}]",
                              r95.outcome, read(rows, eta, correction, 0.99).outcome if correction == "behavior"
                              else "-", "-" if ratio is None else ratio.fmt(), *(_mean(have, k) for k in shown)])
        lines += [markdown_table(["task", "correction", "η", "binds", "staleness (mean)",
                                  "Pass@1 − η 0's (points, 95%)", "reading (95%)", "reading (99%)",
                                  "throughput ratio (against η 0; auto: η 1)",
                                  *(DIAGNOSED[k] for k in shown)], table), "",
                  f"- **{task}**: S1 {v.s1} ({', '.join(f'{k} {_word(x)}' for k, x in v.parts.items())}); "
                  f"S2 auto {v.s2}.", ""]
        analysed = [r for r in rows if r.seed in SEEDS and r.group != BASE]
        if loaded := [r.cell for r in analysed if r.load is not None and r.load > LOAD_LIMIT]:
            lines.append(f"{task}: 1-minute load above {LOAD_LIMIT:g} at the end of {', '.join(loaded)}.")
        if resumed := [r.cell for r in analysed if r.resumed]:
            lines.append(f"{task}: resumed (throughput left out until run again): {', '.join(resumed)}.")
        if mini_batches > 1:
            lines.append(f"{task}: {premise(analysed)}")
    return "\n".join(lines)


def premise(rows: list[SeedRow]) -> str:
    """Design 4's premise, checked before its verdicts are read: decoupled's clip acted (clip fraction
    above 0) in every decoupled cell with η >= 1."""
    decoupled = [r for r in rows if r.group.endswith("-decoupled") and r.group != "eta0-decoupled"]
    unknown = [r.cell for r in decoupled if "clip_frac" not in r.metrics]
    idle = [r.cell for r in decoupled if r.metrics.get("clip_frac") == 0.0]
    if not decoupled:
        return "premise not checked: no decoupled cell with eta >= 1."
    if idle or unknown:
        return ("premise not met: the design did not test what it means to"
                + (f"; no clip in {', '.join(idle)}" if idle else "")
                + (f"; clip fraction not recorded in {', '.join(unknown)}" if unknown else "") + ".")
    return f"premise holds: decoupled's clip acted in all {len(decoupled)} decoupled cells with eta >= 1."


def _mean(have: dict[int, SeedRow], key: str) -> str:
    values = [r.metrics[key] for r in have.values() if key in r.metrics]
    return f"{statistics.fmean(values):.3f}" if values else "-"


def _word(x: bool | None) -> str:
    return "not judged" if x is None else "holds" if x else "fails"
