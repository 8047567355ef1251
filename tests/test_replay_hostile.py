"""Hostile peers of the replay service: each attack is refused (or cut off), counted, and the service
keeps serving the honest peers and loses nothing it accepted (docs/data_plane.md, "Hostile peers")."""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import zmq

from dph_async.config.replay import ReplayConfig
from dph_async.net import ACTOR_TOKEN_FILE, NetSecurity, connect, control_token, generate_keys
from dph_async.protocol import (
    MAX_COUNT,
    Ack,
    BatchRequest,
    Control,
    ControlReply,
    ErrorReply,
    ResumeInfo,
    ResumeRequest,
    Stats,
    StatsRequest,
    TicketGrant,
    TicketRequest,
    decode,
    encode,
)
from dph_async.replay.service import ReplayService
from dph_async.replay_client import ReplayClient, RolloutSender
from dph_async.tools.bench.transport import synthetic_group

CFG = ReplayConfig(
    max_staleness=1, admission=True, max_group_mb=0.25, max_header_kb=64, max_frames=64,
    max_parked=8, max_parked_per_peer=2, refusal_log_per_min=3, peer_timeout_s=0.5,
)  # fmt: skip
B = 4  # groups per batch: capacity (eta + 1) * B = 8 tickets


@pytest.fixture(params=[True, False], ids=["gate", "no-gate"])
def service(tmp_path, request):
    """The replay behind its gate process (the default) and without (net.gate=false): every
    refusal below holds either way (net.gate)."""
    svc = ReplayService(CFG, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", B, wal_dir=str(tmp_path / "wal"),
                        data_dir=str(tmp_path), security=NetSecurity(gate=request.param))  # as `serve replay`
    svc.start_in_thread()
    yield svc
    svc.stop()


def dealer(addr: str, timeout_ms: int = 5000) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(addr)
    return sock


def ask(sock: zmq.Socket, frames: list):
    sock.send_multipart(frames)
    return decode(sock.recv_multipart())


def stats_within(svc: ReplayService, seconds: float):
    """The service's stats over its socket, or fail if it does not answer in time (it is stuck)."""
    client = ReplayClient(svc.batch_endpoint, request_timeout_s=seconds, reply_timeout_s=seconds)
    try:
        return client.stats()
    finally:
        client.close()


def honest_round_trip(svc: ReplayService, seq: int) -> None:
    """An honest actor still gets a group accepted, and the learner still gets it in a batch."""
    sender = RolloutSender(svc.ingest_endpoint, 7, token=svc.actor_token)
    sender.send(synthetic_group(7, seq, n=2, tokens=8))
    assert sender.flush(10) and sender.accepted == 1
    sender.close()


# ------------------------------------------------------------------------------- bytes before parsing


def test_an_inflated_header_is_refused_by_its_size_before_it_is_parsed(service):
    sock = dealer(service.ingest_endpoint)
    # 200 kB of empty maps (under the frame cap, over the header's): 200k dicts if it were parsed.
    bomb = msgpack.packb({"v": 3, "t": "RolloutGroup", "n": 0, "m": [{}] * 200_000})
    t0 = time.monotonic()
    reply = ask(sock, [bomb])
    assert isinstance(reply, Ack) and reply.status == "error"
    assert f"header of {len(bomb)} bytes exceeds the limit of {64 * 1024}" in reply.error
    assert time.monotonic() - t0 < 2
    # Under the byte limit, a container past its length limit is refused from its length prefix.
    good = encode(synthetic_group(0, 0, n=1, tokens=4))
    head = msgpack.unpackb(good[0])
    head["m"]["completions"] = [{}] * 5000
    reply = ask(sock, [msgpack.packb(head), *good[1:]])
    assert reply.status == "error" and "RolloutGroup.completions: Expected `array` of length <= 4096" in reply.error
    assert stats_within(service, 5).refused.by_kind == {"size": 1, "field": 1}
    honest_round_trip(service, 0)


