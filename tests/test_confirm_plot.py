"""Design 1's figure (dph_async/tools/ablate/confirm_plot.py), read back from matplotlib: per task a panel
whose points sit at each arm's mean over the pre-registered seeds with its standard error as the
error bar, the reverse-KL line through its three coefficients in order, and pi_0's star, on the
committed confirmatory data."""

from __future__ import annotations

import statistics
from pathlib import Path

import numpy as np
import pytest

from dph_async.tools.ablate import confirm, confirm_plot
from dph_async.tools.ablate.seeds import read_seeds

PREREG = Path(__file__).resolve().parents[1] / "docs" / "data" / "prereg"


@pytest.fixture(scope="module")
def tasks() -> dict[str, confirm.Sweeps]:
    return {t: (read_seeds(PREREG / f"{t}.csv"), read_seeds(PREREG / f"{t}-asrun.csv")) for t in confirm.TASKS}


def _mean_se(sweeps: confirm.Sweeps, sweep: int, group: str, column: str) -> tuple[float, float]:
    values = [r.metrics[column] for r in sweeps[sweep] if r.group == group and r.seed in confirm.SEEDS]
    assert len(values) == len(confirm.SEEDS)
    return 100 * statistics.fmean(values), 100 * statistics.stdev(values) / len(values) ** 0.5


def _bars(ax) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """label -> (x, y, x half-widths, y half-widths) of each errorbar container."""
    out = {}
    for c in ax.containers:
        line, _, (xbars, ybars) = c.lines[0], c.lines[1], c.lines[2]
        x, y = (np.asarray(v, dtype=float) for v in line.get_data())
        xs = np.array([abs(s[1][0] - s[0][0]) / 2 for s in xbars.get_segments()])
        ys = np.array([abs(s[1][1] - s[0][1]) / 2 for s in ybars.get_segments()])
        out[c.get_label()] = (x, y, xs, ys)
    return out


def test_each_panel_puts_every_arm_at_its_mean_and_standard_error(tasks):
    fig = confirm_plot.figure(tasks)
    try:
        axes = fig.axes
        assert [a.get_title() for a in axes] == [f"{t}: in-domain Pass@16 against Pass@1" for t in confirm.TASKS]
        for ax, sweeps in zip(axes, tasks.values(), strict=True):
            bars = _bars(ax)
            arms = {"A": confirm.ARMS["A"], **confirm.SECONDARY}
            assert set(bars) == {confirm_plot.RIVAL_LABEL, *(confirm_plot.ARM_LABELS[n] for n in arms)}
            for name, (sweep, group) in arms.items():
                x, y, xs, ys = bars[confirm_plot.ARM_LABELS[name]]
                (mx, sx), (my, sy) = (_mean_se(sweeps, sweep, group, f"in_domain/pass@{k}") for k in (1, 16))
                np.testing.assert_allclose([x[0], y[0], xs[0], ys[0]], [mx, my, sx, sy], rtol=1e-12, atol=1e-12)
            x, y, _, _ = bars[confirm_plot.RIVAL_LABEL]
            expect = [_mean_se(sweeps, 0, g, f"in_domain/pass@{k}")[0] for _, g in confirm.RIVAL for k in (1, 16)]
            np.testing.assert_allclose(np.column_stack([x, y]).ravel(), expect, rtol=1e-12)
            assert [t.get_text() for t in ax.texts] == ["0.01", "0.1", "1"]
            base = next(r.metrics for r in sweeps[0] if r.group == "pi_0")
            star = [line for line in ax.lines if line.get_label() == "π₀"]
            assert len(star) == 1 and star[0].get_marker() == "*"
            assert star[0].get_xydata().tolist() == [[100 * base["in_domain/pass@1"], 100 * base["in_domain/pass@16"]]]
    finally:
        confirm_plot.pyplot().close(fig)


def test_plot_writes_a_png(tasks, tmp_path):
    out = tmp_path / "deep" / "f.png"
    confirm_plot.plot({"embedded": tasks["embedded"]}, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
