"""The replay core at its edges (replay/core.py): groups whose completions come from different
versions, a restore at exactly a group's newest version and one before it, a log exactly at its
compaction size and one byte past, a snapshot asked for an older version, and counts that must move
by exactly what happened."""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil

import msgspec
import numpy as np

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, ReferenceSample, ResumeInfo, TicketGrant, TicketRequest
from dph_async.replay import core as core_module
from dph_async.replay.core import MiB, ReplayCore
from dph_async.replay.reference_pool import ReferencePool
from dph_async.replay.state import read_state
from dph_async.replay.store import resident_cost
from dph_async.replay.wal import MAGIC, WriteAheadLog
from dph_async.replay_stats import (
    IngestRate,
    Mix,
    Occupancy,
    Refusals,
    ReplayStats,
    Served,
    Tickets,
    WalStats,
)
from dph_async.tools.bench.transport import synthetic_group


def make_core(wal_dir=None, **cfg) -> ReplayCore:
    config = ReplayConfig(**({"max_staleness": 100, "admission": False, "max_version_lead": 100} | cfg))
    wal = WriteAheadLog(wal_dir, segment_bytes=config.wal_segment_mb * 2**20) if wal_dir is not None else None
    return ReplayCore(config, groups_per_batch=4, wal=wal)


def mixed(actor: int, seq: int, versions: list[int]):
    """A group whose completions were generated under different weights: one version per completion."""
    g = synthetic_group(actor, seq, n=len(versions), tokens=3)
    for c, v in zip(g.completions, versions, strict=True):
        c.versions = np.full(3, v, np.int32)
    return g


def held(core: ReplayCore) -> list[tuple[int, int]]:
    return sorted(e.group.group_id for e in core.store)


def test_a_restore_rewinds_every_group_with_a_token_newer_than_the_snapshot_and_keeps_its_pending_batch(tmp_path):
    """Snapshot at version 2: a group whose newest token is of version 2 stays; one with a single
    completion of version 3 among older ones is rewound like a group all of version 3; a group of the
    snapshot's pending batch stays, whatever its versions (the learner has it)."""
    core = make_core(tmp_path / "log")
    core.ingest([mixed(0, 0, [0, 3])])
    core.request(BatchRequest(2, 1, 0.0, request_id=1))  # (0, 0) pending at the snapshot
    core.snapshot(tmp_path / "ckpt")
    core.ingest([mixed(1, 0, [1, 2]), mixed(1, 1, [1, 3]), mixed(1, 2, [3, 3]), mixed(1, 3, [2, 2, 1])])
    detail = core.restore(tmp_path / "ckpt")
    assert detail.endswith("4 accepted after the snapshot re-added, 2 dropped as rewound")
    assert held(core) == [(0, 0), (1, 0), (1, 3)]
    assert core.stats().drops == {"rewound": 2}
    assert held(make_core(tmp_path / "log")) == held(core)  # the log starts from the restored state
    assert [v.status for v in core.ingest([mixed(1, i, [2]) for i in range(4)])] == ["duplicate", "ok", "ok",
                                                                                      "duplicate"]


def test_a_snapshot_is_taken_at_the_newer_of_the_replays_version_and_the_learners(tmp_path):
    core = make_core(tmp_path / "log")
    core.ingest([synthetic_group(0, 0)])
    core.request(BatchRequest(3, 0, 0.0, request_id=1))
    assert core.snapshot(tmp_path / "a.arrow", version=2) == (f"replay snapshot at version 3: 1 groups held, "
                                                               f"written to {tmp_path / 'a.arrow'}")
    assert core.snapshot(tmp_path / "b.arrow", version=4).startswith("replay snapshot at version 4: ")
    assert (read_state(tmp_path / "a.arrow").version, read_state(tmp_path / "b.arrow").version) == (3, 4)
    assert core.version == 4


def test_the_log_is_compacted_one_byte_past_its_size_and_not_at_it(tmp_path):
    probe = make_core(tmp_path / "probe")
    group = synthetic_group(0, 0)
    probe.ingest([group])
    size = probe.wal.bytes_since_base
    at = make_core(tmp_path / "at", wal_compact_mb=size / MiB)
    at.ingest([group])
    assert at.stats().wal.bytes_since_base == size and not list((tmp_path / "at").glob("base-*"))
    past = make_core(tmp_path / "past", wal_compact_mb=(size - 1) / MiB)
    past.ingest([group])
    assert past.stats().wal.bytes_since_base == 0 and [p.name for p in (tmp_path / "past").glob("base-*")] == [
        "base-00000001.arrow"]


