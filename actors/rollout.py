"""The actor's rollout loop: tickets in, prompts through the engine, scored groups out.

Each pass: load newer weights if the learner published some (in flight: running requests go on
with the new weights), take admission tickets for free slots, start one prompt per ticket (n
completions each), step the engine, and score and send every group whose n completions finished.

An actor's prompts are a resumable stream: position `seq` of actor `a` is a fixed prompt of its
shard (a fresh shuffle each epoch, from the seed), and `seq` is the group's id. A restarted actor
asks the replay which positions it already accepted and skips them, so nothing is lost or doubled.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from dataclasses import replace

import numpy as np

from dph_async.actors.faults import Faults
from dph_async.actors.sampling import Engine, Sample, SamplingSpec
from dph_async.actors.weight_client import WeightClient, WeightFetchError
from dph_async.config import RunConfig
from dph_async.protocol import Completion, RolloutGroup, SamplingInfo
from dph_async.replay_client import RolloutSender
from dph_async.rewards.scorer import Scorer
from dph_async.run_stats import ActorStats
from dph_async.spans import add_span
from dph_async.tasks.dataset import PromptRecord

log = logging.getLogger(__name__)

class PromptCursor:
    """Position `seq` of an actor's stream -> a prompt of its shard; deterministic from the seed."""

    def __init__(self, prompts: list[PromptRecord], actor_id: int, num_actors: int, seed: int) -> None:
        self.shard = prompts[actor_id::num_actors] or prompts
        self.actor_id, self.seed = actor_id, seed
        self._orders: dict[int, list[int]] = {}

    def __getitem__(self, seq: int) -> PromptRecord:
        epoch, i = divmod(seq, len(self.shard))
        if epoch not in self._orders:
            order = list(range(len(self.shard)))
            random.Random(f"{self.seed}/{self.actor_id}/{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return self.shard[self._orders[epoch][i]]


def sample_seed(seed: int, actor_id: int, seq: int) -> int:
    """The sampling seed of the group at position seq of an actor's stream (vLLM gives its n
    completions seed + j).

    A group is then a function of its position and the weights alone, not of what the engine sampled
    before: an actor restarted (or a run resumed) regenerates a position exactly as the uninterrupted
    run would have with the same weights.
    """
    return random.Random(f"{seed}/{actor_id}/{seq}").getrandbits(62)


CPU_MARK_S = 0.25  # how often the rollout thread marks its CPU-seconds (as bench's /proc sampler samples)


class RolloutWorker:
    def __init__(self, actor_id: int, cfg: RunConfig, engine: Engine, prompts: list[PromptRecord],
                 sender: RolloutSender, weights: WeightClient, scorer: Scorer) -> None:
        self.actor_id, self.cfg, self.engine = actor_id, cfg, engine
        self.cursor = PromptCursor(prompts, actor_id, cfg.actors.num_actors, cfg.seed)
        self.sender, self.weights, self.scorer = sender, weights, scorer
        s = cfg.sampling
        self.spec = SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens)
        self.info = SamplingInfo(s.temperature, s.top_p, s.top_k, s.max_tokens)
        self.stats = ActorStats(actor_id)
        self._inflight: dict[int, list[Sample]] = {}
        self._started: dict[int, float] = {}
        self._t0 = time.time()
        self.faults = Faults.from_env(actor_id)  # None outside the chaos test

    def _mark(self, start: float, what: str) -> None:
        """Add the span from `start` to now to the busy/wait timeline."""
        add_span(self.stats.timeline, start, time.time(), what)

    def _mark_cpu(self, thread0: float) -> None:
        """Mark the thread's CPU-seconds since `thread0` (its start of the run) and those of its engine steps."""
        st = self.stats
        st.thread_cpu_seconds = time.thread_time() - thread0
        st.cpu_marks.append((time.time(), st.thread_cpu_seconds, st.generate_cpu_seconds, st.forward_cpu_seconds))

    def update_weights(self) -> None:
        """Load the newest published weights if they are newer than the engine's."""
        start = time.time()
        try:
            ready = self.weights.newest(self.engine.version)
            self._mark(start, "query")
            if ready is None:
                return
            start = time.time()
            with self.weights.tensors(ready, lease=self.engine.shares_weights) as tensors:
                fetched = time.time()
                viewing = self.engine.load_weights(tensors, ready.version, keep=self.weights.leased)
        except WeightFetchError as e:
            # Nothing of that version reached the engine (it was refused, or the server fell silent,
            # before the load began); generation goes on with the weights it has, and the next pass
            # asks again (for the newest version, which may be another one).
            n = self.stats.weight_fetch_failures = self.stats.weight_fetch_failures + 1
            if n & (n - 1) == 0:  # the 1st, 2nd, 4th, ... failure: a persistent fault does not flood the log
                log.warning("actor %d: weights not loaded, keeping version %d (%d failed so far): %s",
                            self.actor_id, self.engine.version, n, e)
            return
        if not viewing:  # the engine holds its own copies (or fell back to vLLM's reload): the slot is free
            self.weights.release()
        self.stats.weight_loads += 1
        self.stats.weight_leased_loads += viewing
        self.stats.weight_shm_loads = self.weights.loads["shm"]
        self.stats.weight_shm_fallbacks = self.weights.shm_fallbacks
        self.stats.weight_bytes += sum(b.nbytes for b in ready.buckets)
        self.stats.weight_fetch_seconds += fetched - start
        self.stats.weight_load_seconds += time.time() - start
        self.stats.version = ready.version
        self._mark(start, "weights")

    def _start(self, seq: int) -> None:
        record = self.cursor[seq]
        self._inflight[seq] = []
        start = self._started[seq] = time.time()
        spec = replace(self.spec, seed=sample_seed(self.cfg.seed, self.actor_id, seq))
        self.engine.add(str(seq), record.prompt_ids, spec, n=self.cfg.sampling.n)
        self._mark(start, "submit")

    def _finish(self, seq: int) -> None:
        record = self.cursor[seq]
        samples = sorted(self._inflight.pop(seq), key=lambda s: int(s.key.split("/")[1]))
        start = time.time()
        results = self.scorer.score_many([record.score_request(s.text) for s in samples])
        self.stats.score_seconds += time.time() - start
        self._mark(start, "score")
        completions = [
            Completion(np.asarray(s.token_ids, np.int32), np.asarray(s.logprobs, np.float32),
                       np.asarray(s.versions, np.int32), r, s.finish_reason, s.policy_weight)
            for s, r in zip(samples, results, strict=True)
        ]
        group = RolloutGroup(self.actor_id, seq, record.prompt_id, record.data_source,
                             np.asarray(record.prompt_ids, np.int32), completions, self.info,
                             self._started.pop(seq), time.time())
        start = time.time()
        self.sender.send(group)
        for poisoned in self.faults.copies(group) if self.faults else ():
            self.sender.send(poisoned)
        self.stats.send_seconds += time.time() - start
        self._mark(start, "send")
        self.stats.groups_sent += 1
        self.stats.tokens_generated += sum(len(s.token_ids) for s in samples)

    def run(self, stop: threading.Event, max_groups: int | None = None) -> ActorStats:
        """Generate until `stop` is set (or `max_groups` groups were sent); flush; return the stats."""
        resume = self.sender.resume()
        accepted = set(resume.accepted_above)
        next_seq = self.stats.resumed_at = resume.watermark
        forward0 = self.engine.forward_seconds  # a kept engine's clock runs on from its earlier runs
        thread0 = time.thread_time()
        self._mark_cpu(thread0)
        self.update_weights()
        slots = self.cfg.actors.max_inflight_prompts
        while not stop.is_set() and (max_groups is None or self.stats.groups_sent < max_groups):
            if time.time() - self.stats.cpu_marks[-1][0] >= CPU_MARK_S:
                self._mark_cpu(thread0)
            self.update_weights()
            free = slots - len(self._inflight)
            if max_groups is not None:
                free = min(free, max_groups - self.stats.groups_sent - len(self._inflight))
            start = time.time()
            if free > 0:
                # An idle engine waits (briefly) at the replay for capacity instead of spinning; a busy
                # one leaves a request parked there and picks up the grant on a later pass.
                busy = bool(self._inflight)
                granted = self.sender.tickets(free, wait_s=1.0 if busy else 0.2, weights_version=self.engine.version,
                                              block=not busy)
                if busy:
                    self.stats.ticket_seconds += time.time() - start
                    self._mark(start, "tickets")
                    start = time.time()
                for _ in range(granted):
                    while next_seq in accepted:
                        accepted.discard(next_seq)
                        self.stats.skipped_accepted += 1
                        next_seq += 1
                    self._start(next_seq)
                    next_seq += 1
            if not self.engine.has_unfinished():
                self.sender.poll(0.0)
                self.stats.wait_seconds += time.time() - start
                self._mark(start, "wait")
                continue
            start, cpu = time.time(), time.thread_time()
            done = self.engine.step()
            self.stats.generate_cpu_seconds += time.thread_time() - cpu
            self.stats.generate_seconds += time.time() - start
            self.stats.forward_cpu_seconds = self.engine.forward_seconds - forward0
            self._mark(start, "generate")
            for sample in done:
                seq = int(sample.key.split("/")[0])
                self._inflight[seq].append(sample)
                if len(self._inflight[seq]) == self.cfg.sampling.n:
                    self._finish(seq)
        if self._inflight:
            self.engine.abort([str(seq) for seq in self._inflight])
            self._inflight.clear()
        self.sender.flush(timeout_s=30.0)
        self._mark_cpu(thread0)
        self.stats.wall_seconds = time.time() - self._t0
        if hasattr(os, "sched_getaffinity"):
            self.stats.cores = sorted(os.sched_getaffinity(0))
        return self.stats