def test_frames_past_the_count_or_the_bytes_the_header_allows_are_refused(service):
    sock = dealer(service.ingest_endpoint)
    frames = encode(synthetic_group(0, 0, n=2, tokens=8))  # 7 array frames announced
    reply = ask(sock, [*frames, *([b"\0" * 32] * 20)])
    assert reply.status == "error" and "more array frames than the 7 its header announces" in reply.error
    # Many frames, each under the cap, together past it: refused without being held whole.
    head = msgpack.unpackb(frames[0])
    head["n"] = 40
    chunk = b"\0" * (16 << 10)
    reply = ask(sock, [msgpack.packb(head), *([chunk] * 40)])
    limit = int(0.25 * 2**20)
    assert reply.status == "error" and f"more than {limit} bytes (its limit) across its frames" in reply.error
    assert "replay.max_group_mb" in reply.error  # an honest actor is told which setting holds it
    head["n"] = 65
    reply = ask(sock, [msgpack.packb(head)])
    assert reply.status == "error" and "header announces 65 array frames (allowed: 0 to 64)" in reply.error
    # One frame past the whole message's cap: libzmq drops the connection before buffering the frame.
    sock.setsockopt(zmq.RCVTIMEO, 1000)
    sock.send_multipart([frames[0], b"\0" * (1 << 20)])
    with pytest.raises(zmq.Again):
        sock.recv_multipart()
    assert stats_within(service, 5).refused.by_kind == {"frames": 2, "size": 1}
    honest_round_trip(service, 0)


def test_garbage_msgpack_gets_one_error_each_and_the_log_is_rate_limited(service, caplog):
    sock = dealer(service.ingest_endpoint)
    junk = [[b"\xc1"], [b"\x92\x01"], [msgpack.packb({"v": 3, "t": "RolloutGroup", "n": 0, "m": [1, 2]})],
            [msgpack.packb({"v": 3, "t": "Nope", "n": 0, "m": {}})], [msgpack.packb({"v": 3})]]
    with caplog.at_level(logging.WARNING, logger="dph_async.replay.service"):
        for i in range(200):
            sock.send_multipart(junk[i % len(junk)])
        replies = [decode(sock.recv_multipart()) for _ in range(200)]
    assert all(isinstance(r, Ack) and r.status == "error" and r.error.startswith("message refused") for r in replies)
    refused = stats_within(service, 5).refused
    assert sum(refused.by_kind.values()) == 200 and refused.logged == 3 and refused.unlogged == 197
    assert len([r for r in caplog.records if "refused a message" in r.getMessage()]) == 3
    honest_round_trip(service, 0)


# ------------------------------------------------------------------------------- authority


def near_miss(token: bytes) -> bytes:
    """The token with its last byte changed: wrong by one byte whatever that byte was."""
    return token[:-1] + bytes([token[-1] ^ 1])


@pytest.mark.parametrize("actor_token", [b"", b"short", "ab" * 32, "same"], ids=["empty", "short", "str", "control"])
def test_a_token_anyone_has_or_the_service_cannot_compare_is_refused(actor_token):
    """Before: actor_token=b"" trusted every request without a token (all of them the run's, the
    batch kept for the actors open to anyone); a str one killed the service's thread at the first
    ticket request; one equal to the control token let actors take batches and shut the replay down."""
    control = b"c" * 32
    with pytest.raises(ValueError, match="control token" if actor_token == "same" else "actor_token must be bytes"):
        ReplayService(CFG, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", B, wal_dir=None, control_token=control,
                      actor_token=control if actor_token == "same" else actor_token)