def test_a_restore_without_a_log_and_its_notes_word_for_word(tmp_path):
    """Without a log nothing is re-added and no note; a snapshot of another log, or one whose segments
    this log never held (its directory older than the snapshot), says what was not re-added."""
    plain = make_core()
    plain.ingest([synthetic_group(0, 0)])
    assert plain.snapshot(tmp_path / "plain.arrow").startswith("replay snapshot at version 0: 1 groups held")
    assert (read_state(tmp_path / "plain.arrow").wal_segment, read_state(tmp_path / "plain.arrow").wal_id) == (0, "")
    assert plain.restore(tmp_path / "plain.arrow") == ("replay restored to version 0: 1 groups held, 0 accepted "
                                                       "after the snapshot re-added, 0 dropped as rewound")
    other = make_core(tmp_path / "other")
    assert other.restore(tmp_path / "plain.arrow").endswith(
        "0 dropped as rewound; snapshot of another log, groups accepted after it were not re-added")
    core = make_core(tmp_path / "log")
    core.ingest([synthetic_group(0, 1)])
    shutil.copytree(tmp_path / "log", tmp_path / "older")  # a copy of the log made before the snapshots
    core.snapshot(tmp_path / "first")
    core.snapshot(tmp_path / "ckpt")
    assert read_state(tmp_path / "ckpt").wal_segment == core.wal.segment == 2
    older = make_core(tmp_path / "older")  # its recovery starts segment 1: segment 2 was never written here
    assert older.restore(tmp_path / "ckpt").endswith(
        "0 dropped as rewound; log segments after the snapshot are gone, groups accepted after it are lost")


def test_a_batch_and_its_resend_carry_the_request_and_the_counts_move_by_exactly_what_was_served():
    core = make_core(max_staleness=1)
    core.ingest([synthetic_group(0, i, n=1 + i, tokens=2, version=0) for i in range(4)])
    core.ingest([synthetic_group(0, 0)])  # a duplicate
    batch = core.request(BatchRequest(1, 2, 0.0, request_id=7))
    assert (batch.version, batch.request_id, batch.drops, [g.seq for g in batch.groups]) == (1, 7, {}, [0, 1])
    again = core.request(BatchRequest(1, 2, 0.0, request_id=7))
    assert (again.version, again.request_id, again.drops, [g.seq for g in again.groups]) == (1, 7, {}, [0, 1])
    stats = core.stats()
    assert (stats.accepted, stats.duplicates, stats.served.batches, stats.served.batches_resent,
            stats.served.groups, stats.served.samples, stats.mix.last_batch_fresh_samples) == (4, 1, 1, 1, 2, 3, 3)
    assert stats.staleness_hist == {1: 2}
    last = core.request(BatchRequest(3, 4, 0.0, request_id=8))  # version 3: the two left are too old
    assert (last.groups, last.drops) == ([], {"stale": 2})
    stats = core.stats()
    assert (stats.served.batches, stats.served.groups, stats.served.used_up, stats.tickets.admitted) == (2, 2, 2, 2)


def test_a_request_that_may_wait_waits_for_a_full_batch_and_one_that_may_not_takes_what_there_is():
    core = make_core()
    core.ingest([synthetic_group(0, 0)])
    assert core.request(BatchRequest(0, 2, 1.0, request_id=1)) is None
    assert [g.seq for g in core.request(BatchRequest(0, 2, 0.0, request_id=2)).groups] == [0]
    core.ingest([synthetic_group(0, i) for i in (1, 2)])
    assert [g.seq for g in core.request(BatchRequest(0, 2, 1.0, request_id=3)).groups] == [1, 2]
    assert core.request(BatchRequest(0, 2, 1.0, request_id=4)) is None  # batch 3 confirmed, none pending
    assert core.pending is None and core.request(BatchRequest(0, 2, 1.0, request_id=4)) is None


