"""The auto staleness controller's rule at its edges (learner/staleness_control.py): a window's mean
exactly at the target, a bound reached exactly, a wait exactly at its minimum, windows whose steps
differ (the mean decides, not the first or the last step), growth from a bound of 0, and relations
that hold for any sequence of steps: eta stays within its limits, decides once per window, and a
controller restored from its state decides as the original does."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dph_async.config.replay import ReplayConfig
from dph_async.learner.staleness_control import Decision, StalenessController, StalenessRule


def rule(**kw) -> StalenessRule:
    return StalenessRule(**({"minimum": 1, "maximum": 16, "target": 0.9, "window": 2, "min_wait": 0.1} | kw))


def step(ess: float, staleness: int, wait: float = 0.5) -> dict[str, float]:
    return {"policy/ess": ess, "staleness/max": float(staleness), "time/data_wait": wait}


def window(c: StalenessController, *steps: dict[str, float]) -> Decision:
    """Feed one window's steps; the decision of its last."""
    decisions = [c.observe(s) for s in steps]
    assert all(d.signal is None for d in decisions[:-1])
    return decisions[-1]


def test_the_rule_is_read_from_the_replay_config():
    cfg = ReplayConfig(max_staleness="auto", staleness_min=2, staleness_max=7, staleness_target_ess=0.8,
                       staleness_window=4, staleness_min_wait=0.03)
    assert StalenessRule.of(cfg) == StalenessRule(2, 7, 0.8, 4, 0.03)
    assert StalenessController(StalenessRule.of(cfg)).eta == 2  # -1, the default: the minimum


def test_a_window_exactly_at_each_threshold_grows_the_bound_and_one_short_does_not():
    # The mean ESS exactly the target, the data exactly as stale as eta, the wait exactly its minimum.
    c = StalenessController(rule(), eta=3, slow_start=False)
    assert window(c, step(0.9, 3, 0.1), step(0.9, 3, 0.1)).eta == 4
    below_target = StalenessController(rule(), eta=3, slow_start=False)
    assert window(below_target, step(0.9, 3), step(0.8999, 3)).eta == 1
    one_short = StalenessController(rule(), eta=3, slow_start=False)
    assert window(one_short, step(0.95, 2), step(0.95, 2)).change == 0
    short_wait = StalenessController(rule(), eta=3, slow_start=False)
    assert window(short_wait, step(0.95, 3, 0.1), step(0.95, 3, 0.0999)).change == 0


@pytest.mark.parametrize(("first", "last", "eta"), [(0.84, 0.97, 5), (0.97, 0.82, 2)])
def test_the_windows_mean_ess_decides_not_its_first_or_last_step(first, last, eta):
    c = StalenessController(rule(), eta=4, slow_start=False)
    d = window(c, step(first, 4), step(last, 4))
    assert (d.eta, d.signal) == (eta, pytest.approx((first + last) / 2))


def test_the_windows_mean_wait_and_largest_staleness_decide():
    # Waits 0.15 and 0.06: the mean 0.105 reaches 0.1 though the last step's does not.
    c = StalenessController(rule(), eta=4, slow_start=False)
    d = window(c, step(0.95, 4, 0.15), step(0.95, 2, 0.06))  # reached 4 on the first step only
    assert (d.eta, d.change, d.wait) == (5, 1, pytest.approx(0.105))
    # Waits 0.04 and 0.15: the mean 0.095 falls short though the last step's reaches it.
    c = StalenessController(rule(), eta=4, slow_start=False)
    assert window(c, step(0.95, 4, 0.04), step(0.95, 4, 0.15)).change == 0
    # Three steps: the mean over all of them (the sums divided by the window, not by two).
    c = StalenessController(rule(window=3), eta=4, slow_start=False)
    d = window(c, step(0.6, 4, 0.3), step(1.0, 4, 0.0), step(1.0, 4, 0.0))
    assert d.signal == pytest.approx(0.8666666) and d.wait == pytest.approx(0.1) and d.eta == 2


def test_growth_from_a_bound_of_zero_and_the_limits():
    c = StalenessController(rule(minimum=0, maximum=3), eta=0)
    assert [window(c, step(1.0, c.eta), step(1.0, c.eta)).eta for _ in range(3)] == [1, 2, 3]  # 0 -> 1, doubled
    c = StalenessController(rule(minimum=0), eta=0, slow_start=False)
    assert window(c, step(1.0, 0), step(1.0, 0)).eta == 1
    # Halving rounds down and stops at the minimum; each fall holds for the old bound's steps.
    c = StalenessController(rule(minimum=2), eta=5, slow_start=True)
    d = window(c, step(0.5, 5), step(0.5, 5))
    assert (d.eta, d.change, c.hold, c.slow_start) == (2, -3, 5, False)


