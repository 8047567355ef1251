"""The replay over real sockets: bad input answered and counted, waits, retries, restarts, security."""

from __future__ import annotations

import time

import msgpack
import numpy as np
import pytest
import zmq

import dph_async.replay.service as service_module
from dph_async.config.replay import ReplayConfig
from dph_async.net import InsecureBindError, NetSecurity, generate_keys, is_local_endpoint
from dph_async.protocol import Ack, BatchRequest, ErrorReply, StatsRequest, decode, encode
from dph_async.replay.service import ReplayService
from dph_async.replay_client import ReplayClient, ReplayError, ReplayUnavailable, RolloutSender
from dph_async.tools.bench.transport import synthetic_group

CFG = ReplayConfig(max_staleness=100, admission=False, max_group_mb=0.05)


@pytest.fixture
def service(tmp_path, ipc):
    svc = ReplayService(CFG, ipc("in"), ipc("out"), 4, wal_dir=str(tmp_path / "wal"), data_dir=str(tmp_path))
    svc.start_in_thread()
    yield svc
    svc.stop()


def raw(addr: str) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(addr)
    return sock


def control_client(service: ReplayService, **kw) -> ReplayClient:
    """The learner's client: it holds the replay's control token."""
    return ReplayClient(service.batch_endpoint, token=service.control_token, data_dir=service.data_dir, **kw)


def ask(sock: zmq.Socket, frames: list):
    sock.send_multipart(frames)
    return decode(sock.recv_multipart())


def test_bad_input_is_answered_counted_and_loses_nothing(service):
    sender = RolloutSender(service.ingest_endpoint, 0, token=service.actor_token)
    for i in range(5):
        sender.send(synthetic_group(0, i, n=2, tokens=8))
    assert sender.flush(10) and sender.accepted == 5

    sock = raw(service.ingest_endpoint)
    good = encode(synthetic_group(0, 100, n=2, tokens=8))
    head = msgpack.unpackb(good[0])
    nan_group = synthetic_group(0, 101, n=2, tokens=8)
    nan_group.completions[1].logprobs[3] = np.nan
    cases = {
        "garbage": ([b"\x00\x01garbage"], "header is not a valid message envelope"),
        "truncated": (good[:-1], "header announces 7 array frames, 6 came"),
        "wrong version": ([msgpack.packb(head | {"v": 9}), *good[1:]], "schema version 9 is not supported"),
        "oversized": (encode(synthetic_group(0, 102, n=8, tokens=1000)), "of more than 52428 bytes (its limit)"),
        "wrong type": (
            [msgpack.packb(head | {"m": head["m"] | {"seq": "x"}}), *good[1:]],
            "RolloutGroup.seq: Expected `int`, got `str`",
        ),
        "nan": (encode(nan_group), "completions[1].logprobs must be finite"),
    }
    for name, (frames, expected) in cases.items():
        reply = ask(sock, frames)
        assert isinstance(reply, Ack) and reply.status == "error" and expected in reply.error, name
    reply = ask(sock, encode(BatchRequest(0, 1, 0.0)))
    assert isinstance(reply, Ack) and "BatchRequest is not served on this endpoint" in reply.error

    batch_sock = raw(service.batch_endpoint)
    reply = ask(batch_sock, [b"\x92\x01"])
    assert isinstance(reply, ErrorReply) and reply.kind == "header"

    client = control_client(service)
    stats = client.stats()
    assert stats.refused.by_kind == {
        "header": 2, "frames": 1, "version": 1, "size": 1, "field": 1, "invalid_logprob": 1, "type": 1,
    }
    batch = client.get_batch(0, 10, wait_s=0.0)
    assert sorted(g.seq for g in batch.groups) == [0, 1, 2, 3, 4]  # nothing accepted was lost
    client.close()
    sender.close()


def test_a_batch_request_waits_then_returns_what_there_is(service):
    """...and each answer says how long it was held for want of groups (waited_s) and how long the
    learner took since the previous answer (cycle_s): what makes auto staleness grow."""
    client = control_client(service)
    t0 = time.monotonic()
    first = client.get_batch(0, 4, wait_s=0.3)
    assert first.groups == [] and (first.cycle_s, first.data_wait) == (0.0, 1.0)  # nothing answered before
    assert 0.25 < time.monotonic() - t0 < 3 and 0.25 < first.waited_s <= time.monotonic() - t0
    sender = RolloutSender(service.ingest_endpoint, 1, token=service.actor_token)
    sender.send(synthetic_group(1, 0))
    sender.flush(5)
    t1 = time.monotonic()
    second = client.get_batch(0, 4, wait_s=0.3)
    assert [g.group_id for g in second.groups] == [(1, 0)]
    assert 0 < second.cycle_s < t1 - t0 and 0.25 < second.waited_s < 3
    for i in range(1, 5):
        sender.send(synthetic_group(1, i))
    sender.flush(5)
    time.sleep(0.2)  # the learner's "step"
    t0 = time.monotonic()
    full = client.get_batch(0, 4, wait_s=30)
    assert len(full.groups) == 4 and full.waited_s == 0.0  # a full batch does not wait
    assert time.monotonic() - t0 < 10 and full.cycle_s >= 0.2 and full.data_wait == 0.0
    sender.close()
    client.close()


