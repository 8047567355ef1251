"""The replay's logic and state, without sockets: ingest, admission, batches, snapshots, recovery.

One thread drives a ReplayCore (replay/service.py, or a benchmark in-process). Every change that
someone is told about is in the write-ahead log first: a group before its ack, a batch before it is
sent. A batch stays "pending" until the learner asks for the next one, so a lost reply is retried
by request id and neither lost nor repeated: each accepted group reaches the learner exactly once
(max_reuse times with reuse), or is dropped and counted.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import (
    AckStatus,
    Batch,
    BatchRequest,
    ResumeInfo,
    RolloutGroup,
    TicketGrant,
    TicketRequest,
)
from dph_async.replay.dedup import AcceptedSeqs
from dph_async.replay.metrics import ReplayMetrics
from dph_async.replay.records import unstorable
from dph_async.replay.reference_pool import ReferencePool
from dph_async.replay.staleness import Admission, staleness
from dph_async.replay.state import PendingBatch, ReplayState, read_state, write_state
from dph_async.replay.store import Entry, FreshStore, GroupId, resident_cost
from dph_async.replay.validation import problem
from dph_async.replay.wal import IngestRecord, Record, ServeRecord, WriteAheadLog
from dph_async.replay_stats import Mix, Occupancy, Refusals, ReplayStats, Served, Tickets, WalStats

log = logging.getLogger(__name__)
MiB = 1 << 20


@dataclass
class _Room:
    """What one ingest call may still add: store bytes; ticketless groups and their bytes."""

    bytes: float
    ticketless: int
    ticketless_bytes: float

    def take(self, nbytes: int, ticketless: bool) -> str | None:
        """Make room for a group, or say which budget is full ("store_full", "no_ticket")."""
        if nbytes > self.bytes:
            return "store_full"
        if ticketless and (self.ticketless <= 0 or nbytes > self.ticketless_bytes):
            return "no_ticket"
        self.bytes -= nbytes
        if ticketless:
            self.ticketless -= 1
            self.ticketless_bytes -= nbytes
        return None


@dataclass
class Verdict:
    """What happened to one ingested group: the content of its ack."""

    group_id: GroupId
    status: AckStatus
    error: str = ""


class ReplayCore:
    def __init__(
        self,
        cfg: ReplayConfig,
        groups_per_batch: int,
        reference: ReferencePool | None = None,
        wal: WriteAheadLog | None = None,
    ):
        self.cfg = cfg
        self.reference = reference if reference is not None else ReferencePool([])
        self.wal = wal
        # eta: fixed, or with replay.max_staleness=auto steered by the learner (`set_max_staleness`).
        self.max_staleness = cfg.initial_staleness
        self.graces: list[tuple[int, int]] = []  # (last version, eta): see set_max_staleness
        self.admission = Admission(self.max_staleness, groups_per_batch, cfg.admission)
        self.metrics = ReplayMetrics()
        self.store = FreshStore()
        self.accepted = AcceptedSeqs()
        self.version = 0
        self.pending: PendingBatch | None = None
        self._unlogged_drops: list[tuple[GroupId, str]] = []  # since the last serve record
        # Groups held unserved that arrived without a ticket of their actor (max_ticketless bounds them);
        # they do not count against admission. Not logged: after a restart every group counts as ticketed.
        self.ticketless: dict[GroupId, int] = {}  # -> bytes
        self.recovered = 0  # log records applied at start-up
        if wal is not None:
            self._recover()

    # ----------------------------------------------------------------------------- ingest

    def ingest(self, groups: list[RolloutGroup]) -> list[Verdict]:
        """Accept new groups (logged before this returns); report duplicates, refuse unusable ones
        with their reason, and answer "retry" to what the budgets cannot hold now."""
        verdicts, new, seen = [], [], set()
        tickets = {g.actor_id: self.admission.held(g.actor_id) for g in groups}
        room = self._room()
        for g in groups:
            gid = g.group_id
            if gid in self.accepted or gid in seen:
                self.metrics.count("duplicates")
                verdicts.append(Verdict(gid, "duplicate"))
            elif (refusal := problem(g, self.cfg, self.version)) is not None:
                self.metrics.count(f"rejected:invalid_{refusal.reason}")
                verdicts.append(Verdict(gid, "error", f"{refusal.reason}: {refusal.detail}"))
            elif (full := room.take(resident_cost(g), self.cfg.admission and tickets[g.actor_id] <= 0)) is not None:
                self.metrics.count(f"deferred:{full}")
                verdicts.append(Verdict(gid, "retry", full))
            else:
                tickets[g.actor_id] -= 1
                seen.add(gid)
                new.append(g)
                verdicts.append(Verdict(gid, "ok"))
        if new:
            self._log(IngestRecord(new))
            for g in new:
                self._accept(g, live=True)
            self.metrics.arrived(len(new), sum(g.nbytes for g in new))
            self._maybe_compact()
        return verdicts

    def _room(self) -> _Room:
        cfg = self.cfg
        cap = cfg.max_ticketless if cfg.max_ticketless is not None else self.admission.groups_per_batch
        return _Room(cfg.max_store_mb * MiB - self.store.cost, cap - len(self.ticketless),
                     cfg.max_ticketless_mb * MiB - sum(self.ticketless.values()))

    def _accept(self, group: RolloutGroup, live: bool = False) -> None:
        """Take a group in; `live`: it arrived now (not redone from the log or a snapshot)."""
        gid = group.group_id
        self.accepted.add(gid)
        entry = self.store.add(group)
        if live and self.cfg.admission and not self.admission.held(group.actor_id):
            self.ticketless[gid] = entry.cost
        # A group already past its last batch used a ticket that expired with that batch: it takes none
        # of its actor's newer ones, which its fresher prompts hold.
        if not live or group.min_version >= self.version - self.expiry_bound(self.version):
            self.admission.arrived(group.actor_id, group.min_version)
        self.metrics.count("accepted")
        self.metrics.count("admitted")

    # ----------------------------------------------------------------------------- actors

    def tickets(self, req: TicketRequest, trusted: bool = True) -> TicketGrant:
        """Answer a ticket request; `trusted`: it carried the actor token (replay/staleness.py)."""
        granted = self.admission.grant(
            req.actor_id, req.want, req.outstanding, self.version, self.admitted, req.weights_version, trusted
        )
        self.metrics.count("tickets_granted", granted)
        return TicketGrant(req.actor_id, granted, self.version)

    @property
    def admitted(self) -> int:
        """Groups accepted minus those dropped without ever being served, less the ticketless ones
        still waiting (admission's count: a peer sending groups it was never granted takes no
        capacity from the actors that were)."""
        return self.metrics.counters["admitted"] - len(self.ticketless)

    def resume(self, actor_id: int, trusted: bool = True) -> ResumeInfo:
        self.metrics.count("tickets_voided", self.admission.reset(actor_id, trusted))
        watermark, above = self.accepted.resume_point(actor_id)
        return ResumeInfo(actor_id, watermark, above, self.version)

    def set_max_staleness(self, eta: int) -> str:
        """The learner's new bound (replay.max_staleness=auto): admission grants by it from now on. A
        lower bound spares what was admitted under the higher one: a ticket granted at basis w <= v
        (this version) is consumed by batch w + before, so until batch v + before the expiry keeps
        `before` (a grace) and the groups the actors made under it are trained on, not dropped.
        Neither is logged: after a restart the bound is the lower limit, with no grace, until the
        learner's next decision says it again."""
        cfg = self.cfg
        if not cfg.auto_staleness:
            raise ValueError(f"the bound is fixed (replay.max_staleness={cfg.max_staleness}); only auto is steered")
        if not cfg.staleness_min <= eta <= cfg.staleness_max:
            raise ValueError(f"eta {eta} outside [replay.staleness_min, replay.staleness_max] = "
                             f"[{cfg.staleness_min}, {cfg.staleness_max}]")
        before, self.max_staleness = self.max_staleness, eta
        self.admission.max_staleness = eta
        if eta < before:
            self.graces.append((self.version + before, before))
        return f"max_staleness {before} -> {eta}"

    def expiry_bound(self, version: int) -> int:
        """The staleness a batch of `version` may use: eta, or a grace's higher bound while it lasts."""
        self.graces = [(until, eta) for until, eta in self.graces if version <= until]
        return max([self.max_staleness] + [eta for _, eta in self.graces])

    # ----------------------------------------------------------------------------- batches

    def request(self, req: BatchRequest) -> Batch | None:
        """Start on a batch request. A retried request id gets the pending batch again; a new one
        confirms the pending batch and gets a new batch now, or None if it should wait (call serve
        again when groups arrive, and with final=True at its deadline)."""
        if req.request_id and self.pending is not None and req.request_id == self.pending.request_id:
            return self._pending_batch()
        self._confirm_pending()
        self.version = req.version
        return self.serve(req, final=req.wait_s <= 0)

    def serve(self, req: BatchRequest, final: bool) -> Batch | None:
        self._expire()
        if not final and (self.store.count("unserved") < req.num_groups or self._awaiting_last_chance(req)):
            return None
        entries = self.store.take(req.num_groups, reuse=self.cfg.max_reuse > 1)
        samples = sum(len(e.group.completions) for e in entries)
        refs = self.reference.draw(self._reference_due(samples))
        record = ServeRecord(
            req.request_id,
            req.version,
            [e.group.group_id for e in entries],
            [r.sample_id for r in refs],
            self._unlogged_drops,
        )
        self._log(record)
        self._unlogged_drops = []
        self._served(record, entries)
        self._maybe_compact()
        drops = Counter(reason for _, reason in record.dropped)
        return Batch(req.version, [e.group for e in entries], refs, dict(drops), req.request_id)

    def _awaiting_last_chance(self, req: BatchRequest) -> bool:
        """Hold the batch for groups on their way whose tickets were granted at version v - eta: this
        batch is the last that may use them, and admission counted them into it. Served without
        them, fresher groups would fill it and they would arrive to be dropped as stale. Only while
        they all fit; the request's deadline still bounds the wait (an actor that died holding them)."""
        if not self.cfg.admission:
            return False
        bound = self.expiry_bound(req.version)
        coming = self.admission.last_chance(req.version, bound)
        oldest = req.version - bound
        return coming > 0 and self.store.unserved_up_to(oldest) + coming <= req.num_groups

    def _reference_due(self, samples: int) -> int:
        """Reference samples for a batch of `samples` fresh ones: round(ratio x fresh samples served),
        counted over every batch so far, minus those already drawn. A learner step put together from
        partial batches (its deadline passed before enough groups arrived) thus draws what one batch
        of its size would, which keeps a seeded run the same whatever the timing."""
        c = self.metrics.counters
        due = int(self.cfg.reference_ratio * (c["served_samples"] + samples) + 0.5) - c["served_reference"]
        return max(due, 0)

    def _served(self, record: ServeRecord, entries: list[Entry]) -> None:
        """Bookkeeping shared by serving a batch and replaying its log record."""
        self.pending = PendingBatch(record.request_id, record.version, record.group_ids, record.reference_ids)
        self.version = record.version
        m = self.metrics
        m.count("batches")
        m.count("served_groups", len(entries))
        m.count("served_samples", sum(len(e.group.completions) for e in entries))
        m.count("served_reference", len(record.reference_ids))
        for e in entries:
            m.count(f"staleness:{staleness(record.version, e.min_version)}")
            self.ticketless.pop(e.group.group_id, None)
        m.counters["last_batch_fresh_samples"] = sum(len(e.group.completions) for e in entries)
        m.counters["last_batch_reference"] = len(record.reference_ids)

    def _pending_batch(self) -> Batch:
        p = self.pending
        assert p is not None
        groups = [e.group for gid in p.group_ids if (e := self.store.get(gid)) is not None]
        refs = [r for rid in p.reference_ids if (r := self.reference.get(rid)) is not None]
        self.metrics.count("batches_resent")
        return Batch(p.version, groups, refs, {}, p.request_id)

    def _confirm_pending(self) -> None:
        if self.pending is None:
            return
        for gid in self.pending.group_ids:
            entry = self.store.get(gid)
            if entry is not None and entry.place == "pending" and self.store.release(entry, self.cfg.max_reuse):
                self.metrics.count("used_up")
        self.pending = None

    def _expire(self) -> None:
        oldest = self.version - self.expiry_bound(self.version)
        for entry in self.store.expire(oldest):
            self._dropped(entry, "stale_reused" if entry.served else "stale")
        self.admission.expire(oldest)  # tickets whose groups would be dropped as those were

    def _dropped(self, entry: Entry, reason: str) -> None:
        self.metrics.count(f"drop:{reason}")
        self.ticketless.pop(entry.group.group_id, None)
        if not entry.served:
            self.metrics.count("admitted", -1)
        self._unlogged_drops.append((entry.group.group_id, reason))

    # ----------------------------------------------------------------------------- durability

    def _log(self, record: Record) -> None:
        if self.wal is not None:
            self.wal.append(record)

    def _maybe_compact(self) -> None:
        if self.wal is not None and self.wal.bytes_since_base > self.cfg.wal_compact_mb * MiB:
            self.wal.write_base(self._write_base)

    def _write_base(self, path: Path, segment: int) -> None:
        self._write_state(path, segment)

    def _write_state(self, path: str | Path, segment: int) -> Path:
        """Write the whole state (a base or a snapshot). A held group that cannot be stored is
        quarantined and the rest written, so no one record can fail a snapshot or a recovery."""
        try:
            return write_state(path, self.state(segment))
        except (OverflowError, TypeError, ValueError):  # pyarrow's errors are ValueErrors too
            bad = [(entry, why) for entry in self.store if (why := unstorable(entry.group)) is not None]
            if not bad:
                raise
        for entry, why in bad:
            self._quarantine(entry, why)
        return write_state(path, self.state(segment))

    def _quarantine(self, entry: Entry, why: str) -> None:
        """Out of the store and, its position open again, out of the accepted index: the actor that
        made it generates it again when it resumes. Counted as refused (`quarantined`), logged with why."""
        gid = entry.group.group_id
        self.store.remove(gid)
        self.accepted.discard(gid)
        self.ticketless.pop(gid, None)
        if not entry.served:
            self.metrics.count("admitted", -1)
        self.metrics.count("rejected:quarantined")
        log.error("replay: group %s quarantined: it cannot be stored (%s); dropped, its position open again",
                  gid, why)

    def _recover(self) -> None:
        assert self.wal is not None
        base = self.wal.latest_base()
        if base is not None:
            self._load(read_state(base[1]))
        for record in self.wal.records(base[0] if base is not None else 0, repair=True):
            self._apply(record)
            self.recovered += 1
        if self.recovered:  # the next recovery starts from here
            self.wal.write_base(self._write_base)
        else:
            self.wal.open()

    def _apply(self, record: Record) -> None:
        """Redo a logged record on recovery, as the live path did it."""
        if isinstance(record, IngestRecord):
            for g in record.groups:
                if g.group_id not in self.accepted:
                    self._accept(g)
            return
        self._confirm_pending()
        for gid, reason in record.dropped:
            if self.store.get(gid) is not None:
                self._dropped(self.store.remove(gid), reason)
        self._unlogged_drops = []
        entries = [e for gid in record.group_ids if (e := self.store.claim(gid)) is not None]
        self.reference.cursor += len(record.reference_ids)
        self._served(record, entries)

    def state(self, wal_segment: int = 0) -> ReplayState:
        entries = list(self.store)
        return ReplayState(
            version=self.version,
            groups=[e.group for e in entries],
            served=[e.served for e in entries],
            pending=self.pending,
            accepted=self.accepted.to_state(),
            counters=self.metrics.to_state(),
            reference_cursor=self.reference.cursor,
            wal_id=self.wal.wal_id if self.wal is not None else "",
            wal_segment=wal_segment,
        )

    def _load(self, state: ReplayState) -> None:
        pending = set(state.pending.group_ids) if state.pending else set()
        self.store = FreshStore()
        for g, served in zip(state.groups, state.served, strict=True):
            self.store.add(g, served, pending=g.group_id in pending)
        self.accepted = AcceptedSeqs.from_state(state.accepted)
        self.ticketless = {}
        self.metrics.load_state(state.counters)
        self.version = state.version
        self.pending = state.pending
        self.reference.cursor = state.reference_cursor
        self._unlogged_drops = []

    def snapshot(self, path: str | Path, version: int = -1) -> str:
        """Write the whole state to `path` (a directory, or a *.arrow file) for a learner checkpoint
        taken at `version` (the learner's, newer than the last one it asked a batch for)."""
        self.version = max(self.version, version)
        segment = self.wal.roll() if self.wal is not None else 0
        target = self._write_state(path, segment)
        if self.wal is not None:
            self.wal.keep_from(segment)
        return f"replay snapshot at version {self.version}: {len(self.store)} groups held, written to {target}"

    def restore(self, path: str | Path) -> str:
        """Return to a snapshot.

        The learner rewinds to its checkpoint, so batches served after the snapshot are forgotten;
        groups accepted after it are re-added from the log (actors will not resend them), and any
        group with tokens from versions after the snapshot's is dropped as `rewound` and its position
        is no longer accepted: an actor that resumes generates it again, so a resumed run consumes what
        an uninterrupted one would have (an actor that keeps running has moved past it)."""
        state = read_state(path)
        notes, later = [], []
        if self.wal is not None and state.wal_id == self.wal.wal_id:
            if self.wal.missing_segments(state.wal_segment):
                notes.append("log segments after the snapshot are gone, groups accepted after it are lost")
            accepted_then = AcceptedSeqs.from_state(state.accepted)
            for record in self.wal.records(state.wal_segment):
                if isinstance(record, IngestRecord):
                    later += [g for g in record.groups if g.group_id not in accepted_then]
        elif self.wal is not None:
            notes.append("snapshot of another log, groups accepted after it were not re-added")
        self._load(state)
        for g in later:
            if g.group_id not in self.accepted:
                self._accept(g)
        rewound = [e for e in self.store if e.place != "pending" and e.max_version > self.version]
        for e in rewound:
            self._dropped(self.store.remove(e.group.group_id), "rewound")
            self.accepted.discard(e.group.group_id)
        if self.wal is not None:  # the log now starts from the restored state
            self.wal.write_base(self._write_base)
        return (
            f"replay restored to version {self.version}: {len(self.store)} groups held, "
            f"{len(later)} accepted after the snapshot re-added, {len(rewound)} dropped as rewound"
            + "".join(f"; {n}" for n in notes)
        )

    # ----------------------------------------------------------------------------- metrics

    def stats(self) -> ReplayStats:
        m, s, c = self.metrics, self.store, self.metrics.counters
        fresh = c["served_samples"]
        wal = self.wal
        return ReplayStats(
            version=self.version,
            occupancy=Occupancy(
                groups=len(s),
                unserved=s.count("unserved"),
                reusable=s.count("reusable"),
                pending=s.count("pending"),
                samples=s.samples,
                tokens=s.tokens,
                bytes=s.cost,
            ),
            ingest=m.ingest_rate(),
            accepted=c["accepted"],
            duplicates=c["duplicates"],
            drops=m.group("drop"),
            refused=Refusals(by_kind=m.group("rejected")),
            deferred=m.group("deferred"),
            staleness_hist={int(k): v for k, v in m.group("staleness").items()},
            served=Served(
                batches=c["batches"],
                batches_resent=c["batches_resent"],
                groups=c["served_groups"],
                samples=fresh,
                reference=c["served_reference"],
                used_up=c["used_up"],
            ),
            mix=Mix(
                reference_per_fresh_sample=c["served_reference"] / fresh if fresh else 0.0,
                last_batch_fresh_samples=c["last_batch_fresh_samples"],
                last_batch_reference=c["last_batch_reference"],
            ),
            tickets=Tickets(
                granted=c["tickets_granted"],
                voided=c["tickets_voided"],
                in_flight=self.admission.in_flight_total,
                capacity=self.admission.capacity(self.version, self.admitted),
                admitted=self.admitted,
                overclaimed=self.admission.overclaimed,
                expired=self.admission.expired,
                anonymous=self.admission.anonymous_granted,
            ),
            reference_pool=len(self.reference),
            wal=WalStats(
                segment=wal.segment,
                bytes_since_base=wal.bytes_since_base,
                damaged_records=wal.damaged_records,
                skipped_bytes=wal.skipped_bytes,
                truncated_bytes=wal.truncated_bytes,
            )
            if wal is not None
            else WalStats(),
            replies_dropped=c["replies_dropped"],
            gate_restarts=c["gate_restarts"],
        )