def test_a_fall_holds_exactly_the_old_bound_in_steps_then_judges_a_fresh_window():
    c = StalenessController(rule(), eta=6, slow_start=False)
    window(c, step(0.5, 6), step(0.5, 6))
    assert (c.eta, c.hold) == (3, 6)
    held = [c.observe(step(0.1, 6)) for _ in range(6)]
    assert all(d.signal is None and d.eta == 3 for d in held) and c.window == [] and c.hold == 0
    assert c.observe(step(0.95, 3)).signal is None  # the first step of the next window
    assert c.observe(step(0.95, 3)).eta == 4


def test_a_decisions_metrics_name_what_was_decided():
    assert Decision(3).metrics() == {"staleness/eta": 3.0}
    assert Decision(4, 0.95, 1, 0.2).metrics() == {"staleness/eta": 4.0, "staleness/signal": 0.95,
                                                   "staleness/change": 1.0, "staleness/wait": 0.2}
    c = StalenessController(rule(), eta=2)
    assert c.observe(step(0.99, 2)) == Decision(2)
    assert c.observe(step(0.99, 2, 0.3)) == Decision(4, pytest.approx(0.99), 2, pytest.approx(0.4))


def test_a_step_without_a_staleness_figure_reached_nothing():
    c = StalenessController(rule(minimum=0), eta=0, slow_start=False)
    d = window(c, {"policy/ess": 1.0, "time/data_wait": 0.5}, {"policy/ess": 1.0, "time/data_wait": 0.5})
    assert d.eta == 1  # reached 0 = eta: grows
    c = StalenessController(rule(), eta=1, slow_start=False)
    assert window(c, {"policy/ess": 1.0, "time/data_wait": 0.5}, {"policy/ess": 1.0, "time/data_wait": 0.5}).change == 0
    # No data wait reported: the step did not wait.
    c = StalenessController(rule(min_wait=0.0), eta=1, slow_start=False)
    assert window(c, {"policy/ess": 1.0, "staleness/max": 1.0}, {"policy/ess": 1.0, "staleness/max": 1.0}).wait == 0.0
    c = StalenessController(rule(min_wait=0.001), eta=1, slow_start=False)
    assert window(c, {"policy/ess": 1.0, "staleness/max": 1.0}, {"policy/ess": 1.0, "staleness/max": 1.0}).change == 0


def test_a_restored_state_is_clamped_to_the_limits_and_old_checkpoints_get_defaults():
    state = {"eta": 0, "window": [0.5], "reached": 3, "slow_start": True, "hold": 2, "waits": [0.25]}
    low = StalenessController.from_state(rule(minimum=2), state)
    assert (low.eta, low.window, low.reached, low.slow_start, low.hold, low.waits) == (2, [0.5], 3, True, 2, [0.25])
    assert StalenessController.from_state(rule(maximum=4), state | {"eta": 9}).eta == 4
    old = StalenessController.from_state(rule(), {"eta": 3, "window": [0.5, 0.7], "reached": 1})
    assert (old.eta, old.slow_start, old.hold, old.waits) == (3, False, 0, [0.0, 0.0])


steps = st.lists(st.one_of(
    st.builds(step, st.floats(0.0, 1.0), st.integers(0, 20), st.floats(0.0, 1.0)),
    st.just({"staleness/max": 3.0}),  # a step without fresh tokens
), max_size=60)


@settings(max_examples=60, deadline=None)
@given(steps, st.integers(0, 4), st.integers(0, 12), st.integers(1, 4), st.data())
def test_any_sequence_keeps_eta_in_its_limits_decides_once_per_window_and_resumes_from_its_state(
        seq, minimum, span, size, data):
    r = rule(minimum=minimum, maximum=minimum + span, window=size)
    c = StalenessController(r)
    cut = data.draw(st.integers(0, len(seq)))
    for s in seq[:cut]:
        c.observe(s)
    restored = StalenessController.from_state(r, json.loads(json.dumps(c.state())))
    for s in seq[cut:]:
        held, counted = c.hold > 0, "policy/ess" in s and c.hold == 0
        before = len(c.window)
        d, again = c.observe(s), restored.observe(s)
        assert d == again and r.minimum <= d.eta <= r.maximum
        # A decision exactly when a counted step fills the window; nothing else moves the bound.
        assert (d.signal is not None) == (counted and before + 1 == size)
        assert d.signal is not None or (d.change == 0 and d.eta == again.eta)
        assert not held or c.window == []
    assert c.state() == restored.state()


def test_each_window_judges_its_own_data_the_last_windows_staleness_forgotten():
    c = StalenessController(rule(), eta=2, slow_start=False)
    window(c, step(0.5, 2), step(0.5, 2))  # halved to 1, held for 2 steps
    for _ in range(2):
        c.observe(step(0.5, 2))
    # Data fresher than the bound of 1: the earlier windows' staleness of 2 does not count.
    assert window(c, step(1.0, 0), step(1.0, 0)).change == 0 and c.eta == 1
