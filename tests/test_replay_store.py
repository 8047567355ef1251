"""The fresh store and the accepted-seq index: order, expiry, reuse, whole groups."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dph_async.replay.dedup import AcceptedSeqs
from dph_async.replay.store import FreshStore
from dph_async.tools.bench.transport import synthetic_group


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


def mixed(seq: int, versions: list[int]):
    """A group whose completions were generated across weight updates: completion i at versions[i]."""
    g = synthetic_group(0, seq, n=len(versions), tokens=3)
    for c, v in zip(g.completions, versions, strict=True):
        c.versions = np.full(3, v, np.int32)
    return g


def test_a_group_of_mixed_versions_expires_and_is_served_by_its_oldest_token():
    """Keyed on its newest version, a group with one old completion would sit behind fresher groups
    and be served beyond eta."""
    store = FreshStore()
    store.add(mixed(0, [5, 5, 3]))  # uniform at 3
    store.add(mixed(1, [0, 9, 9]))  # oldest token 0, newest 9
    assert [e.group.seq for e in store.expire(oldest_version=1)] == [1]
    assert [e.group.seq for e in store.take(2, reuse=False)] == [0]
    store.add(mixed(2, [4, 4]))
    store.add(mixed(3, [8, 2]))
    assert [e.group.seq for e in store.take(2, reuse=False)] == [3, 2]


@settings(max_examples=60, deadline=None)
@given(groups=st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=4), min_size=1, max_size=12),
       bound=st.integers(0, 21), served=st.integers(0, 12))
def test_expiry_and_serving_follow_each_groups_oldest_token(groups, bound, served):
    store = FreshStore()
    for seq, versions in enumerate(groups):
        store.add(mixed(seq, versions))
    order = sorted(range(len(groups)), key=lambda s: (min(groups[s]), s))  # oldest token, then arrival
    taken = [e.group.seq for e in store.take(served, reuse=False)]
    assert taken == order[:served]
    expired = [e.group.seq for e in store.expire(oldest_version=bound)]
    assert expired == [s for s in order[served:] if min(groups[s]) < bound]
    rest = [e.group.seq for e in store.take(len(groups), reuse=False)]
    assert rest == [s for s in order[served:] if min(groups[s]) >= bound]