def test_groups_are_served_again_only_while_max_reuse_allows_and_drops_count_admitted_ones_once(tmp_path):
    """max_reuse 2: a group comes back after its first batch, not after its second. A reusable group
    that expires was admitted and served: it no longer counts against admission only once."""
    core = make_core(max_reuse=2, max_staleness=1)
    core.ingest([synthetic_group(0, 0, version=0)])
    assert [g.seq for g in core.request(BatchRequest(0, 1, 0.0, request_id=1)).groups] == [0]
    assert core.request(BatchRequest(0, 0, 0.0, request_id=2)).groups == []  # confirms the first
    core.snapshot(tmp_path / "reused.arrow")  # (0, 0) served once, reusable
    assert [g.seq for g in core.request(BatchRequest(0, 1, 0.0, request_id=3)).groups] == [0]
    assert core.request(BatchRequest(0, 1, 0.0, request_id=4)).groups == []
    core.ingest([synthetic_group(0, i, version=0) for i in (1, 2)])
    core.request(BatchRequest(0, 1, 0.0, request_id=5))  # (0, 1) served once, then reusable
    core.request(BatchRequest(2, 0, 0.0, request_id=6))  # version 2: both too old
    assert core.stats().drops == {"stale": 1, "stale_reused": 1}
    assert core.stats().tickets.admitted == 2  # three accepted, one dropped unserved
    once = make_core(max_reuse=1)  # a group served once under max_reuse 2, restored where groups are used once
    once.restore(tmp_path / "reused.arrow")
    assert len(once.store) == 1 and once.request(BatchRequest(0, 1, 0.0, request_id=7)).groups == []


def test_tickets_and_resume_answer_for_the_actor_at_the_replays_version():
    core = make_core(admission=True, max_staleness=1)
    core.request(BatchRequest(3, 0, 0.0, request_id=1))
    assert core.tickets(TicketRequest(5, 2, 0, weights_version=3)) == TicketGrant(5, 2, 3)
    assert core.stats().tickets.granted == 2
    core.ingest([synthetic_group(5, 0, version=3)])
    assert core.resume(5) == ResumeInfo(5, 1, [], 3)
    assert core.stats().tickets.voided == 1


def test_a_ticketless_group_dropped_or_quarantined_leaves_the_ticketless_budget(tmp_path, monkeypatch, caplog):
    core = make_core(admission=True, max_staleness=1)
    core.ingest([synthetic_group(9, 0, version=0)])  # no ticket: held apart
    assert len(core.ticketless) == 1 and core.stats().tickets.admitted == 0
    core.request(BatchRequest(2, 0, 0.0, request_id=1))
    assert core.stats().drops == {"stale": 1} and core.ticketless == {} and core.stats().tickets.admitted == 0
    monkeypatch.setattr(core_module, "problem", lambda *a: None)  # a build that accepted anything
    bad = synthetic_group(9, 1, version=2)
    bad.sampling = msgspec.structs.replace(bad.sampling, top_k=2**64 - 1)  # cannot be stored
    core.ingest([bad])
    with caplog.at_level(logging.ERROR, logger="dph_async.replay.core"):
        core.snapshot(tmp_path / "s.arrow")
    assert re.fullmatch(r"replay: group \(9, 1\) quarantined: it cannot be stored \(.+\); dropped, its position "
                        "open again", caplog.messages[0])
    assert core.ticketless == {} and core.stats().tickets.admitted == 0 and len(core.store) == 0


def pool(k: int) -> ReferencePool:
    return ReferencePool([ReferenceSample(f"r{i}", np.zeros(2, np.int32), np.zeros(1, np.int32),
                                          np.zeros(1, np.float32), 1.0, "math") for i in range(k)])


def test_no_reference_sample_is_due_at_a_ratio_of_zero():
    core = ReplayCore(ReplayConfig(reference_ratio=0.0, wal_dir=None, admission=False), 4, reference=pool(1))
    core.ingest([synthetic_group(0, 0)])
    assert core.request(BatchRequest(0, 1, 0.0, request_id=1)).reference == []


def test_a_lower_bound_keeps_the_higher_one_for_the_batches_admitted_under_it_also_while_batches_wait():
    core = make_core(admission=True, max_staleness="auto", staleness_min=1, staleness_max=4)
    assert core.set_max_staleness(4) == "max_staleness 1 -> 4"  # the highest allowed
    assert core.set_max_staleness(2) == "max_staleness 4 -> 2"
    core.ingest([synthetic_group(0, 0, version=0)])
    batch = core.request(BatchRequest(4, 1, 5.0, request_id=1))  # staleness 4: the grace's bound
    assert [g.seq for g in batch.groups] == [0]