def test_the_actor_token_files_text_is_the_token():
    """`serve replay` keeps the actor token in hex (actor.token); a user's actor passing the file's
    text was anonymous, and at eta 0 (all the capacity is the batch kept for the run's actors)
    granted nothing, ever: a run of such actors never made its first batch."""
    service = ReplayService(ReplayConfig(max_staleness=0), "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", B,
                            wal_dir=None, security=NetSecurity(gate=False))
    service.start_in_thread()
    try:
        sock = dealer(service.ingest_endpoint)
        assert ask(sock, encode(TicketRequest(7, want=B))).granted == 0  # anonymous: nothing at eta 0
        text = service.actor_token.hex().encode() + b"\n"  # as `open(path, "rb").read()` after an editor
        assert ask(sock, encode(TicketRequest(8, want=1, token=text))).granted == 1
        # As `Path.read_text()` gives it. Before: refused by the decoder, waited out request_timeout_s.
        sender = RolloutSender(service.ingest_endpoint, 9, token=text.decode(), request_timeout_s=5)
        assert sender.tickets(1) == 1
        sender.close()
        sock.close(0)
    finally:
        service.stop()


def test_anonymous_tickets_granted_under_a_larger_eta_leave_the_runs_actors_a_batch():
    """replay.max_staleness=auto: an anonymous peer took what eta 4 left it (16 tickets at version 0),
    then the learner lowered eta to 1. Before: the capacity (8) was all the peer's, the run's actors
    were granted nothing, and the learner waited at version 0 for ever, since the peer's tickets
    expire only once a later batch is served."""
    cfg = ReplayConfig(max_staleness="auto", staleness_min=1, staleness_max=8)
    service = ReplayService(cfg, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", B, wal_dir=None,
                            security=NetSecurity(gate=False))
    service.start_in_thread()
    client = service.local_client()
    sender = RolloutSender(service.ingest_endpoint, 1, token=service.actor_token)
    try:
        client.set_staleness(4)
        sock = dealer(service.ingest_endpoint)
        assert ask(sock, encode(TicketRequest(424242, want=1000))).granted == (4 + 1) * B - B
        client.set_staleness(1)
        for version in range(2):
            assert sender.tickets(1000, weights_version=version) == B
            for seq in range(B):
                sender.send(synthetic_group(1, version * B + seq, n=2, tokens=8, version=version))
            assert sender.flush(10)
            assert len(client.get_batch(version, B, wait_s=5.0).groups) == B
        sock.close(0)
    finally:
        sender.close()
        client.close()
        service.stop()


def test_state_changes_need_the_control_token(service, tmp_path):
    honest_round_trip(service, 0)
    sock = dealer(service.batch_endpoint)
    outside = tmp_path.parent / f"outside-{tmp_path.name}"
    for token in (b"", b"x" * 32, near_miss(service.control_token)):
        for msg in (Control("snapshot", "snap", 10**9, token), Control("shutdown", token=token),
                    Control("restore", "snap", token=token), Control("set_staleness", token=token, max_staleness=0),
                    BatchRequest(0, 4, 0.0, 1, token)):
            reply = ask(sock, encode(msg))
            assert isinstance(reply, ErrorReply) and reply.kind == "unauthorized", msg
    assert not (tmp_path / "snap").exists()
    # Even the control identity names no path outside the data directory.
    for name in (str(outside), f"../{outside.name}", f"a/../../{outside.name}", "wal/x", ""):
        reply = ask(sock, encode(Control("snapshot", name, 3, service.control_token)))
        assert isinstance(reply, ControlReply) and not reply.ok and "refused" in reply.detail, name
    assert not outside.exists()
    # Nothing changed: the version did not move, the service still runs, the group is still there.
    stats = stats_within(service, 5)
    assert stats.version == 0 and stats.refused.by_kind == {"unauthorized": 15, "path": 5}
    reply = ask(sock, encode(BatchRequest(0, 4, 0.0, 2, service.control_token)))
    assert [g.group_id for g in reply.groups] == [(7, 0)]
    reply = ask(sock, encode(Control("snapshot", "ckpt/v0", 0, service.control_token)))
    assert reply.ok and (tmp_path / "ckpt" / "v0").is_dir()
    # The ingest endpoint serves no learner message at all.
    reply = ask(dealer(service.ingest_endpoint), encode(Control("shutdown", token=service.control_token)))
    assert isinstance(reply, Ack) and "Control is not served on this endpoint" in reply.error