def test_the_same_request_id_gets_the_same_batch(service):
    sender = RolloutSender(service.ingest_endpoint, 0, token=service.actor_token)
    for i in range(8):
        sender.send(synthetic_group(0, i))
    sender.flush(5)
    sock = raw(service.batch_endpoint)
    token = service.control_token
    first = ask(sock, encode(BatchRequest(0, 4, 0.0, request_id=5, token=token)))
    again = ask(sock, encode(BatchRequest(0, 4, 0.0, request_id=5, token=token)))  # as if the reply was lost
    after = ask(sock, encode(BatchRequest(1, 4, 0.0, request_id=6, token=token)))
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups]
    assert {g.group_id for g in after.groups}.isdisjoint(g.group_id for g in first.groups)
    assert ask(sock, encode(StatsRequest())).replay.served.batches_resent == 1
    sender.close()


def test_a_learner_in_the_service_process_takes_batches_on_the_local_socket(tmp_path, monkeypatch):
    """The learner's own process reaches the replay through an inproc socket of the service's context:
    no gate and no CURVE there, so the control token is what authorizes, with CURVE on outside too."""
    keys = str(generate_keys(tmp_path / "keys"))
    svc = ReplayService(CFG, "tcp://127.0.0.1:0", "tcp://127.0.0.1:0", 4, data_dir=str(tmp_path),
                        security=NetSecurity(curve_keys=keys))
    svc.start_in_thread()
    try:
        assert svc.local_batch_endpoint.startswith("inproc://")
        sender = RolloutSender(svc.ingest_endpoint, 0, token=svc.actor_token, security=NetSecurity(curve_keys=keys))
        for i in range(6):
            sender.send(synthetic_group(0, i))
        assert sender.flush(10)
        local = svc.local_client()
        encoded = []
        # Replies encoded from here on (acknowledgements of the sender's groups may be among them).
        monkeypatch.setattr(service_module, "encode", lambda m: encoded.append(type(m).__name__) or encode(m))
        batch = local.get_batch(0, 4, wait_s=5)
        assert [g.group_id for g in batch.groups] == [(0, i) for i in range(4)]
        # Handed over as objects, not encoded; the replay's arrays, which nothing may write to.
        assert "Batch" not in encoded
        arrays = [a for g in batch.groups for c in g.completions for a in (c.token_ids, c.logprobs, c.versions)]
        assert arrays and not any(a.flags.writeable for a in arrays)
        assert local.snapshot("snap") and local.stats().served.batches == 1
        # The token, not the socket, authorizes: a request without it is refused there too.
        stranger = svc._ctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.RCVTIMEO, 5000)
        stranger.connect(svc.local_batch_endpoint)
        reply = ask(stranger, encode(BatchRequest(1, 2, 0.0, request_id=9, token=b"guess")))
        assert isinstance(reply, ErrorReply) and "needs the control identity" in reply.error
        assert "ErrorReply" in encoded  # a socket not handed out by local_client() gets frames
        stranger.close(linger=0)
        assert [g.group_id for g in local.get_batch(1, 2, wait_s=5).groups] == [(0, 4), (0, 5)]
        assert "Batch" not in encoded
        local.close()
        sender.close()
    finally:
        svc.stop()


def test_the_sender_resends_across_a_service_restart(tmp_path, ipc):
    addr_in, addr_out = ipc("in"), ipc("out")
    token = b"t" * 32  # a restarted replay keeps its token (`dph-async serve replay` keeps it in a file)
    first = ReplayService(CFG, addr_in, addr_out, 4, wal_dir=str(tmp_path / "wal"), control_token=token)
    first.start_in_thread()
    sender = RolloutSender(addr_in, 3, reply_timeout_s=2)
    for i in range(5):
        sender.send(synthetic_group(3, i))
    assert sender.flush(5)
    first.stop()
    for i in range(5, 10):  # the replay is down: kept in the sender
        sender.send(synthetic_group(3, i))
    assert sender.unacked == 5
    second = ReplayService(CFG, addr_in, addr_out, 4, wal_dir=str(tmp_path / "wal"), control_token=token)
    second.start_in_thread()
    try:
        assert sender.flush(15) and sender.accepted == 10
        assert sender.resume().watermark == 10
        client = ReplayClient(addr_out, token=token)
        assert sorted(g.seq for g in client.get_batch(0, 10, 0.0).groups) == list(range(10))
        client.close()
    finally:
        sender.close()
        second.stop()


