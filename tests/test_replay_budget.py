"""The store charges each group what it costs held (replay/store.py, resident_cost), so the byte budget
bounds the replay's memory whatever the shape of the groups.

Measured before: 30 groups of 4,096 one-token completions were charged 1.41 MB (their array bytes)
while the replay grew by 363 MB."""

from __future__ import annotations

import gc
import os
import tracemalloc

import msgspec
import numpy as np
import pytest
import zmq

from dph_async.config.replay import ReplayConfig
from dph_async.protocol import decode, encode
from dph_async.replay.core import ReplayCore
from dph_async.replay.store import COMPLETION_OVERHEAD, FreshStore, resident_cost
from dph_async.tools.bench.transport import synthetic_group

MiB = 1 << 20


def replay(budget_mb: float) -> ReplayCore:
    return ReplayCore(ReplayConfig(wal_dir=None, admission=False, max_store_mb=budget_mb), groups_per_batch=4)


def wire(count: int, n: int, tokens: int) -> list[list[bytes]]:
    """`count` groups of one shape as they arrive: separate byte strings."""
    g = synthetic_group(0, 0, n=n, tokens=tokens)
    return [[bytes(f) for f in encode(msgspec.structs.replace(g, seq=seq))] for seq in range(count)]


@pytest.mark.parametrize(("n", "tokens", "count"), [(4096, 1, 2), (1, 1, 400), (64, 100, 12), (1, 20000, 12)],
                         ids=["many_one_token", "one_one_token", "mid", "one_long"])
def test_what_the_store_holds_costs_what_it_is_charged(n, tokens, count):
    """Python's own count of the bytes allocated (tracemalloc) for groups decoded and held is at most
    what they are charged, and not far below it: the budget neither lies nor wastes."""
    frames = wire(count, n, tokens)
    c = replay(1e6)
    gc.collect()
    tracemalloc.start()
    try:
        for f in frames:
            assert c.ingest([decode(f)])[0].status == "ok"
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert 0.6 * c.store.cost <= held <= c.store.cost, (held, c.store.cost)


def test_the_budget_bounds_the_process_under_the_worst_shape():
    """One-token completions, 4,096 to a group, through a socket as the replay receives them: its
    memory grows by the budget and one message in flight (decoded, not yet compacted: ~10 MiB of
    this shape), not by 250 times the array bytes."""
    budget_mb = 12  # three such groups (3.8 MB each held; 16 KiB of arrays)
    frames = wire(6, 4096, 1)
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    tx.bind("tcp://127.0.0.1:*")
    rx.connect(tx.getsockopt(zmq.LAST_ENDPOINT))
    try:
        c = replay(budget_mb)
        gc.collect()
        before = _rss()
        statuses = []
        for f in frames:
            tx.send_multipart(f)
            statuses += [v.status for v in c.ingest([decode(rx.recv_multipart(copy=False))])]
        gc.collect()
        grown = _rss() - before
    finally:
        tx.close(0)
        rx.close(0)
        ctx.term()
    assert "ok" in statuses and "retry" in statuses
    assert c.store.cost <= budget_mb * MiB
    assert grown <= (budget_mb + 12) * MiB, f"grew {grown / MiB:.1f} MiB under a budget of {budget_mb} MiB"


def test_a_held_group_keeps_no_received_buffer_alive():
    """Its arrays are views of one array per field that owns its bytes: the frames it came in (each a
    ZeroMQ message of its own), a log segment or an Arrow table can be freed."""
    g = decode(wire(1, 4, 5)[0])
    store = FreshStore()
    store.add(g)
    for c in g.completions:
        for a in (c.token_ids, c.logprobs, c.versions):
            assert isinstance(a.base, np.ndarray) and a.base.base is None and len(a.base) == 20
    assert g.prompt_ids.base is None
    assert store.cost == resident_cost(g) > g.nbytes + 4 * COMPLETION_OVERHEAD


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
