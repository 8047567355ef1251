"""The fresh store and the accepted-seq index: order, expiry, reuse, whole groups."""

from __future__ import annotations

import random

from dph_async.app.bench.transport import synthetic_group
from replay.dedup import AcceptedSeqs
from replay.store import FreshStore


def test_oldest_version_first_and_groups_stay_whole():
    store = FreshStore()
    for seq, version in enumerate([3, 1, 2, 1]):
        store.add(synthetic_group(0, seq, n=4, tokens=5, version=version))
    taken = store.take(3, reuse=False)
    assert [e.group.seq for e in taken] == [1, 3, 2]  # version 1 (arrival order), then 2
    assert all(len(e.group.completions) == 4 for e in taken)
    assert store.count("pending") == 3 and store.count("unserved") == 1
    assert store.samples == 16 and store.tokens == 80


def test_expire_drops_only_queued_groups_below_the_bound():
    store = FreshStore()
    for seq, version in enumerate([0, 1, 2, 3]):
        store.add(synthetic_group(0, seq, version=version))
    pending = store.take(1, reuse=False)  # seq 0 (version 0) is with the learner
    expired = store.expire(oldest_version=2)
    assert [e.group.seq for e in expired] == [1]
    assert pending[0].group.group_id in store  # pending groups are never expired
    assert [e.group.seq for e in store.take(5, reuse=False)] == [2, 3]


def test_reuse_counts_and_retires():
    store = FreshStore()
    store.add(synthetic_group(0, 0))
    (entry,) = store.take(1, reuse=True)
    assert not store.release(entry, max_reuse=2)  # used once, may come back
    assert store.take(1, reuse=False) == []  # not unserved any more
    (again,) = store.take(1, reuse=True)
    assert again is entry
    assert store.release(again, max_reuse=2)  # used up
    assert len(store) == 0 and store.samples == 0 and store.cost == 0


def test_claim_moves_a_queued_group_to_pending():
    store = FreshStore()
    store.add(synthetic_group(0, 0))
    store.add(synthetic_group(0, 1))
    store.claim((0, 1))
    assert store.count("pending") == 1
    assert [e.group.seq for e in store.take(5, reuse=True)] == [0]  # the stale heap item is skipped


def test_accepted_seqs_watermark_and_stragglers():
    seqs = AcceptedSeqs()
    order = list(range(200))
    random.Random(0).shuffle(order)
    for i, s in enumerate(order):
        seqs.add((7, s))
        if i == 150:
            watermark, above = seqs.resume_point(7)
            assert all(x in order[: i + 1] for x in range(watermark))
            assert set(above) == set(order[: i + 1]) - set(range(watermark))
    assert seqs.resume_point(7) == (200, [])
    assert (7, 199) in seqs and (7, 200) not in seqs and (8, 0) not in seqs
    seqs.add((8, 5))
    copy = AcceptedSeqs.from_state(seqs.to_state())
    assert copy.resume_point(8) == (0, [5]) and (7, 10) in copy


def test_discarding_an_accepted_seq_reopens_it():
    seqs = AcceptedSeqs()
    for s in range(10):
        seqs.add((0, s))
    seqs.discard((0, 4))
    assert seqs.resume_point(0) == (4, [5, 6, 7, 8, 9]) and (0, 4) not in seqs and (0, 5) in seqs
    seqs.discard((0, 7))
    assert seqs.resume_point(0) == (4, [5, 6, 8, 9])
    seqs.add((0, 4))
    seqs.add((0, 7))
    assert seqs.resume_point(0) == (10, [])