def test_a_snapshot_name_with_a_nul_byte_is_refused_and_the_replay_keeps_serving(service):
    """Before: os.path.realpath raised ValueError ("embedded null byte") out of the service loop, and
    one Control from the learner's side ended `serve replay`."""
    sock = dealer(service.batch_endpoint)
    for command in ("snapshot", "restore"):
        reply = ask(sock, encode(Control(command, "snap\0x", 0, service.control_token)))
        assert isinstance(reply, ControlReply) and not reply.ok and "NUL byte" in reply.detail, reply
    assert stats_within(service, 5).refused.by_kind == {"path": 2}
    honest_round_trip(service, 0)

def ask_until(sock, done, seconds: float = 10.0):
    """Ask for the stats until the reply is `done` (the service has taken in a change), or fail."""
    deadline = time.monotonic() + seconds
    while not done(reply := ask(sock, encode(StatsRequest()))):
        assert time.monotonic() < deadline, f"still {reply!r} after {seconds:.0f} s"
        time.sleep(0.1)
    return reply


@pytest.mark.slow
def test_with_curve_only_the_control_key_commands_and_keys_reload_without_restart(tmp_path):
    keys = generate_keys(tmp_path / "keys")
    svc = ReplayService(CFG, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", B, security=NetSecurity(curve_keys=keys),
                        data_dir=str(tmp_path / "data"))
    svc.start_in_thread()
    try:
        actor = NetSecurity(curve_keys=keys)  # the actors' client key pair
        # An actor with the token still is not the control identity: with CURVE the key decides.
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        connect(sock, svc.batch_endpoint, actor, "client")
        reply = ask(sock, encode(Control("shutdown", token=svc.control_token)))
        assert isinstance(reply, ErrorReply) and reply.kind == "unauthorized"
        learner = ReplayClient(svc.batch_endpoint, actor, request_timeout_s=10)  # connects as "control"
        assert learner.get_batch(0, 1, 0.0).groups == []
        # Revoke the actors' key: its open connection is refused from the next message after the
        # service reads the key directory again (at most once a second), without a restart.
        (keys / "authorized" / "client.key").unlink()
        reply = ask_until(sock, lambda r: isinstance(r, ErrorReply))
        assert reply.kind == "unauthorized"
        # And authorize it again: accepted, no restart.
        (keys / "authorized" / "client.key").write_bytes((keys / "client.key").read_bytes())
        ask_until(sock, lambda r: isinstance(r, Stats))
        learner.close()
        sock.close()
    finally:
        svc.stop()


# ------------------------------------------------------------------------------- admission


def test_a_peer_cannot_claim_away_the_capacity_of_the_others(service):
    sock = dealer(service.ingest_endpoint)
    reply = ask(sock, encode(TicketRequest(999999, want=0, outstanding=MAX_COUNT)))
    assert isinstance(reply, TicketGrant) and reply.granted == 0
    sender = RolloutSender(service.ingest_endpoint, 1, token=service.actor_token)
    assert sender.tickets(8, wait_s=0.0) == 8  # the whole capacity, (eta + 1) * B, is still there
    tickets = stats_within(service, 5).tickets
    assert tickets.overclaimed == 1 and tickets.in_flight == 8 and tickets.capacity == 0
    sender.close()