def test_snapshot_restore_and_shutdown_over_the_client(tmp_path, service):
    client = control_client(service, request_timeout_s=10)
    assert "written to" in client.snapshot(str(tmp_path / "ckpt"))
    assert "restored to version 0" in client.restore(str(tmp_path / "ckpt"))
    with pytest.raises(ReplayError, match=r"restore failed: .*nowhere"):
        client.restore(str(tmp_path / "nowhere"))
    client.shutdown()
    service._thread.join(5)
    assert not service._thread.is_alive()
    client.close()


def test_binding_beyond_loopback_needs_keys_or_the_insecure_flag(ipc):
    assert is_local_endpoint("tcp://127.0.0.1:5555") and is_local_endpoint("ipc:///tmp/x")
    assert is_local_endpoint("tcp://[::1]:5") and not is_local_endpoint("tcp://0.0.0.0:5")
    assert not is_local_endpoint("tcp://*:5") and not is_local_endpoint("tcp://10.1.2.3:5")
    with pytest.raises(InsecureBindError, match=r"refusing to bind tcp://0\.0\.0\.0:0"):
        ReplayService(CFG, "tcp://0.0.0.0:0", ipc("out"), 4)
    # With the flag it binds every interface and serves: a client on loopback gets through.
    svc = ReplayService(CFG, "tcp://0.0.0.0:0", "tcp://0.0.0.0:0", 4, security=NetSecurity(insecure=True))
    svc.start_in_thread()
    try:
        assert svc.batch_endpoint.startswith("tcp://0.0.0.0:") and not svc.batch_endpoint.endswith(":0")
        client = ReplayClient(f"tcp://127.0.0.1:{svc.batch_endpoint.rsplit(':', 1)[1]}", request_timeout_s=10)
        assert client.stats().accepted == 0
        client.close()
    finally:
        svc.stop()


def test_curve_admits_only_authorized_clients(tmp_path):
    keys = str(generate_keys(tmp_path / "keys"))
    strangers = str(generate_keys(tmp_path / "strangers"))
    svc = ReplayService(CFG, "tcp://0.0.0.0:0", "tcp://127.0.0.1:0", 4, security=NetSecurity(curve_keys=keys))
    svc.start_in_thread()
    try:
        port = svc.batch_endpoint.rsplit(":", 1)[1]
        good = ReplayClient(f"tcp://127.0.0.1:{port}", security=NetSecurity(curve_keys=keys))
        assert good.stats().accepted == 0
        good.close()
        for security in (NetSecurity(curve_keys=strangers), None):
            bad = ReplayClient(f"tcp://127.0.0.1:{port}", security=security, request_timeout_s=1.5)
            with pytest.raises(ReplayUnavailable, match=r"handshake .* refused"):
                bad.stats()
            bad.close()
    finally:
        svc.stop()


def test_a_reply_survives_the_server_leaving_right_after_it(ipc):
    """The answer to "shutdown" arrives as the replay disconnects: it must still be readable."""
    from dph_async.protocol import ControlReply
    from dph_async.replay_client import _Channel

    addr = ipc("s")
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.bind(addr)
    chan = _Channel(addr, None, None)
    while not chan.send(encode(StatsRequest())):
        time.sleep(0.01)
    identity, *_ = server.recv_multipart()
    server.send_multipart([identity, *encode(ControlReply(True, "bye"))])
    server.close(linger=1000)
    ctx.term()  # gone before the client reads
    time.sleep(0.3)
    reply = chan.recv(2.0)
    chan.close()
    assert isinstance(reply, ControlReply) and reply.detail == "bye"


def test_serve_replay_command_refuses_an_open_bind_and_stops_on_sigterm(tmp_path, ipc):
    import signal
    import subprocess
    import sys

    base = [sys.executable, "-m", "dph_async.cli.main", "serve", "replay", "--wal-dir", str(tmp_path / "wal")]
    refused = subprocess.run([*base, "--ingest", "tcp://0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "refusing to bind tcp://0.0.0.0:0" in refused.stderr
    addr_in, addr_out = ipc("in"), ipc("out")
    proc = subprocess.Popen(
        [*base, "--ingest", addr_in, "--batch", addr_out],
        stderr=subprocess.PIPE,
        text=True,
    )
    client = ReplayClient(addr_out, request_timeout_s=30)
    assert client.stats().accepted == 0
    client.close()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_keys_command(tmp_path):
    from dph_async.cli.main import main

    assert main(["keys", str(tmp_path / "k")]) == 0
    assert (tmp_path / "k" / "authorized" / "client.key").is_file()
    assert (tmp_path / "k" / "server.key_secret").stat().st_mode & 0o077 == 0
    assert main(["keys", str(tmp_path / "k")]) == 1  # never overwrites keys
