"""`replay.max_staleness=auto`: the staleness bound eta steered by the learner's effective sample size.

The signal is the normalised effective sample size of the importance weights w = pi_prox / pi_mu
over a batch's fresh tokens, (sum w)^2 / (n sum w^2) (`policy/ess`, learner/diagnostics.py): 1 when
the data is on-policy, falling as the behaviour policies fall behind. It measures the data, not the
correction (it is the same for every correction mode and is not truncated), it is scale-free, so
one target serves every task, and it reacts at once, where the clipped fraction stays 0 with one
update per batch (the decoupled clip is inert then) and the mismatch KL has no natural scale.

The rule, TCP's congestion control (slow start, then additive increase and multiplicative
decrease), once every `window` steps:

    s = mean ESS over the window's steps
    s <  target                               eta <- max(eta_min, eta // 2); slow start ends
    s >= target and the window reached eta    eta <- min(eta_max, 2 eta)     during slow start
                                              eta <- min(eta_max, eta + 1)   after it
    otherwise                                 eta unchanged

"Reached" means some group of the window was consumed at staleness eta: only then does the window
say how data as stale as the bound behaves. (When actors keep up, data stays fresher than any bound
and eta would otherwise climb to eta_max untested.) eta starts at eta_min; doubling reaches the
working bound in a few windows instead of one window per step of eta (every step spent below it
is throughput lost); once a window has been unhealthy, creeping up by one finds the largest bound
that keeps the estimate healthy and halving backs off at once.

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


@dataclass(frozen=True)
class StalenessRule:
    minimum: int
    maximum: int
    target: float  # the ESS a window's mean must reach for the bound to grow
    window: int  # steps per decision

    @classmethod
    def of(cls, cfg: ReplayConfig) -> StalenessRule:
        return cls(cfg.staleness_min, cfg.staleness_max, cfg.staleness_target_ess, cfg.staleness_window)


@dataclass
class Decision:
    """What one step tells the controller, and what it decided (`changed`: the bound moved)."""

    eta: int  # the bound from the next batch on
    signal: float | None = None  # the window's mean ESS, on the steps that end a window
    change: int = 0

    def metrics(self) -> dict[str, float]:
        out = {"staleness/eta": float(self.eta)}
        if self.signal is not None:
            out["staleness/signal"] = self.signal
            out["staleness/change"] = float(self.change)
        return out


@dataclass
class StalenessController:
    rule: StalenessRule
    eta: int = -1  # -1: the rule's minimum
    # The current window: ESS of each step that had fresh tokens, and the largest staleness seen.
    window: list[float] = field(default_factory=list)
    reached: int = 0
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
        if len(self.window) < self.rule.window:
            return Decision(self.eta)
        signal = sum(self.window) / len(self.window)
        before = self.eta
        if signal < self.rule.target:
            self.eta = max(self.rule.minimum, self.eta // 2)
            self.slow_start = False
            if self.eta < before:
                self.hold = before  # the groups admitted under `before` are consumed under it
        elif self.reached >= self.eta:
            grown = max(2 * self.eta, self.eta + 1) if self.slow_start else self.eta + 1
            self.eta = min(self.rule.maximum, grown)
        self.window, self.reached = [], 0
        return Decision(self.eta, signal, self.eta - before)

    def state(self) -> dict:
        """What a checkpoint keeps (plain values)."""
        return {"eta": self.eta, "window": list(self.window), "reached": self.reached,
                "slow_start": self.slow_start, "hold": self.hold}

    @classmethod
    def from_state(cls, rule: StalenessRule, state: dict) -> StalenessController:
        eta = min(max(int(state["eta"]), rule.minimum), rule.maximum)  # the limits may have been changed
        # slow_start and hold: absent from checkpoints written before they existed.
        return cls(rule, eta, [float(x) for x in state["window"]], int(state["reached"]),
                   bool(state.get("slow_start", False)), int(state.get("hold", 0)))