def test_a_peer_without_the_actor_token_cannot_starve_the_runs_actors(service):
    """Before the actor token, one TicketRequest(actor_id=424242, want=1000) from a loopback client
    took every ticket and held a live run at its version for minutes. Now an anonymous peer is granted
    only what leaves one batch for the run's actors, cannot void or lower their record, and what it
    took and never used expires once its last batch is served."""
    sock = dealer(service.ingest_endpoint)
    hoard = ask(sock, encode(TicketRequest(424242, want=1000)))
    assert isinstance(hoard, TicketGrant) and hoard.granted == (CFG.max_staleness + 1) * B - B
    assert ask(sock, encode(TicketRequest(424243, want=1000))).granted == 0  # another made-up id: no more
    sender = RolloutSender(service.ingest_endpoint, 1, token=service.actor_token)
    assert sender.tickets(1000, wait_s=0.0) == B  # the batch kept for the run's own actors
    # Without the token, the honest actor's record can be neither voided nor lowered nor added to.
    assert isinstance(ask(sock, encode(ResumeRequest(1))), ResumeInfo)
    assert ask(sock, encode(TicketRequest(1, want=1000, outstanding=0))).granted == 0
    tickets = stats_within(service, 5).tickets
    assert (tickets.in_flight, tickets.anonymous, tickets.voided, tickets.capacity) == (8, 4, 0, 0)
    # The learner moves on with the run's actors: at version 1 (its request waiting for groups) B more
    # tickets are free, all of them the run's actors' (an anonymous peer is granted none of the last B).
    client = service.local_client()
    try:
        for version in range(3):
            served: list = []
            ask_batch = lambda v=version, out=served: out.append(client.get_batch(v, B, wait_s=10.0))  # noqa: E731
            batch = threading.Thread(target=ask_batch)
            batch.start()
            ask_until(sock, lambda r, v=version: r.replay.version == v)
            if version == 1:
                assert ask(sock, encode(TicketRequest(424244, want=1000))).granted == 0
                assert sender.tickets(1000, wait_s=0.0) == B
            elif version == 2:
                # The hoard's basis was version 0, its last batch version 1 (eta 1): it expired, and
                # what frees up is again shared so that the run's actors keep a batch.
                tickets = stats_within(service, 5).tickets
                assert (tickets.expired, tickets.in_flight, tickets.capacity) == (4, 0, 8)
                assert ask(sock, encode(TicketRequest(424245, want=1000))).granted == 4
                assert sender.tickets(1000, wait_s=0.0) == B
            for seq in range(B):
                sender.send(synthetic_group(1, version * B + seq, n=2, tokens=8, version=version))
            assert sender.flush(10)
            batch.join(15)
            # Not held for the anonymous peer's tickets of its last chance (eta 1: the batch of
            # version 1 is theirs), which would cost the batch's whole deadline every version.
            assert len(served[0].groups) == B and served[0].waited_s < 5.0
    finally:
        client.close()
        sender.close()
        sock.close()


def test_integers_past_their_bounds_are_refused_and_the_replay_keeps_serving(tmp_path):
    """Before the bounds, under replay.admission=false, TicketRequest(want=2**64 - 1) was granted and
    the next Stats could not be encoded; a group with sampling.top_k = 2**64 - 1 was acknowledged and
    the next snapshot, and every restart, died storing it."""
    cfg = CFG.model_copy(update={"admission": False})
    svc = ReplayService(cfg, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", B, wal_dir=str(tmp_path / "wal"),
                        data_dir=str(tmp_path), security=NetSecurity(gate=False))
    svc.start_in_thread()
    try:
        sock = dealer(svc.ingest_endpoint)
        head = msgpack.unpackb(encode(TicketRequest(1, 1))[0])
        head["m"]["want"] = 2**64 - 1
        reply = ask(sock, [msgpack.packb(head)])
        assert isinstance(reply, Ack) and reply.status == "error" and "want 18446744073709551615 outside" in reply.error
        group = synthetic_group(1, 0, n=2, tokens=4)
        head, *arrays = encode(group)
        head = msgpack.unpackb(head)
        head["m"]["sampling"]["top_k"] = 2**64 - 1
        reply = ask(sock, [msgpack.packb(head), *arrays])
        assert isinstance(reply, Ack) and reply.status == "error" and reply.error.startswith("sampling: ")
        sock.close()
        assert stats_within(svc, 5).refused.by_kind == {"value": 1, "invalid_sampling": 1}
        client = svc.local_client()
        assert "snapshot" in client.snapshot(tmp_path / "snap", 0)
        client.close()
        honest_round_trip(svc, 0)
    finally:
        svc.stop()


