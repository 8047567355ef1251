"""The learner's loop: batch from the replay, one optimizer step, publish weights, log, checkpoint.

    version v = optimizer steps applied. Each step asks the replay for `groups_per_step` groups fresh
    enough for v (topping up until the batch is full), trains, and publishes every `sync_every` steps.
    A checkpoint holds the DeepSpeed state (model, optimizer), the version, and a replay snapshot
    (buffered groups and every actor's accepted positions): a resumed run continues as if never stopped.
Each batch is recorded before it trains (learner/recording.py), so that `dph-async rerun` can train
on it again; with replay.max_staleness=auto the loop steers the replay's bound
(learner/staleness_control.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dph_async.config import RunConfig
from dph_async.learner import retention
from dph_async.learner.guard import check_finite
from dph_async.learner.publish import WeightServer
from dph_async.learner.recording import RECORDING, BatchRecorder
from dph_async.learner.staleness_control import Decision, StalenessController, StalenessRule
from dph_async.learner.trainer import Trainer
from dph_async.paths import checkpoint_dir
from dph_async.protocol import Batch, ReferenceSample, RolloutGroup
from dph_async.replay_client import ReplayClient
from dph_async.run_stats import LearnerStats
from dph_async.spans import add_span

log = logging.getLogger(__name__)


def finish_metrics(m: dict[str, float], batch: Batch, staleness: StalenessController | None) -> Decision | None:
    """A step's metrics past the trainer's own: the replay's drops and the learner's wait for data as
    the batch reported them and, with replay.max_staleness=auto, the controller's decision. The loop
    and a rerun log the same."""
    m.update({f"drops/{k}": float(v) for k, v in batch.drops.items()})
    # A clock's figure (time/: a resumed run's differs), but the batch's own: a rerun logs the run's.
    m["time/data_wait"] = batch.data_wait
    if staleness is None:
        return None
    decision = staleness.observe(m)
    m.update(decision.metrics())
    return decision


class LearnerLoop:
    def __init__(self, cfg: RunConfig, trainer: Trainer, replay: ReplayClient, server: WeightServer,
                 run_dir: Path) -> None:
        self.cfg, self.trainer, self.replay, self.server = cfg, trainer, replay, server
        self.checkpoint_dir = checkpoint_dir(run_dir)
        self.metrics_path = run_dir / "metrics.jsonl"
        # What each step trained on: (actor, seq, oldest, newest token version) per group. An audit
        # trail for staleness, and how resume is checked against an uninterrupted run.
        self.consumed_path = run_dir / "consumed.jsonl"
        self.recording_path = run_dir / RECORDING
        self.recorder: BatchRecorder | None = None  # opened by run(), after any resume
        self.staleness = StalenessController(StalenessRule.of(cfg.replay)) if cfg.replay.auto_staleness else None
        self.stats = LearnerStats()
        # Steps in metrics.jsonl; of those, the ones from `_unread_from` on that the driver has not
        # read yet (a long-running learner keeps no per-step history in memory: the file has it).
        self.logged = 0
        self._unread: list[dict[str, float]] = []
        self._unread_from = 0
        # Called with each step's metrics as it is logged (the process's Prometheus collector).
        self.listeners: list[Callable[[dict[str, float]], None]] = []
        self._lock = threading.Lock()

    def _span(self, start: float, what: str) -> float:
        end = time.time()
        add_span(self.stats.timeline, start, end, what)
        return end - start

    def publish(self) -> None:
        start = time.time()
        state = self.trainer.whole_state()
        check_finite(state, self.trainer.version)
        info = self.server.publish(state, self.trainer.version)
        self.stats.publish_seconds += self._span(start, "publish")
        self.stats.publish_bytes += info.nbytes

    def _collect(self, stop: threading.Event) -> Batch | None:
        """Top up a batch of groups_per_step groups at the current version (None if stopped first)."""
        want = self.cfg.learner.groups_per_step
        groups: list[RolloutGroup] = []
        reference: list[ReferenceSample] = []
        waited_s = cycle_s = 0.0
        start = time.time()
        while len(groups) < want and not stop.is_set():
            got = self.replay.get_batch(self.trainer.version, want - len(groups), wait_s=1.0)
            groups += got.groups
            reference += got.reference
            waited_s += got.waited_s
            cycle_s += got.cycle_s
            for reason, n in got.drops.items():
                self.stats.drops[reason] = self.stats.drops.get(reason, 0) + n
        self.stats.wait_seconds += self._span(start, "wait")
        if len(groups) < want:
            return None
        drops = dict(self.stats.drops)
        return Batch(self.trainer.version, groups, reference, drops, waited_s=waited_s, cycle_s=cycle_s)

    def checkpoint(self) -> Path:
        """Write model + optimizer + version, and the replay's snapshot, under checkpoint_dir/v{version}."""
        start = time.time()
        tag = f"v{self.trainer.version}"
        self.replay.snapshot(str(self._replay_snapshot(tag)), self.trainer.version)
        extra = {} if self.staleness is None else {"staleness": self.staleness.state()}
        self.trainer.save(self.checkpoint_dir, {"metrics": self.logged, **extra})
        retention.prune(self.checkpoint_dir, self.cfg.learner.keep_checkpoints, self.cfg.learner.keep_versions)
        self.stats.checkpoint_seconds += self._span(start, "checkpoint")
        return self.checkpoint_dir / tag

    def _replay_snapshot(self, tag: str) -> Path:
        """Where checkpoint `tag` keeps the replay's state: found from the tag, never from a path stored
        in a file (a copied run directory would point elsewhere, a planted one anywhere)."""
        return (self.checkpoint_dir / tag / "replay").resolve()

    def resume(self, tag: str) -> None:
        """Return to checkpoint `tag`: learner state, then the replay's state at that moment."""
        state = self.trainer.load(self.checkpoint_dir, tag)
        self.replay.restore(str(self._replay_snapshot(tag)))
        if self.staleness is not None and "staleness" in state:
            self.staleness = StalenessController.from_state(self.staleness.rule, state["staleness"])
        if self.staleness is not None:
            self.replay.set_staleness(self.staleness.eta)
        # Steps logged after the checkpoint are redone: forget them.
        for path in (self.metrics_path, self.consumed_path):
            lines = path.read_text().splitlines()[: int(state["metrics"])] if path.exists() else []
            path.write_text("".join(x + "\n" for x in lines))
        with self._lock:  # the driver of this process has read none of them
            self._unread = [json.loads(x) for x in self.metrics_path.read_text().splitlines()]
            self._unread_from, self.logged = 0, len(self._unread)

    def log_step(self, m: dict[str, float], batch: Batch) -> None:
        """Log a step: its metrics (metrics.jsonl, the driver, the listeners) and what it consumed."""
        with self.metrics_path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        with self.consumed_path.open("a") as f:
            groups = [[g.actor_id, g.seq, g.min_version, g.max_version] for g in batch.groups]
            f.write(json.dumps({"version": batch.version, "groups": groups}) + "\n")
        with self._lock:
            self._unread.append(m)
            self.logged += 1
        for listener in list(self.listeners):
            try:
                listener(m)
            except Exception:  # a broken observer must not stop training
                log.exception("a metrics listener failed on step %d", self.logged)

    def metrics_since(self, index: int) -> list[dict[str, float]]:
        """The metrics of steps `index`, `index + 1`, ... logged so far (0: the run's first step).
        One reader: asking from `index` says it holds every step before it, which are forgotten."""
        with self._lock:
            if not self._unread_from <= index <= self.logged:
                raise ValueError(f"metrics from step {index} asked; held: steps {self._unread_from} to "
                                 f"{self.logged} (earlier ones were read; {self.metrics_path} has them all)")
            del self._unread[: index - self._unread_from]
            self._unread_from = index
            return list(self._unread)

    def _steer(self, decision: Decision | None) -> None:
        """At the end of each window, tell the replay the bound (again: a replay that restarted on its
        own has forgotten it); a change is also kept for the timeline."""
        if decision is None or decision.signal is None:
            return
        self.replay.set_staleness(decision.eta)
        if decision.change:
            self.stats.staleness.append((time.time(), decision.eta, decision.signal, decision.wait or 0.0))
            log.info("staleness bound %d -> %d (mean ESS %.4f, data wait %.3f)", decision.eta - decision.change,
                     decision.eta, decision.signal, decision.wait or 0.0)

    def _record(self, batch: Batch) -> float:
        """Append the batch to the recording; the seconds it took (0 with recording off)."""
        if not self.cfg.learner.record_batches:
            return 0.0
        start = time.perf_counter()
        if self.recorder is None:  # after any resume: the steps before its checkpoint stay on record
            self.recorder = BatchRecorder(self.recording_path, keep=self.logged)
        self.recorder.append(batch)
        return time.perf_counter() - start

    def _pad(self, seconds: float, stop: threading.Event) -> float:
        """Idle `seconds` (learner.min_step_seconds' remainder) unless stopped; the seconds idled."""
        if seconds <= 0:
            return 0.0
        start = time.time()
        stop.wait(seconds)
        return self._span(start, "padding")

    def run(self, stop: threading.Event) -> LearnerStats:
        lc = self.cfg.learner
        if self.server.latest != self.trainer.version:  # the launcher publishes before actors start
            self.publish()
        try:
            while self.trainer.version < lc.steps and not stop.is_set():
                batch = self._collect(stop)
                if batch is None:
                    break
                record_s = self._record(batch)
                start = time.time()
                m = self.trainer.train_step(batch)
                train_s = self._span(start, "train")
                self.stats.train_seconds += train_s
                self.stats.steps += 1
                m["time/padding"] = self._pad(lc.min_step_seconds - train_s, stop)
                if self.trainer.version % lc.sync_every == 0 or self.trainer.version == lc.steps:
                    self.publish()
                m["time/wall"] = time.time()
                m["time/record"] = record_s
                self._steer(finish_metrics(m, batch, self.staleness))
                self.log_step(m, batch)
                if lc.checkpoint_every and self.trainer.version % lc.checkpoint_every == 0:
                    self.checkpoint()
        finally:
            if self.recorder is not None:
                self.recorder.close()
                self.recorder = None
        return self.stats
