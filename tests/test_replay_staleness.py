"""Staleness: no batch holds a group older than eta, drops are counted, admission makes them zero."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, TicketRequest
from dph_async.replay.core import ReplayCore
from dph_async.replay.service import ReplayService
from dph_async.replay.staleness import Admission
from dph_async.replay_client import ReplayClient, RolloutSender
from dph_async.tools.bench.transport import synthetic_group


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_no_batch_holds_a_group_older_than_eta(eta):
    rng = random.Random(eta)
    core = ReplayCore(ReplayConfig(max_staleness=eta, admission=False, wal_dir=None), groups_per_batch=4)
    seq, version, served, dropped = 0, 0, 0, 0
    for step in range(60):
        arrivals = [
            synthetic_group(0, seq + i, n=2, tokens=3, version=rng.randint(max(0, version - 5), version))
            for i in range(rng.randint(0, 8))
        ]
        seq += len(arrivals)
        core.ingest(arrivals)
        version += rng.randint(0, 2)
        batch = core.request(BatchRequest(version, rng.randint(1, 6), 0.0, request_id=step + 1))
        assert all(version - g.min_version <= eta for g in batch.groups)
        served += len(batch.groups)
        dropped += sum(batch.drops.values())
        assert set(batch.drops) <= {"stale"}
    stats = core.stats()
    assert dropped == sum(stats.drops.values()) > 0  # every drop is counted and reported once
    assert stats.accepted == seq == served + dropped + stats.occupancy.unserved
    assert set(stats.staleness_hist) <= set(range(eta + 1))


def simulate(
    admission: bool, lag: int, report_weights: bool, eta: int = 1, b: int = 8, steps: int = 40
) -> ReplayCore:
    """Two actors that start every prompt they get a ticket for (wanting 2 batches each per step) and
    generate with weights `lag` versions behind the learner; a learner that trains whenever it gets
    a full batch."""
    core = ReplayCore(ReplayConfig(max_staleness=eta, admission=admission, wal_dir=None), groups_per_batch=b)
    seqs, version = [0, 0], 0
    for step in range(steps):
        weights = max(0, version - lag)
        for actor in (0, 1):
            req = TicketRequest(actor, 2 * b, 0, weights if report_weights else -1)
            granted = core.tickets(req).granted
            core.ingest(
                [
                    synthetic_group(actor, seqs[actor] + i, n=2, tokens=3, version=weights)
                    for i in range(granted)
                ]
            )
            seqs[actor] += granted
        batch = core.request(BatchRequest(version, b, 0.0, request_id=step + 1))
        assert all(version - g.min_version <= eta for g in batch.groups)
        if len(batch.groups) == b:
            version += 1
    return core


@pytest.mark.parametrize("lag", [0, 1])
def test_admission_makes_drops_zero_under_a_steady_workload(lag):
    core = simulate(admission=True, lag=lag, report_weights=True)
    stats = core.stats()
    assert stats.drops == {}
    assert stats.version >= 30  # the learner was not starved either
    # Without admission the same actors overproduce and the bound has to drop groups.
    assert sum(simulate(admission=False, lag=lag, report_weights=True).stats().drops.values()) > 100


def test_actors_behind_on_weights_get_fewer_tickets():
    core = ReplayCore(ReplayConfig(max_staleness=1, admission=True, wal_dir=None), groups_per_batch=4)
    core.version = 5
    assert core.tickets(TicketRequest(0, 100, 0, weights_version=5)).granted == (1 + 5 + 1) * 4
    core.admission.reset(0, trusted=True)
    assert core.tickets(TicketRequest(0, 100, 0, weights_version=2)).granted == (1 + 2 + 1) * 4
    # outstanding replaces the replay's count for that actor: a restarted replay heals.
    assert core.tickets(TicketRequest(0, 100, outstanding=16, weights_version=2)).granted == 0
    assert core.tickets(TicketRequest(0, 100, outstanding=0, weights_version=2)).granted == 16


def test_a_replacement_actor_voids_the_tickets_its_predecessor_never_used():
    core = ReplayCore(ReplayConfig(max_staleness=0, admission=True, wal_dir=None), groups_per_batch=4)
    assert core.tickets(TicketRequest(1, 4, 0, weights_version=0)).granted == 4
    core.ingest([synthetic_group(1, 0, n=2, tokens=3, version=0)])  # one delivered, three in flight
    assert core.tickets(TicketRequest(0, 4, 0, weights_version=0)).granted == 0  # the batch is taken
    # Actor 1's process is gone; its replacement resumes at position 1 and the three are voided.
    info = core.resume(1)
    assert (info.watermark, info.accepted_above) == (1, [])
    assert core.stats().tickets.voided == 3
    assert core.tickets(TicketRequest(0, 4, 0, weights_version=0)).granted == 3


def test_a_batch_waits_for_a_late_group_it_is_the_last_to_be_allowed_to_use():
    """A slow actor's group granted at version 0 arrives after a fast actor's version-1 groups: batch 1
    is its last (eta = 1), so batch 1 waits for it instead of filling up with the fresher groups."""
    core = ReplayCore(ReplayConfig(max_staleness=1, admission=True, wal_dir=None), groups_per_batch=4)

    def deliver(actor: int, first: int, n: int, version: int) -> None:
        core.ingest([synthetic_group(actor, first + i, n=2, tokens=3, version=version) for i in range(n)])

    assert core.tickets(TicketRequest(0, 4, 0, weights_version=0)).granted == 4
    assert core.tickets(TicketRequest(1, 4, 0, weights_version=0)).granted == 4
    deliver(0, 0, 4, version=0)
    deliver(1, 0, 3, version=0)  # actor 1's fourth group is still being made
    assert len(core.request(BatchRequest(0, 4, 5.0, request_id=1)).groups) == 4
    req = BatchRequest(1, 4, 5.0, request_id=2)
    assert core.request(req) is None  # three groups here
    assert core.tickets(TicketRequest(0, 4, 0, weights_version=1)).granted == 4
    deliver(0, 4, 4, version=1)
    assert core.serve(req, final=False) is None  # seven here, but the one on its way must be in this batch
    deliver(1, 3, 1, version=0)
    batch = core.serve(req, final=False)
    assert batch is not None and [g.min_version for g in batch.groups] == [0, 0, 0, 0]
    assert len(core.request(BatchRequest(2, 4, 5.0, request_id=3)).groups) == 4
    assert core.stats().drops == {}

    # At its deadline the batch is served without the late group (its actor may have died).
    assert core.tickets(TicketRequest(1, 4, 0, weights_version=2)).granted == 4
    deliver(1, 4, 3, version=2)
    req = BatchRequest(3, 4, 5.0, request_id=4)
    assert core.request(req) is None
    assert core.tickets(TicketRequest(0, 4, 0, weights_version=3)).granted == 4
    deliver(0, 8, 4, version=3)
    assert core.serve(req, final=False) is None
    assert [g.min_version for g in core.serve(req, final=True).groups] == [2, 2, 2, 3]


def test_a_group_finished_out_of_order_uses_the_ticket_of_its_own_version():
    """An actor running two prompts at once holds tickets granted at versions 0 and 1; the version-1
    group finishes first. It must use the version-1 ticket, so batch 1 still waits for the version-0
    group it is the last allowed to use (crediting the oldest ticket, it did not, and dropped it)."""
    core = ReplayCore(ReplayConfig(max_staleness=1, admission=True, wal_dir=None), groups_per_batch=4)

    def deliver(actor: int, seq: int, version: int) -> None:
        core.ingest([synthetic_group(actor, seq, n=2, tokens=3, version=version)])

    assert core.tickets(TicketRequest(0, 4, 0, weights_version=0)).granted == 4
    assert core.tickets(TicketRequest(1, 1, 0, weights_version=0)).granted == 1
    for seq in range(4):
        deliver(0, seq, version=0)
    assert len(core.request(BatchRequest(0, 4, 5.0, request_id=1)).groups) == 4
    req = BatchRequest(1, 4, 5.0, request_id=2)
    assert core.request(req) is None
    assert core.tickets(TicketRequest(1, 1, 1, weights_version=1)).granted == 1
    assert core.tickets(TicketRequest(0, 3, 0, weights_version=1)).granted == 3
    for seq in range(4, 7):
        deliver(0, seq, version=1)
    deliver(1, 1, version=1)  # actor 1's second prompt finished first
    assert core.admission.last_chance(1, bound=1) == 1
    assert core.serve(req, final=False) is None  # four here, but the version-0 group is on its way
    deliver(1, 0, version=0)
    batch = core.serve(req, final=False)
    assert batch is not None and sorted(g.min_version for g in batch.groups) == [0, 1, 1, 1]
    assert len(core.request(BatchRequest(2, 4, 0.0, request_id=3)).groups) == 1  # at its deadline
    assert core.stats().drops == {}


def test_tickets_an_actor_no_longer_counts_are_taken_from_its_newest_grant():
    """An honest actor counts fewer tickets than the replay only while a grant is on its way to it:
    those are the newest, and the older ones it still holds keep their batch waiting for them."""
    core = ReplayCore(ReplayConfig(max_staleness=1, admission=True, wal_dir=None), groups_per_batch=4)
    assert core.tickets(TicketRequest(0, 2, 0, weights_version=0)).granted == 2
    core.version = 1
    assert core.tickets(TicketRequest(0, 2, 2, weights_version=1)).granted == 2
    assert core.tickets(TicketRequest(0, 0, outstanding=2, weights_version=1)).granted == 0
    assert (core.admission.last_chance(1, bound=1), core.admission.last_chance(2, bound=1)) == (2, 0)


def test_steady_workload_over_sockets_has_no_drops(ipc):
    b, steps = 4, 12
    cfg = ReplayConfig(max_staleness=1, admission=True, wal_dir=None)
    service = ReplayService(cfg, ipc("ingest"), ipc("batch"), b)
    service.start_in_thread()
    stop = threading.Event()

    def actor(actor_id: int) -> None:
        sender = RolloutSender(service.ingest_endpoint, actor_id, token=service.actor_token, reply_timeout_s=5)
        seq = sender.resume().watermark
        weights = 0
        while not stop.is_set():
            granted = sender.tickets(4, wait_s=0.2, weights_version=weights)
            for _ in range(granted):
                sender.send(synthetic_group(actor_id, seq, n=2, tokens=8, version=weights))
                seq += 1
            sender.poll(0.01)
            weights = service.core.version  # "load" the newest weights, as a real actor does when told
        sender.close(flush_timeout_s=5)

    threads = [threading.Thread(target=actor, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    client = ReplayClient(service.batch_endpoint, reply_timeout_s=5, token=service.control_token)
    try:
        for version in range(steps):
            batch = client.get_batch(version, b, wait_s=10)
            assert len(batch.groups) == b
            assert all(version - g.min_version <= 1 for g in batch.groups)
        stats = client.stats()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        client.close()
        service.stop()
    assert stats.drops == {} and stats.served.groups == b * steps


AUTO = ReplayConfig(max_staleness="auto", staleness_min=1, staleness_max=4, admission=True, wal_dir=None)


def test_an_auto_bound_starts_at_its_minimum_and_admission_and_expiry_follow_what_the_learner_sets():
    b = 4
    core = ReplayCore(AUTO, groups_per_batch=b)
    assert core.max_staleness == 1 and core.admission.capacity(0, 0) == (1 + 1) * b
    assert core.set_max_staleness(3) == "max_staleness 1 -> 3"
    assert core.tickets(TicketRequest(0, 100, 0, 0)).granted == (3 + 1) * b  # (eta + v + 1) B, at the new eta
    core.ingest([synthetic_group(0, i, n=2, tokens=3, version=0) for i in range(2 * b)])
    # At version 3 the version-0 groups are within eta = 3: served.
    assert len(core.request(BatchRequest(3, b, 0.0, request_id=1)).groups) == b
    # The learner lowers the bound: admission grants by it at once, but the groups admitted under
    # eta = 3 keep it until batch 3 + 3 (the grace), so they are trained on, not dropped.
    core.set_max_staleness(1)
    held = core.admitted + core.admission.in_flight_total
    assert core.admission.capacity(3, core.admitted) == (1 + 3 + 1) * b - held == 4
    core.ingest([synthetic_group(0, i, n=2, tokens=3, version=0) for i in range(2 * b, 4 * b)])
    batch = core.request(BatchRequest(3, b, 0.0, request_id=2))
    assert [g.min_version for g in batch.groups] == [0] * b and batch.drops == {}
    assert core.expiry_bound(6) == 3
    # Past the grace the lower bound holds: version-0 groups at version 7 are dropped as stale.
    batch = core.request(BatchRequest(7, b, 0.0, request_id=3))
    assert batch.groups == [] and batch.drops == {"stale": 2 * b} and core.graces == []
    assert core.expiry_bound(7) == 1


def test_a_bound_is_set_only_under_auto_and_within_its_limits():
    core = ReplayCore(AUTO, groups_per_batch=4)
    for eta in (0, 5):
        with pytest.raises(ValueError, match=r"outside \[replay.staleness_min, replay.staleness_max\] = \[1, 4\]"):
            core.set_max_staleness(eta)
    fixed = ReplayCore(ReplayConfig(max_staleness=2, wal_dir=None), groups_per_batch=4)
    with pytest.raises(ValueError, match="the bound is fixed"):
        fixed.set_max_staleness(3)
    assert (core.max_staleness, fixed.max_staleness, fixed.admission.max_staleness) == (1, 2, 2)


def test_the_learner_sets_the_bound_with_its_control_identity_only(ipc):
    from dph_async.replay_client import ReplayError

    service = ReplayService(AUTO, ipc("ingest"), ipc("batch"), 4)
    service.start_in_thread()
    learner = ReplayClient(service.batch_endpoint, reply_timeout_s=5, token=service.control_token)
    stranger = ReplayClient(service.batch_endpoint, reply_timeout_s=5, token=b"x" * 32)
    try:
        assert learner.set_staleness(3) == "max_staleness 1 -> 3"
        with pytest.raises(ReplayError, match="needs the control identity"):
            stranger.set_staleness(4)
        with pytest.raises(ReplayError, match="set_staleness refused: eta 9 outside"):
            learner.set_staleness(9)
        assert service.core.max_staleness == 3 and service.core.admission.max_staleness == 3
        assert learner.stats().refused.by_kind == {"unauthorized": 1}
    finally:
        learner.close()
        stranger.close()
        service.stop()


def test_a_request_without_the_actor_token_leaves_a_batch_and_cannot_touch_a_tokened_record():
    core = ReplayCore(ReplayConfig(max_staleness=1, admission=True, wal_dir=None), groups_per_batch=4)
    assert core.tickets(TicketRequest(9, 100), trusted=False).granted == 4  # (eta + 1) * B less one batch
    assert core.tickets(TicketRequest(8, 100), trusted=False).granted == 0
    assert core.tickets(TicketRequest(1, 3)).granted == 3
    assert core.tickets(TicketRequest(2, 100), trusted=False).granted == 0  # 1 left, and it is the run's
    assert core.tickets(TicketRequest(1, 100, outstanding=3)).granted == 1
    # Without the token: nothing for a tokened actor's id, and its record is neither lowered nor voided.
    assert core.tickets(TicketRequest(1, 100, outstanding=0), trusted=False).granted == 0
    core.resume(1, trusted=False)
    assert (core.admission.held(1), core.stats().tickets.voided, core.stats().tickets.anonymous) == (4, 0, 4)
    # With the token, an anonymous id's tickets can be voided, and the id is the run's from its next grant.
    core.resume(9)
    assert (core.stats().tickets.voided, core.admission.held(9)) == (4, 0)
    assert core.tickets(TicketRequest(9, 1)).granted == 1
    assert core.tickets(TicketRequest(9, 100, outstanding=0), trusted=False).granted == 0
    assert core.admission.held(9) == 1
    core.resume(1)  # a tokened actor's record, once empty, is anyone's id again: 7 free, 4 kept
    assert core.tickets(TicketRequest(1, 100), trusted=False).granted == 3
    assert core.admission.held(1) == 3 and 1 not in core.admission.trusted


def test_tickets_expire_once_the_last_batch_they_could_fill_is_served():
    adm = Admission(max_staleness=1, groups_per_batch=4, enabled=True)
    adm.grant(0, 2, 0, learner_version=0, admitted=0, weights_version=0)
    adm.grant(1, 2, 0, learner_version=1, admitted=0, weights_version=1)
    adm.grant(1, 1, 2, learner_version=1, admitted=0, weights_version=0)  # a later grant with an older basis
    adm.grant(1, 1, 3, learner_version=1, admitted=0, weights_version=1)  # and a newer one after it
    adm.grant(1, 1, 4, learner_version=1, admitted=0, weights_version=0)
    assert [basis for basis, _ in adm.in_flight[1]] == [1, 0, 1, 0]
    assert adm.expire(0) == 0  # basis 0 may still fill batch 1 (eta 1)
    assert adm.expire(1) == 4 and adm.expired == 4
    assert (adm.held(0), adm.held(1), adm.in_flight_total, dict(adm.by_version)) == (0, 3, 3, {1: 3})
    assert [list(c) for c in adm.in_flight[1]] == [[1, 2], [1, 1]]
    assert 0 not in adm.in_flight and 0 not in adm.trusted
    assert adm.last_chance(2, bound=1) == 3 and adm.last_chance(1, bound=1) == 0
    # In the replay: serving batch v drops what only batches before v - eta could use, no more.
    core = ReplayCore(ReplayConfig(max_staleness=1, admission=True, wal_dir=None), groups_per_batch=4)
    assert core.tickets(TicketRequest(0, 4, 0, weights_version=0)).granted == 4
    core.ingest([synthetic_group(0, 0, n=2, tokens=3, version=0)])
    assert core.request(BatchRequest(1, 1, 0.0, request_id=1)) is not None
    assert core.stats().tickets.expired == 0  # basis 0's last batch is this one
    assert core.request(BatchRequest(2, 1, 0.0, request_id=2)) is not None
    tickets = core.stats().tickets
    assert (tickets.expired, tickets.in_flight, tickets.capacity) == (3, 0, (1 + 2 + 1) * 4 - 1)


def test_a_group_that_arrives_after_its_ticket_expired_takes_none_of_its_actors_newer_ones():
    core = ReplayCore(ReplayConfig(max_staleness=1, admission=True, wal_dir=None), groups_per_batch=4)
    assert core.tickets(TicketRequest(0, 1, 0, weights_version=0)).granted == 1
    for version in range(3):  # batch 1 was the version-0 ticket's last: at batch 2 it expired
        core.request(BatchRequest(version, 4, 0.0, request_id=version + 1))
    assert core.stats().tickets.expired == 1
    assert core.tickets(TicketRequest(0, 4, 0, weights_version=2)).granted == 4
    core.ingest([synthetic_group(0, 0, n=2, tokens=3, version=0)])  # the slow group, stale on arrival
    assert core.admission.held(0) == 4 and core.admission.last_chance(3, bound=1) == 4
    core.ingest([synthetic_group(0, 1, n=2, tokens=3, version=1)])  # one within eta: it uses a ticket
    assert core.admission.held(0) == 3


def test_the_ticket_counts_add_up_over_several_grants_of_several_versions():
    adm = Admission(max_staleness=4, groups_per_batch=4, enabled=True)
    assert adm.grant(0, 2, 0, learner_version=0, admitted=0, weights_version=0) == 2
    assert adm.grant(0, 3, 2, learner_version=1, admitted=0, weights_version=1) == 3
    assert adm.grant(0, 0, 9, learner_version=1, admitted=0, weights_version=1) == 0  # claims 9 of 5
    assert adm.grant(0, 0, 7, learner_version=1, admitted=0, weights_version=1) == 0
    assert adm.overclaimed == 2
    # It counts one: the four it no longer counts go, newest first, across both grants.
    assert adm.grant(0, 0, 1, learner_version=1, admitted=0, weights_version=1) == 0
    assert [list(c) for c in adm.in_flight[0]] == [[0, 1]] and adm.in_flight_total == 1
    assert adm.grant(1, 2, 0, learner_version=1, admitted=0, weights_version=0, trusted=True) == 2
    assert adm.grant(1, 2, 2, learner_version=2, admitted=0, weights_version=2, trusted=True) == 2
    assert adm.reset(1, trusted=True) == 4 and adm.in_flight_total == 1 and 1 not in adm.in_flight
    for actor in (5, 6):
        assert adm.grant(actor, 3, 0, learner_version=2, admitted=0, weights_version=2, trusted=False) == 3
    assert adm.anonymous_granted == 6
    assert (adm.expire(1), adm.expire(3)) == (1, 6) and adm.expired == 7


def test_anonymous_tickets_granted_under_a_larger_eta_leave_the_runs_actors_a_batch_after_it_falls():
    adm = Admission(max_staleness=4, groups_per_batch=4, enabled=True)
    assert adm.grant(9, 100, 0, learner_version=0, admitted=0, weights_version=0, trusted=False) == 16
    adm.max_staleness = 1  # the learner lowered eta: the limit is (1 + 0 + 1) * 4 = 8, all of it theirs
    assert adm.capacity(0, admitted=0) == 0
    # The run's actors still get what leaves them a batch beside the anonymous share, however much
    # of the limit is left: left = limit - admitted; the anonymous peer counts for at most left - B.
    assert adm.grant(1, 100, 0, learner_version=0, admitted=2, weights_version=0) == 4  # left 6: 6 - 2
    assert adm.grant(1, 100, 4, learner_version=0, admitted=2, weights_version=0) == 0  # it holds its batch
    adm.reset(1, trusted=True)
    assert adm.grant(1, 1, 0, learner_version=0, admitted=3, weights_version=0) == 1
    assert adm.grant(1, 100, 1, learner_version=0, admitted=3, weights_version=0) == 3  # left 5: 5 - 1 - 1
    adm.reset(1, trusted=True)
    assert adm.grant(1, 100, 0, learner_version=0, admitted=4, weights_version=0) == 4  # left = B: no share
    adm.reset(1, trusted=True)
    assert adm.grant(1, 100, 0, learner_version=0, admitted=9, weights_version=0) == 0  # nothing left at all


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["grant", "arrive", "expire", "reset"]), st.integers(0, 3),
                          st.integers(0, 6), st.integers(-1, 6), st.booleans()), max_size=40))
def test_the_ticket_record_adds_up_after_any_sequence(ops):
    """However grants, arrivals, expiries and resets interleave (trusted or not): the totals are the
    sum of the chunks, no chunk or entry is empty, anonymous peers never hold the last batch, and
    no batch waits for their tickets."""
    adm, version, admitted = Admission(max_staleness=1, groups_per_batch=2, enabled=True), 0, 0
    for op, actor, n, weights, trusted in ops:
        if op == "grant":
            granted = adm.grant(actor, n, adm.held(actor) if n % 2 else 0, version, admitted, weights, trusted)
            if granted and not trusted:  # what is left for the run's actors is still a batch
                limit = (adm.max_staleness + Admission.basis(version, weights) + 1) * adm.groups_per_batch
                run_held = sum(adm.held(a) for a in adm.trusted)
                anonymous_held = adm.in_flight_total - run_held
                assert limit - admitted - run_held - anonymous_held >= adm.groups_per_batch
        elif op == "arrive":
            adm.arrived(actor, max(weights, 0))
            admitted += 1
        elif op == "expire":
            version += 1
            adm.expire(version - 1)
        else:
            adm.reset(actor, trusted)
        chunks = [c for a in adm.in_flight.values() for c in a]
        assert all(held > 0 for _, held in chunks) and all(adm.in_flight.values())
        assert adm.in_flight_total == sum(held for _, held in chunks)
        assert adm.by_version == Counter(basis for basis, held in chunks for _ in range(held))
        assert adm.trusted <= set(adm.in_flight)
        for basis in range(-1, 8):  # a batch waits only for the run's actors' tickets of its last chance
            assert adm.last_chance(basis + 1, bound=1) == sum(
                held for a in adm.trusted for b, held in adm.in_flight[a] if b == basis)