def test_parked_ticket_requests_are_bounded_per_connection(service):
    sender = RolloutSender(service.ingest_endpoint, 1, token=service.actor_token)
    assert sender.tickets(8, wait_s=0.0) == 8  # no capacity left: requests that wait get parked
    sock = dealer(service.ingest_endpoint)
    n = 2000
    t0 = time.monotonic()
    for actor in range(n):
        sock.send_multipart(encode(TicketRequest(10 + actor, want=1, wait_s=3600.0)))
    # All but max_parked_per_peer are answered at once (nothing granted), not held for an hour.
    replies = [decode(sock.recv_multipart()) for _ in range(n - CFG.max_parked_per_peer)]
    assert all(isinstance(r, TicketGrant) and r.granted == 0 for r in replies)
    assert time.monotonic() - t0 < 30
    stats = stats_within(service, 2)  # and the service answers others promptly meanwhile
    assert stats.tickets.parked == CFG.max_parked_per_peer
    honest_round_trip(service, 0)
    sender.close()


def test_an_answer_to_a_peer_that_left_is_counted_as_dropped(service):
    """A parked ticket request is answered when its wait ends; by then its peer has gone. With a gate
    the answer is lost there, and the gate's count reaches the replay's stats as the ROUTER's does."""
    sender = RolloutSender(service.ingest_endpoint, 1, token=service.actor_token)
    assert sender.tickets(8, wait_s=0.0) == 8  # no capacity left: a request that waits gets parked
    sock = dealer(service.ingest_endpoint)
    sock.send_multipart(encode(TicketRequest(7, want=1, wait_s=1.0)))
    deadline = time.monotonic() + 5
    while stats_within(service, 2).tickets.parked != 1:
        assert time.monotonic() < deadline, "the request was not parked"
    sock.close()  # gone before its answer
    deadline = time.monotonic() + 10
    while (dropped := stats_within(service, 2).replies_dropped) != 1:
        assert dropped == 0 and time.monotonic() < deadline, f"{dropped} replies counted as dropped"
        time.sleep(0.1)
    sender.close()


# ------------------------------------------------------------------------------- slow peers


def closed_within(conn: socket.socket, seconds: float) -> bool:
    """Read until the replay closes the connection (True) or `seconds` pass (False)."""
    conn.settimeout(0.2)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            if conn.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
    return False


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def test_a_peer_that_never_finishes_its_handshake_is_cut_off(service):
    conn = socket.create_connection(("127.0.0.1", port_of(service.ingest_endpoint)))
    conn.sendall(b"\xff\0\0\0\0\0\0\0\x01")  # the start of a ZMTP greeting, then silence
    assert closed_within(conn, 5), "a stalled handshake was kept open"
    conn.close()


def _zmtp_null_handshake(conn: socket.socket) -> None:
    """Speak ZMTP 3.0 with the NULL mechanism as a DEALER, by hand (RFC 23)."""
    greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
    conn.sendall(greeting)
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    conn.sendall(bytes([0x04, len(body)]) + body)
    # Wait for the server's greeting and READY: a frame sent before the server has sent its READY
    # reaches it mid-handshake, where libzmq reads it as a command and drops the connection.
    _read_exactly(conn, 64)
    flags, size = _read_exactly(conn, 2)
    _read_exactly(conn, size if flags == 0x04 else struct.unpack(">Q", bytes([size]) + _read_exactly(conn, 7))[0])


def _read_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        assert chunk, "the server closed the connection during the handshake"
        data += chunk
    return data


