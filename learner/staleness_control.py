"""`replay.max_staleness=auto`: the staleness bound eta steered by what it buys and what it costs.

Staleness buys throughput only while the learner waits for data: the actors may run at most eta
versions ahead, and a bound that binds makes the learner wait for groups the actors were not yet
allowed to start. Once the learner no longer waits, a higher bound buys nothing and costs freshness
(the learner's off-policy estimate degrades, and with it the held-out reward: docs/ablations.md).
So the bound grows only while the learner waits, and falls when the data grows unhealthy.

What it buys: the fraction of the learner's time spent waiting for its batch (`time/data_wait`,
timed by the replay and carried in the batch, so a rerun sees the run's figures). What it costs:
the normalised effective sample size of the importance weights w = pi_prox / pi_mu over a batch's
fresh tokens, (sum w)^2 / (n sum w^2) (`policy/ess`, learner/diagnostics.py): 1 when the data is
on-policy, falling as the behaviour policies fall behind. It measures the data, not the
correction (it is the same for every correction mode and is not truncated), it is scale-free, so
one target serves every task, and it reacts at once, where the clipped fraction stays 0 with one
update per batch (the decoupled clip is inert then) and the mismatch KL has no natural scale.

The rule, TCP's congestion control (slow start, then additive increase and multiplicative
decrease), once every `window` steps:

    s = mean ESS over the window's steps, w = mean data wait
    s <  target                                    eta <- max(eta_min, eta // 2); slow start ends
    s >= target, w >= min_wait, the window         eta <- min(eta_max, 2 eta)     during slow start
                 reached eta                       eta <- min(eta_max, eta + 1)   after it
    otherwise                                      eta unchanged

"Reached" means some group of the window was consumed at staleness eta: the bound is what limits
the actors (when they cannot keep up, data stays fresher than any bound and a higher one changes
nothing), and the window says how data as stale as the bound behaves. eta starts at eta_min;
doubling reaches the working bound in a few windows instead of one window per step of eta (every
step spent below it is throughput lost); once a window has been unhealthy, creeping up by one
finds the largest healthy bound and halving backs off at once. The result is the smallest bound at
which the learner stops waiting, unless a healthy estimate needs a smaller one.

A decrease takes effect at once for what the actors may start (admission), but the groups already
admitted keep the old bound until they are consumed (the replay's grace, replay/core.py): dropping
them would throw away work the actors did under the rules of the time. So for eta_old steps after a
decrease from eta_old the data still reflects the old bound, and the controller waits that long
before its next window starts: it judges the new bound on data made under it.

The controller is a pure function of the step metrics, so a rerun of the same steps reproduces its
decisions; its state goes into every checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dph_async.config.replay import ReplayConfig

SIGNAL = "policy/ess"
WAIT = "time/data_wait"


@dataclass(frozen=True)
class StalenessRule:
    minimum: int
    maximum: int
    target: float  # the ESS a window's mean must reach for the bound to grow
    window: int  # steps per decision
    min_wait: float = 0.0  # the data wait a window's mean must reach for the bound to grow

    @classmethod
    def of(cls, cfg: ReplayConfig) -> StalenessRule:
        return cls(cfg.staleness_min, cfg.staleness_max, cfg.staleness_target_ess, cfg.staleness_window,
                   cfg.staleness_min_wait)


@dataclass
class Decision:
    """What one step tells the controller, and what it decided (`changed`: the bound moved)."""

    eta: int  # the bound from the next batch on
    signal: float | None = None  # the window's mean ESS, on the steps that end a window
    change: int = 0
    wait: float | None = None  # the window's mean data wait, on the steps that end a window

    def metrics(self) -> dict[str, float]:
        out = {"staleness/eta": float(self.eta)}
        if self.signal is not None:
            out["staleness/signal"] = self.signal
            out["staleness/change"] = float(self.change)
        if self.wait is not None:
            out["staleness/wait"] = self.wait
        return out


@dataclass
class StalenessController:
    rule: StalenessRule
    eta: int = -1  # -1: the rule's minimum
    # The current window: ESS of each step that had fresh tokens, and the largest staleness seen.
    window: list[float] = field(default_factory=list)
    reached: int = 0
    waits: list[float] = field(default_factory=list)  # the data wait of the window's steps
    slow_start: bool = True  # until the first unhealthy window
    hold: int = 0  # steps still to pass after a decrease before the next window starts

    def __post_init__(self) -> None:
        if self.eta < 0:
            self.eta = self.rule.minimum

    def observe(self, metrics: dict[str, float]) -> Decision:
        """Take one step's metrics; at the end of a window, decide."""
        if self.hold > 0:
            self.hold -= 1
            return Decision(self.eta)
        if SIGNAL in metrics:
            self.window.append(metrics[SIGNAL])
            self.reached = max(self.reached, int(metrics.get("staleness/max", 0)))
            self.waits.append(metrics.get(WAIT, 0.0))
        if len(self.window) < self.rule.window:
            return Decision(self.eta)
        signal = sum(self.window) / len(self.window)
        wait = sum(self.waits) / len(self.waits)
        before = self.eta
        if signal < self.rule.target:
            self.eta = max(self.rule.minimum, self.eta // 2)
            self.slow_start = False
            if self.eta < before:
                self.hold = before  # the groups admitted under `before` are consumed under it
        elif self.reached >= self.eta and wait >= self.rule.min_wait:
            grown = max(2 * self.eta, self.eta + 1) if self.slow_start else self.eta + 1
            self.eta = min(self.rule.maximum, grown)
        self.window, self.reached, self.waits = [], 0, []
        return Decision(self.eta, signal, self.eta - before, wait)

    def state(self) -> dict:
        """What a checkpoint keeps (plain values)."""
        return {"eta": self.eta, "window": list(self.window), "reached": self.reached,
                "slow_start": self.slow_start, "hold": self.hold, "waits": list(self.waits)}

    @classmethod
    def from_state(cls, rule: StalenessRule, state: dict) -> StalenessController:
        eta = min(max(int(state["eta"]), rule.minimum), rule.maximum)  # the limits may have been changed
        # slow_start, hold and waits: absent from checkpoints written before they existed (an old
        # window's steps count as not waiting).
        window = [float(x) for x in state["window"]]
        waits = [float(x) for x in state.get("waits", [0.0] * len(window))]
        return cls(rule, eta, window, int(state["reached"]), waits,
                   bool(state.get("slow_start", False)), int(state.get("hold", 0)))
