"""Staleness, admission and the core at their boundaries: exact fits, one past, and inputs that change
from step to step (the rest of the suite mostly uses constant inputs far from any boundary)."""

from __future__ import annotations

import pytest

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import BatchRequest, TicketRequest
from dph_async.replay.core import ReplayCore
from dph_async.replay.staleness import Admission, staleness
from dph_async.replay.store import resident_cost
from dph_async.tools.bench.transport import synthetic_group

MiB = 1 << 20


def core(b: int = 4, **cfg) -> ReplayCore:
    return ReplayCore(ReplayConfig(**({"wal_dir": None, "admission": True, "max_staleness": 1} | cfg)),
                      groups_per_batch=b)


def test_staleness_counts_from_the_oldest_token_and_never_goes_negative():
    assert [staleness(5, m) for m in (3, 4, 5, 6, 9)] == [2, 1, 0, 0, 0]


def test_capacity_is_exactly_eta_plus_version_plus_one_batches_and_moves_with_each_input():
    """(eta + v + 1) * B with eta = 1, B = 4: 8 tickets at version 0, 4 more per version; the basis is
    the older of the learner's and the actor's weights version."""
    a = Admission(max_staleness=1, groups_per_batch=4, enabled=True)
    steps = [  # (learner version, weights version, admitted, capacity before the grant)
        (0, -1, 0, 8), (0, 0, 0, 7), (1, -1, 1, 9), (1, 0, 1, 4), (2, 2, 4, 8), (2, 1, 4, 3), (3, 5, 16, 0),
    ]  # each grant before it also holds one ticket in flight
    for v, w, admitted, expected in steps:
        assert a.capacity(v, admitted, w) == expected, (v, w, admitted)
        assert a.grant(9, 1, a.held(9), v, admitted, w) == min(1, expected)  # one ticket, if one fits


def test_a_grant_fills_the_capacity_exactly_and_not_one_past_it():
    a = Admission(max_staleness=2, groups_per_batch=3, enabled=True)  # 9 at version 0
    assert a.grant(0, 8, 0, 0, 0, -1) == 8
    assert a.grant(1, 5, 0, 0, 0, -1) == 1  # the ninth
    assert a.grant(2, 1, 0, 0, 0, -1) == 0
    assert a.grant(2, 5, 0, 1, 0, -1) == 3  # version 1: three more


def test_an_actors_count_lowers_the_record_only_below_what_it_holds():
    a = Admission(max_staleness=1, groups_per_batch=4, enabled=True)
    assert a.grant(0, 3, 0, 0, 0, -1) == 3
    a.grant(0, 0, 3, 0, 0, -1)  # exactly what it holds: nothing changes, no overclaim
    assert (a.held(0), a.overclaimed) == (3, 0)
    a.grant(0, 0, 4, 0, 0, -1)  # one past: ignored, counted
    assert (a.held(0), a.overclaimed) == (3, 1)
    a.grant(0, 0, 2, 0, 0, -1)  # one below: one given back
    assert (a.held(0), a.in_flight_total) == (2, 2)


def test_a_group_uses_the_ticket_whose_basis_equals_its_oldest_token():
    a = Admission(max_staleness=1, groups_per_batch=4, enabled=True)
    a.grant(0, 1, 0, 2, 0, -1)  # basis 2
    a.grant(0, 1, 1, 3, 0, -1)  # basis 3
    a.arrived(0, min_version=3)  # basis 3 <= 3: its own ticket, not the older one
    assert dict(a.by_version) == {2: 1}
    a.grant(0, 1, 1, 4, 0, -1)  # basis 4
    a.arrived(0, min_version=3)  # basis 4 > 3: the newest that fits is basis 2
    assert dict(a.by_version) == {4: 1}


def test_last_chance_counts_exactly_the_tickets_of_basis_v_minus_the_bound():
    a = Admission(max_staleness=2, groups_per_batch=4, enabled=True)
    for basis, n in ((0, 1), (1, 2), (2, 3)):
        a.grant(basis, n, 0, basis, 0, -1)
    assert [a.last_chance(v, bound=2) for v in range(1, 6)] == [0, 1, 2, 3, 0]
    assert [a.last_chance(3, bound=b) for b in range(4)] == [0, 3, 2, 1]


@pytest.mark.parametrize("eta", [0, 2])
def test_a_group_is_served_at_staleness_eta_and_dropped_one_version_later(eta):
    """The learner's version moves by a different step each time; each group is checked at its edge."""
    c = core(admission=False, max_staleness=eta)
    version, request = 0, 0
    for step, jump in enumerate([1, 3, 2, 1, 4]):
        request += 1
        c.request(BatchRequest(version, 0, 0.0, request_id=request))  # the learner moved on to `version`
        at_edge, past_edge = (synthetic_group(0, 2 * step + i, n=2, tokens=3, version=version) for i in (0, 1))
        c.ingest([at_edge])
        request += 1
        assert c.request(BatchRequest(version + eta, 1, 0.0, request_id=request)).groups[0].seq == at_edge.seq
        c.ingest([past_edge])
        request += 1
        batch = c.request(BatchRequest(version + eta + 1, 1, 0.0, request_id=request))
        assert batch.groups == [] and batch.drops == {"stale": 1}
        version += eta + 1 + jump


def test_the_store_takes_a_group_that_fills_its_budget_exactly_and_defers_one_byte_more():
    g, h = synthetic_group(0, 0, n=3, tokens=5), synthetic_group(0, 1, n=3, tokens=5)
    cost = resident_cost(g)
    assert [v.status for v in core(admission=False, max_store_mb=cost / MiB).ingest([g])] == ["ok"]
    assert [v.status for v in core(admission=False, max_store_mb=(cost - 1) / MiB).ingest([h])] == ["retry"]


def test_ticketless_groups_fill_their_budget_exactly_and_not_one_past():
    g = [synthetic_group(7, seq, n=2, tokens=4) for seq in range(4)]
    cost = resident_cost(g[0])
    by_count = core(max_ticketless=2)
    assert [v.status for v in by_count.ingest(g[:3])] == ["ok", "ok", "retry"]
    by_bytes = core(max_ticketless=4, max_ticketless_mb=2 * cost / MiB)
    assert [v.status for v in by_bytes.ingest(g)] == ["ok", "ok", "retry", "retry"]


def test_a_batch_waits_while_its_last_chance_groups_exactly_fit_and_not_when_one_past():
    """Batch v waits for groups granted at v - eta only while those here and those coming fit in it."""
    def replay(old_here: int) -> tuple[ReplayCore, BatchRequest]:
        c = core(b=2)
        assert c.tickets(TicketRequest(0, old_here + 1, 0, weights_version=0)).granted == old_here + 1
        c.ingest([synthetic_group(0, s, n=2, tokens=3, version=0) for s in range(old_here)])
        c.version = 1
        assert c.tickets(TicketRequest(1, 2, 0, weights_version=1)).granted == 2
        c.ingest([synthetic_group(1, s, n=2, tokens=3, version=1) for s in range(2)])
        return c, BatchRequest(1, 2, 5.0, request_id=1)

    fits, req = replay(old_here=1)  # one here + one coming = 2: the batch waits for it
    assert fits.request(req) is None
    past, req = replay(old_here=2)  # two here + one coming = 3 > 2: it could not fit, serve now
    assert [g.min_version for g in past.request(req).groups] == [0, 0]