def test_a_peer_that_stalls_inside_a_message_blocks_no_one_and_is_cut_off(service):
    conn = socket.create_connection(("127.0.0.1", port_of(service.ingest_endpoint)))
    _zmtp_null_handshake(conn)
    # A frame announced as 200 kB (under the cap), of which 100 bytes come; then silence.
    conn.sendall(bytes([0x02]) + struct.pack(">Q", 200_000) + b"\0" * 100)
    t0 = time.monotonic()
    honest_round_trip(service, 0)  # the replay's loop never waits for the stalled message
    assert stats_within(service, 2).accepted == 1 and time.monotonic() - t0 < 5
    assert closed_within(conn, 5), "a peer silent inside a message was kept open"
    conn.close()


# ------------------------------------------------------------------------------- the gate


def peak_rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def flood(endpoint: str, frames: int, frame_bytes: int) -> None:
    """One message of `frames` frames, each under the per-frame cap, streamed over raw ZMTP so the
    sender holds one frame, not the message."""
    conn = socket.create_connection(("127.0.0.1", port_of(endpoint)))
    _zmtp_null_handshake(conn)
    chunk = b"\0" * frame_bytes
    try:
        for i in range(frames):
            more = 0x01 if i < frames - 1 else 0
            conn.sendall(bytes([0x02 | more]) + struct.pack(">Q", frame_bytes) + chunk)
        # Until the receiving side has taken it all in: it answers the message (a refusal), or the
        # gate drops the connection.
        conn.settimeout(60)
        conn.recv(1)
    except OSError:
        pass  # the gate dropped us: what the flood is for
    conn.close()


@pytest.mark.parametrize("gate", [True, False])
def test_a_message_of_many_frames_grows_the_gate_not_the_replay(tmp_path, gate):
    """libzmq holds a message until its last frame, bounding only each frame: 120 frames of 1 MiB
    make whoever reads the socket hold 120 MiB. Without a gate that is the replay (the control
    case: its peak memory rises by the flood); with one, the gate, whose memory limit makes libzmq
    drop the peer, and the replay's peak does not move."""
    cmd = [sys.executable, "-m", "dph_async.cli.main", "serve", "replay", "--no-wal",
           "--ingest", "tcp://127.0.0.1:0", "--batch", "tcp://127.0.0.1:0", f"output_dir={tmp_path}",
           "replay.max_group_mb=1", "net.gate_memory_mb=16", f"net.gate={str(gate).lower()}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("replay: ingest"):
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "the replay did not start"
        ingest = line.split()[2].rstrip(",")
        svc = SimpleNamespace(ingest_endpoint=ingest, batch_endpoint=line.split()[4].rstrip(";"),
                              actor_token=control_token(tmp_path, ACTOR_TOKEN_FILE))  # serve replay made it
        honest_round_trip(svc, 0)
        before = peak_rss_mb(proc.pid)
        flood(ingest, 120, (1 << 20) - 64)
        honest_round_trip(svc, 1)  # served either way, and after the flood
        grown = peak_rss_mb(proc.pid) - before
        if gate:
            assert grown < 20, f"the replay's peak memory rose {grown:.0f} MB behind its gate"
        else:
            assert grown > 80, f"the flood did not reach the replay without a gate (peak +{grown:.0f} MB)"
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_replay_starts_a_new_gate_when_one_dies_and_senders_lose_nothing(tmp_path):
    service = ReplayService(CFG, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", B, wal_dir=str(tmp_path / "wal"))
    service.start_in_thread()
    sender = RolloutSender(service.ingest_endpoint, 3, token=service.actor_token, reply_timeout_s=1.0)
    assert sender.tickets(8) == 8  # an honest actor: one ticket per group it sends
    for seq in range(4):
        sender.send(synthetic_group(3, seq, n=2, tokens=8))
    assert sender.flush(10)
    first = service._gate.pid
    os.kill(first, signal.SIGKILL)
    for seq in range(4, 8):
        sender.send(synthetic_group(3, seq, n=2, tokens=8))
    assert sender.flush(20), "groups sent while the gate was down were lost"
    sender.close()
    stats = stats_within(service, 5)
    assert stats.accepted == 8 and stats.gate_restarts == 1
    assert service._gate.pid not in (first, None)
    service.stop()