def test_the_stats_say_exactly_what_happened():
    core = ReplayCore(ReplayConfig(max_staleness=1, max_reuse=2, reference_ratio=0.5, wal_dir=None, admission=False),
                      groups_per_batch=4, reference=pool(3))
    groups = [synthetic_group(0, 0, n=2, tokens=3), synthetic_group(0, 1, n=1, tokens=3),
              synthetic_group(0, 2, n=3, tokens=3, version=1)]
    core.ingest(groups)
    core.ingest([synthetic_group(0, 0)])
    core.request(BatchRequest(1, 2, 0.0, request_id=1))  # (0, 0) and (0, 1): 3 samples, 2 references
    core.request(BatchRequest(1, 2, 0.0, request_id=1))  # the reply was lost: sent again
    stats = core.stats()
    assert stats.ingest.groups_per_s == 3 / 10  # arrivals over the last 10 s
    assert stats.ingest.mb_per_s == sum(g.nbytes for g in groups) / 10 / 1e6
    assert stats == ReplayStats(
        version=1,
        occupancy=Occupancy(groups=3, unserved=1, reusable=0, pending=2, samples=6, tokens=18,
                            bytes=sum(resident_cost(g) for g in groups)),
        ingest=stats.ingest, accepted=3, duplicates=1, drops={}, refused=Refusals(), deferred={},
        staleness_hist={1: 2},
        served=Served(batches=1, batches_resent=1, groups=2, samples=3, reference=2, used_up=0),
        mix=Mix(reference_per_fresh_sample=2 / 3, last_batch_fresh_samples=3, last_batch_reference=2),
        tickets=Tickets(granted=0, voided=0, in_flight=0, capacity=(1 + 1 + 1) * 4 - 3, admitted=3, overclaimed=0),
        reference_pool=3, wal=WalStats(), replies_dropped=0, gate_restarts=0)
    assert stats.ingest != IngestRate()


def test_a_recovered_replay_counts_holds_and_serves_what_the_crashed_one_would(tmp_path):
    """Recovery redoes the log from the newest base on, not from the older segments a snapshot keeps:
    the same groups, drops, counts and reference draws as the replay had when it was killed."""
    def replay(directory) -> ReplayCore:
        config = ReplayConfig(max_staleness=1, admission=False, reference_ratio=0.5, wal_compact_mb=0.01)
        return ReplayCore(config, groups_per_batch=4, reference=pool(5), wal=WriteAheadLog(directory))

    core = replay(tmp_path / "log")
    core.ingest([synthetic_group(0, i, n=2, tokens=3, version=0) for i in range(3)])
    core.request(BatchRequest(0, 1, 0.0, request_id=1))
    core.snapshot(tmp_path / "ckpt")  # keeps the segments from here on
    core.ingest([synthetic_group(0, i, n=2, tokens=3, version=1) for i in range(3, 6)])
    core.request(BatchRequest(2, 1, 0.0, request_id=2))  # (0, 1) and (0, 2) dropped as stale
    core.ingest([synthetic_group(0, i, n=50, tokens=30, version=2) for i in range(6, 9)])  # a base: compacted
    core.request(BatchRequest(2, 2, 0.0, request_id=3))
    core.ingest([synthetic_group(0, 9, version=2)])
    core.request(BatchRequest(4, 1, 0.0, request_id=4))  # (0, 6) to (0, 9) dropped as stale, after the base
    bases = sorted(p.name for p in (tmp_path / "log").glob("base-*"))
    assert len(bases) == 1 and (tmp_path / "log" / "seg-00000001.wal").exists()  # older segments kept
    recovered = replay(tmp_path / "log")
    assert recovered.recovered == 3  # the two batches and the ingest after the base
    assert dataclasses.replace(recovered.stats(), ingest=IngestRate(), wal=WalStats()) == \
        dataclasses.replace(core.stats(), ingest=IngestRate(), wal=WalStats())
    assert held(recovered) == held(core) and recovered.pending == core.pending
    assert recovered.stats().drops == {"stale": 6} and held(recovered) == []
    for c in (core, recovered):
        c.ingest([synthetic_group(0, 10, version=4)])
    ids = [[r.sample_id for r in c.request(BatchRequest(4, 1, 0.0, request_id=5)).reference] for c in (core, recovered)]
    assert ids[0] == ids[1] and ids[0]


