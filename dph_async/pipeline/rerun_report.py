"""A rerun's report: what was compared (`RerunReport`), written as report.json (everything) and
report.md (the verdict and the tables)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dph_async.pipeline.report import markdown_table
from dph_async.safe_files import write_output

# What a counterfactual's report puts side by side per step (all metrics are in the two metrics.jsonl).
HEADLINE = ("loss/total", "policy/entropy", "policy/ess", "policy/clip_frac", "policy/mismatch_kl_k3",
            "policy/is_weight_max")


@dataclass
class WeightCheck:
    """The rerun's weights against the run's at one point."""

    what: str  # "checkpoint v4", "final model"
    version: int
    equal: bool  # every tensor bitwise equal
    distance: float  # |w - w_run| / |w_run| over all tensors
    max_abs: float  # the largest |w - w_run| of any element


@dataclass
class StepComparison:
    version: int  # after the step
    differing: list[str]  # metrics whose value is not the run's, bit for bit (and keys only one has)
    run: dict[str, float]  # the headline metrics, as the run logged them
    rerun: dict[str, float]


@dataclass
class RerunReport:
    run_dir: str
    out: str
    overrides: list[str]
    counterfactual: bool  # the learner's config differs from the run's
    start: int  # the version it started from
    end: int  # the version it reached
    stopped: str  # why it stopped there
    steps: list[StepComparison] = field(default_factory=list)
    weights: list[WeightCheck] = field(default_factory=list)

    @property
    def metrics_equal(self) -> bool:
        return all(not s.differing for s in self.steps)

    @property
    def first_difference(self) -> StepComparison | None:
        return next((s for s in self.steps if s.differing), None)

    @property
    def differs(self) -> bool:
        """Some compared metric or weight is not the run's."""
        return not self.metrics_equal or any(not w.equal for w in self.weights)

    @property
    def bitwise(self) -> bool:
        """Every compared step's metrics and every compared weight the run's, bit for bit."""
        return bool(self.steps) and self.metrics_equal and bool(self.weights) and all(w.equal for w in self.weights)


def verdict(report: RerunReport) -> str:
    """One line: what the rerun found."""
    if report.counterfactual:
        last = report.weights[-1] if report.weights else None
        distance = f"; weights at version {last.version} {last.distance:.3e} from the run's (relative L2)" \
            if last else "; no checkpoint of the run to compare weights with"
        return f"counterfactual: {len(report.steps)} steps on the run's batches{distance}"
    diff = report.first_difference
    if diff is not None:
        return (f"NOT the run: at version {diff.version} {len(diff.differing)} metrics differ "
                f"({', '.join(diff.differing[:5])})")
    if not report.weights:
        return f"metrics of {len(report.steps)} steps bitwise equal; no checkpoint or final model to compare weights"
    unequal = [w.what for w in report.weights if not w.equal]
    if unequal:
        return f"metrics bitwise equal, but the weights differ at {', '.join(unequal)}"
    return (f"bitwise the run: metrics of {len(report.steps)} steps and weights at "
            f"{', '.join(w.what for w in report.weights)}")


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _side_by_side(report: RerunReport) -> list[str]:
    keys = [k for k in HEADLINE if any(k in s.run or k in s.rerun for s in report.steps)]
    rows = [[str(s.version), *(f"{_fmt(s.run.get(k))} / {_fmt(s.rerun.get(k))}" for k in keys)]
            for s in report.steps]
    return ["## Per step: run / counterfactual", "", markdown_table(["version", *keys], rows), ""]


def write_report(report: RerunReport, out: Path) -> None:
    data = asdict(report) | {"bitwise": report.bitwise, "verdict": verdict(report)}
    write_output(out / "report.json", json.dumps(data, indent=1))
    learner = " ".join(report.overrides) if report.overrides else "the run's config"
    lines = [f"# rerun of {report.run_dir}", "",
             f"- learner: {learner}{' (counterfactual)' if report.counterfactual else ''}",
             f"- versions {report.start} -> {report.end}; stopped: {report.stopped}",
             f"- result: {verdict(report)}", ""]
    if report.weights:
        lines += ["## Weights against the run's", "",
                  markdown_table(["at", "version", "bitwise equal", "relative L2 distance", "max |diff|"],
                                 [[w.what, str(w.version), "yes" if w.equal else "no", f"{w.distance:.3e}",
                                   f"{w.max_abs:.3e}"] for w in report.weights]), ""]
    if report.counterfactual and report.steps:
        lines += _side_by_side(report)
    lines += ["Per-step metrics: `metrics.jsonl` here and in the run's directory; everything compared: "
              "`report.json`.", ""]
    write_output(out / "report.md", "\n".join(lines))
