"""One colour per run in every panel of every plot: read back from the matplotlib figures a run's
report, a sweep's report and a soak draw, where some panels lack some runs (GRPO logs no divergence,
a sweep's panel may lack a group)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.figure
import pytest
from matplotlib.colors import to_hex

from dph_async.pipeline.report import pass_at_k_figure, run_colours, training_figure
from dph_async.runtime.evaluate import SplitResult
from dph_async.tools.ablate import plots as sweep_plots
from dph_async.tools.ablate.cells import Cell
from dph_async.tools.ablate.results import CellResult, EvalPoint, Group, Stat
from dph_async.tools.soak import ProcessSample, Sample, SoakResult
from dph_async.tools.soak import plot as soak_plot


def colours_by_label(figures: list[matplotlib.figure.Figure]) -> dict[str, dict[str, set[str]]]:
    """{label: {panel title: colours}} of every labelled line and bar series in the figures."""
    seen: dict[str, dict[str, set[str]]] = {}
    for fig in figures:
        for i, ax in enumerate(fig.axes):
            panel = f"{id(fig)}:{i}:{ax.get_title()}"
            series = [(line.get_label(), line.get_color()) for line in ax.get_lines()]
            series += [(c.get_label(), c.patches[0].get_facecolor()) for c in ax.containers if c.patches]
            for label, colour in series:
                if not label.startswith("_"):  # matplotlib's own unlabelled artists
                    seen.setdefault(label, {}).setdefault(panel, set()).add(to_hex(colour))
    return seen


def assert_one_colour_each(seen: dict[str, dict[str, set[str]]], labels: set[str]) -> None:
    """Each of `labels` is drawn in several panels, and every label in one colour wherever it is drawn."""
    assert labels <= set(seen)
    for label in labels:
        assert len(seen[label]) > 1, f"{label} is drawn in one panel only: the test would show nothing"
    for label, panels in seen.items():
        colours = set().union(*panels.values())
        assert len(colours) == 1, f"{label} has colours {colours} across {sorted(panels)}"


@pytest.fixture
def saved(monkeypatch) -> list[matplotlib.figure.Figure]:
    """Every figure saved during the test (written nowhere)."""
    figures: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **kw: figures.append(fig))
    return figures


def split_result(name: str, p1: float, p4: float) -> SplitResult:
    return SplitResult(name, 10, 0.5, {1: p1, 2: (p1 + p4) / 2, 4: p4}, p1, 1.5, 1.0, samples=4)


def test_a_run_has_one_colour_in_every_panel_of_the_runs_figures():
    modes = ["grpo@d_exp", "js_low_var", "reverse_kl_0.1"]

    def rows(mode: str) -> list[dict[str, float]]:
        out = []
        for v in range(1, 6):
            row = {"learner/version": v, "reward/mean": 0.1 * v, "policy/entropy": 1.0 / v, "staleness/mean": 0.5}
            if mode != "grpo@d_exp":  # GRPO has no divergence to a reference
                row["loss/divergence_ref"] = 0.01 * v
            out.append(row)
        return out

    colours = run_colours(modes)
    training = training_figure({m: rows(m) for m in modes}, colours)
    evals = {name: {s: split_result(s, 0.3 + 0.01 * i, 0.8) for s in ("in_domain", "ood")}
             for i, name in enumerate(["base", *modes])}
    pass_at_k = pass_at_k_figure(evals, colours)
    seen = colours_by_label([training, pass_at_k])
    assert_one_colour_each(seen, set(modes))
    assert len({c for m in modes for c in set().union(*seen[m].values())}) == len(modes)
    divergence = next(a for a in training.axes if a.get_title() == "divergence (ref)")
    assert [line.get_label() for line in divergence.get_lines()] == ["js_low_var", "reverse_kl_0.1"]
    assert seen["base"].keys() and all(c == {"#000000"} for c in seen["base"].values())


def group(eta: int, correction: str, reward: float) -> Group:
    cell = Cell(f"eta{eta}-{correction}-seed0", f"eta{eta}-{correction}", {"eta": eta, "correction": correction}, 0,
                "js_low_var")
    evals = [EvalPoint(v, 100.0 * v, 10.0 * v, {"in_domain": split_result("in_domain", 0.3 + 0.1 * v, 0.9)})
             for v in range(3)]
    result = CellResult(cell, [1, 2, 3], [100.0, 200.0, 300.0], [1.0, 2.0, 3.0], [reward] * 3, evals,
                        {0: 10, eta: 5}, {}, {}, False)
    metrics = {"reward": Stat(reward, 0.01, 1), "in_domain/pass@4": Stat(0.9, 0.01, 1), "ess": Stat(0.99, 0.0, 1),
               "mismatch_kl_k3": Stat(0.001, 0.0, 1)}
    return Group(cell.group, dict(cell.factors), [result], metrics)


def test_a_group_has_one_colour_in_every_panel_of_a_sweeps_figures(saved):
    # The "masked" panel lacks eta=0, so eta=1 is its first line: it must keep eta=1's colour.
    groups = [group(0, "decoupled", 0.5), group(1, "decoupled", 0.6), group(1, "masked", 0.55),
              group(2, "masked", 0.4), group(2, "decoupled", 0.45)]
    out = Path("unused.png")
    sweep_plots.plot_curves(groups, "correction", out)
    sweep_plots.plot_pass_at_k(groups, "correction", out)
    sweep_plots.plot_staleness(groups, "correction", out)
    assert_one_colour_each(colours_by_label(saved), {"eta=0", "eta=1", "eta=2"})
    saved.clear()
    # The summary's lines are the panels' values: one colour per correction over its four metrics.
    sweep_plots.plot_summary(groups, "eta", "correction", 4, "in_domain", out)
    (summary,) = saved
    seen: dict[str, dict[str, set[str]]] = {}
    for i, ax in enumerate(summary.axes):
        for c in ax.containers:  # errorbar() labels its container; its first line is the data line
            seen.setdefault(c.get_label(), {})[str(i)] = {to_hex(c.lines[0].get_color())}
    assert_one_colour_each(seen, {"correction=decoupled", "correction=masked"})


def test_a_process_has_one_colour_in_every_panel_of_the_soak_figure(saved):
    samples = [Sample(60.0 * i, {name: ProcessSample(2**30 + i, 100, 40, 10.0 * i * (k + 1))
                                 for k, name in enumerate(("actor0", "learner", "replay_gate"))},
                      4, 2**20, 2, 2**20, 100.0 * i, 0.0, 0.0) for i in range(5)]
    soak_plot(SoakResult(samples, [], {"warmup_s": 60.0}), Path("unused.png"))
    seen = colours_by_label(saved)
    assert_one_colour_each(seen, {"actor0", "learner", "replay_gate"})
    series = [c for panels in seen.values() for c in set().union(*panels.values())]
    assert len(series) == len(set(series)) == 6  # three processes, three disk series: none shares a colour