def test_the_stats_of_an_empty_replay_are_zero_and_every_count_of_a_busy_one_is_its_own(tmp_path):
    """Every field of the stats non-zero once (admission, reuse, references, the log, the service's counts),
    so a field read from another count, or left at its default, shows."""
    empty = make_core(admission=False, max_staleness=1)
    assert empty.stats() == ReplayStats(tickets=Tickets(capacity=(1 + 0 + 1) * 4))
    config = ReplayConfig(max_staleness=1, max_reuse=2, reference_ratio=0.5, admission=True, max_ticketless=1)
    core = ReplayCore(config, groups_per_batch=4, reference=pool(3), wal=WriteAheadLog(tmp_path))
    assert core.tickets(TicketRequest(0, 3, 0, weights_version=0)).granted == 3
    ticketed = [synthetic_group(0, 0, n=2, tokens=3), synthetic_group(0, 1, n=1, tokens=3)]
    ticketless = synthetic_group(9, 0, n=3, tokens=3, version=1)
    assert [(v.group_id, v.status) for v in core.ingest([*ticketed, ticketed[0]])] == [
        ((0, 0), "ok"), ((0, 1), "ok"), ((0, 0), "duplicate")]
    assert [(v.group_id, v.status) for v in core.ingest([ticketless, synthetic_group(9, 1)])] == [
        ((9, 0), "ok"), ((9, 1), "retry")]
    core.request(BatchRequest(1, 2, 0.0, request_id=1))  # (0, 0) and (0, 1): 3 samples, 2 references
    core.request(BatchRequest(1, 2, 0.0, request_id=1))  # sent again
    core.request(BatchRequest(1, 0, 0.0, request_id=2))  # confirms it: both reusable
    core.tickets(TicketRequest(0, 0, 5, weights_version=1))  # claims 5 held of the 1 it holds: ignored
    core.metrics.count("replies_dropped", 2)  # the service's own counts
    core.metrics.count("gate_restarts")
    groups = [*ticketed, ticketless]
    stats = core.stats()
    assert stats == ReplayStats(
        version=1,
        occupancy=Occupancy(groups=3, unserved=1, reusable=2, pending=0, samples=6, tokens=18,
                            bytes=sum(resident_cost(g) for g in groups)),
        ingest=stats.ingest, accepted=3, duplicates=1, drops={}, refused=Refusals(), deferred={"no_ticket": 1},
        staleness_hist={1: 2},
        served=Served(batches=2, batches_resent=1, groups=2, samples=3, reference=2, used_up=0),
        mix=Mix(reference_per_fresh_sample=2 / 3, last_batch_fresh_samples=0, last_batch_reference=0),
        # 3 granted, 2 used; admitted: 3 accepted less the ticketless one; capacity (eta + v + 1) B less both
        tickets=Tickets(granted=3, voided=0, in_flight=1, capacity=(1 + 1 + 1) * 4 - 2 - 1, admitted=2,
                        overclaimed=1),
        reference_pool=3,
        wal=WalStats(segment=0, bytes_since_base=(tmp_path / "seg-00000000.wal").stat().st_size - len(MAGIC)),
        replies_dropped=2, gate_restarts=1)
    recovered = ReplayCore(config, groups_per_batch=4, reference=pool(3), wal=WriteAheadLog(tmp_path))
    assert recovered.ticketless == {} and recovered.stats().tickets.admitted == 3  # after a restart all ticketed


def test_groups_of_one_call_share_the_store_budget():
    g, h = synthetic_group(0, 0, n=3, tokens=5), synthetic_group(0, 1, n=3, tokens=5)
    core = make_core(max_store_mb=1.5 * resident_cost(g) / MiB)
    assert [v.status for v in core.ingest([g, h])] == ["ok", "retry"]
    refused = synthetic_group(0, 2, version=1000)  # beyond the allowed lead
    assert [(v.group_id, v.status) for v in core.ingest([refused])] == [((0, 2), "error")]


def test_what_the_store_and_the_ticketless_groups_hold_already_counts_against_the_next_call():
    g = [synthetic_group(9, seq, n=3, tokens=5) for seq in range(4)]
    cost = resident_cost(g[0])
    store = make_core(max_store_mb=1.5 * cost / MiB)
    assert [(v.status, v.error) for v in store.ingest(g[:1]) + store.ingest(g[1:2])] == [("ok", ""),
                                                                                        ("retry", "store_full")]
    by_count = make_core(admission=True, max_ticketless=1)
    assert [(v.status, v.error) for v in by_count.ingest(g[:1]) + by_count.ingest(g[1:2])] == [("ok", ""),
                                                                                              ("retry", "no_ticket")]
    by_bytes = make_core(admission=True, max_ticketless=4, max_ticketless_mb=1.5 * cost / MiB)
    assert [v.status for v in by_bytes.ingest(g[:1]) + by_bytes.ingest(g[1:2])] == ["ok", "retry"]
