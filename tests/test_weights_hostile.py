"""Hostile peers of the learner's weight server (learner/publish.py): it accepts two small requests,
and anything else is refused or cut off before it costs memory, counted, and logged within a rate
limit, while honest actors keep fetching (docs/data_plane.md, "Hostile peers")."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import zmq
from test_replay_hostile import ask, closed_within, dealer, flood, peak_rss_mb, port_of
from test_weights import Net, RecordingEngine, assert_bitwise, worker

from dph_async.actors.weight_client import WeightClient
from dph_async.learner import publish
from dph_async.learner.publish import WeightServer
from dph_async.net import NetSecurity
from dph_async.protocol import ErrorReply, TicketRequest, WeightsQuery, WeightsReady, decode, encode

SECURITY = NetSecurity()


@pytest.fixture(params=[True, False], ids=["gate", "no-gate"])
def server(request):
    """The server behind its gate process (the default) and without (net.gate=false)."""
    srv = WeightServer("tcp://127.0.0.1:0", NetSecurity(gate=request.param), bucket_bytes=200, transport="tcp")
    srv.publish(Net(0), version=1)
    yield srv
    srv.close()


def honest_fetch(server: WeightServer) -> None:
    client = WeightClient(server.address, SECURITY, actor_id=0, timeout_s=5.0, transport="tcp")
    try:
        ready = client.newest(0)
        assert ready is not None and ready.version == 1
        assert_bitwise(client.fetch(ready), Net(0))
    finally:
        client.close()


def test_the_gate_load_counts_each_actor_fetching_buckets(server):
    honest_fetch(server)
    honest_fetch(server)  # a second connection: another peer to the gate
    manifest = ask(dealer(server.address), encode(WeightsQuery(0, -1)))
    largest = max(b.nbytes for b in manifest.buckets)
    if server.gated:
        assert server.gate_load.peers == 2 and server.gate_load.largest == largest
        assert server.gate_load.needed_bytes == (2 * 2 + 4) * largest
    else:
        assert server.gate_load.peers == 0  # no gate, nothing it could hold


def test_only_the_two_requests_it_serves_are_read(server):
    sock = dealer(server.address)
    assert isinstance(ask(sock, encode(WeightsQuery(0, -1))), WeightsReady)
    # Another service's message, an array frame, frames past the count: refused, nothing built.
    reply = ask(sock, encode(TicketRequest(0, 4, 0)))
    assert isinstance(reply, ErrorReply) and reply.kind == "type"
    head = msgpack.unpackb(encode(WeightsQuery(0, -1))[0])
    head["n"] = 1
    reply = ask(sock, [msgpack.packb(head), b"\0" * 8])
    assert reply.kind == "frames" and "header announces 1 array frames (allowed: 0 to 0)" in reply.error
    reply = ask(sock, [encode(WeightsQuery(0, -1))[0], *([b"\0" * 4000] * 50)])
    assert reply.kind == "frames" and "more array frames than the 0 its header announces" in reply.error
    # A header of a thousand empty maps, under the frame cap: refused by its schema, not built.
    head["n"], head["m"] = 0, [{}] * 1000
    reply = ask(sock, [msgpack.packb(head)])
    assert reply.kind == "field"
    assert server.refused == {"type": 1, "frames": 2, "field": 1}
    honest_fetch(server)


def test_a_frame_larger_than_a_request_cuts_the_peer_off_before_it_is_buffered(server):
    sock = dealer(server.address, timeout_ms=1000)
    sock.send_multipart([b"\0" * (64 << 20)])  # 64 MiB: it used to be read whole, then parsed
    with pytest.raises(zmq.Again):
        sock.recv_multipart()
    sock.close()
    honest_fetch(server)


def test_garbage_gets_one_error_each_and_the_log_is_rate_limited(server, caplog):
    sock = dealer(server.address)
    junk = [[b"\xc1"], [b"\x92\x01"], [msgpack.packb({"v": 3, "t": "Nope", "n": 0, "m": {}})]]
    replies = []
    with caplog.at_level(logging.WARNING, logger="dph_async.learner.publish"):
        # A few at a time: past REPLIES_PER_PEER unread replies the server's gate drops the rest, by
        # design (an honest actor has one request out).
        k = publish.REPLIES_PER_PEER
        for burst in range(100 // k):
            for i in range(k):
                sock.send_multipart(junk[(k * burst + i) % len(junk)])
            replies += [decode(sock.recv_multipart()) for _ in range(k)]
    assert all(isinstance(r, ErrorReply) and r.kind for r in replies)
    assert sum(server.refused.values()) == 100
    logged = [r for r in caplog.records if "weight server: refused a message" in r.getMessage()]
    assert len(logged) == publish.REFUSALS_LOGGED_PER_MIN
    honest_fetch(server)


def test_a_push_to_a_subscriber_that_left_is_counted_as_dropped(server):
    sock = dealer(server.address)
    assert isinstance(ask(sock, encode(WeightsQuery(0, -1))), WeightsReady)  # it now gets new versions pushed
    sock.close()
    assert server.replies_dropped == 0
    # A push sent before the disconnect reached the server (or its gate) goes out on the closing
    # connection; one sent after is dropped. New versions until one is, each waited on.
    version, deadline = 1, time.monotonic() + 30
    while server.replies_dropped == 0:
        assert time.monotonic() < deadline, "no push to the peer that left was counted as dropped"
        version += 1
        server.publish(Net(version), version=version)
        pushed = time.monotonic() + 2
        while server.replies_dropped == 0 and time.monotonic() < pushed:
            time.sleep(0.02)
    assert server.replies_dropped == 1  # that push alone: the peer is gone, not every reply
    reply = ask(dealer(server.address), encode(WeightsQuery(0, -1)))
    assert isinstance(reply, WeightsReady) and reply.version == version


def test_a_peer_that_never_finishes_its_handshake_is_cut_off(monkeypatch):
    monkeypatch.setattr(publish, "PEER_TIMEOUT_S", 0.5)
    srv = WeightServer("tcp://127.0.0.1:0", SECURITY, bucket_bytes=200, transport="tcp")
    try:
        conn = socket.create_connection(("127.0.0.1", port_of(srv.address)))
        conn.sendall(b"\xff\0\0\0\0\0\0\0\x01")  # the start of a ZMTP greeting, then silence
        assert closed_within(conn, 5), "a stalled handshake was kept open"
        conn.close()
    finally:
        srv.close()


def ask_again(address: str, frames: list, seconds: float):
    """The reply to `frames`, sent again on a new connection each time none comes within 2 s, as an
    honest actor does: a gate that a flood ended takes unread requests with it."""
    deadline = time.monotonic() + seconds
    while True:
        sock = dealer(address, timeout_ms=2000)
        try:
            return ask(sock, frames)
        except zmq.Again:
            if time.monotonic() > deadline:
                raise
        finally:
            sock.close()


def test_an_actor_whose_request_a_dying_gate_took_keeps_its_weights_and_loads_from_the_next():
    """A request the gate read and never passed on (a flood ended it) times out: the actor counts the
    failure and keeps generating with the weights it has, and its next pass, on a new connection,
    loads from the gate started in its place. It used to end the actor."""
    srv = WeightServer("tcp://127.0.0.1:0", SECURITY, bucket_bytes=200, transport="tcp")
    try:
        srv.publish(Net(1), version=1)
        client = WeightClient(srv.address, SECURITY, actor_id=0, timeout_s=5.0, transport="tcp")
        engine = RecordingEngine()
        actor = worker(client, engine)
        gate = srv._gate.pid
        os.kill(gate, signal.SIGSTOP)  # it reads nothing more, then dies with what it holds
        actor.update_weights()
        assert engine.loaded == [] and actor.stats.weight_fetch_failures == 1
        os.kill(gate, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not engine.loaded and time.monotonic() < deadline:
            actor.update_weights()
        assert [v for v, _ in engine.loaded] == [1] and srv._gate.pid != gate
        assert_bitwise(engine.loaded[0][1], Net(1))
        client.close()
    finally:
        srv.close()


SERVE = """
import sys, time
from dph_async.net import NetSecurity
from dph_async.learner.publish import WeightServer
srv = WeightServer("tcp://127.0.0.1:0", NetSecurity(gate=sys.argv[1] == "on", gate_memory_mb=16), 200, "tcp")
print(srv.address, flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("gate", ["on", "off"])
def test_a_request_of_many_frames_grows_the_gate_not_the_learner(gate):
    """30,000 frames of 4 kB (each under the 4 KiB cap) in one message: without a gate the learner's
    process holds them all until the last (the control case), with one the gate does, within its
    memory limit, and the learner's peak memory does not move."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE, gate], stdout=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().strip()
        assert address, "the weight server did not start"
        sock = dealer(address)
        assert ask(sock, encode(WeightsQuery(0, -1))).kind == "unavailable"  # nothing published: an answer
        before = peak_rss_mb(proc.pid)
        flood(address, 30_000, 4000)
        assert ask_again(address, encode(WeightsQuery(0, -1)), 30).kind == "unavailable"  # still answering
        grown = peak_rss_mb(proc.pid) - before
        if gate == "on":
            assert grown < 20, f"the learner's peak memory rose {grown:.0f} MB behind its gate"
        else:
            assert grown > 80, f"the flood did not reach the server without a gate (peak +{grown:.0f} MB)"
    finally:
        proc.kill()
        proc.wait()


def test_a_gate_too_small_for_a_bucket_is_refused_at_start():
    with pytest.raises(ValueError, match=r"net\.gate_memory_mb \(16\) must be at least twice learner\.weight_bucket"):
        WeightServer("tcp://127.0.0.1:0", NetSecurity(gate_memory_mb=16), bucket_bytes=32 << 20, transport="tcp")
