"""Reading one message off a service's ROUTER socket within its limits, one frame at a time.

libzmq hands over a multipart message only once all of its frames have arrived, and its only size
limit, ZMQ_MAXMSGSIZE, is per frame: `guard(sock, ...)` sets it to the endpoint's message cap, so
a peer sending a bigger frame is disconnected before libzmq buffers that frame. What a message of
many frames holds inside libzmq before it is delivered is frames x that cap, which no libzmq option
bounds: that is why the services read their peers through a gate process (dph_async/gate.py), and
why this module reads the gate's messages too (`gated`). Once delivered,
`receive` holds no more of a message than its limits allow: it reads the header frame,
checks it (`read_header`: size, version, type, frame count), takes the array frames one by one
against the frame count the header announced and the message's byte cap, and once either is
exceeded reads the rest off the socket dropping each frame as it comes, so a refused message is
released at once and the next one can be read.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import zmq

from dph_async.protocol import Limits, Message, ProtocolError, decode_fields, read_header


@dataclass
class Received:
    """One message from a peer: its routing id, its CURVE public key (z85; "" without CURVE), and the
    message or the error that says why it is not one."""

    peer: bytes
    user_id: str
    message: Message | ProtocolError


def guard(sock: zmq.Socket, limits: Limits, peer_timeout_s: float, queue_per_peer: int) -> None:
    """A service's ROUTER facing peers it does not trust: frames within `limits`, a handshake that
    must end and heartbeats both ways within `peer_timeout_s` (a stalled or vanished peer is
    dropped), and at most `queue_per_peer` messages held from each connection."""
    # No frame larger than a whole message may be: libzmq disconnects a peer that sends one.
    sock.setsockopt(zmq.MAXMSGSIZE, max(limits.max_bytes, limits.max_header_bytes))
    timeout_ms = int(peer_timeout_s * 1000)
    sock.setsockopt(zmq.HANDSHAKE_IVL, timeout_ms)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, timeout_ms // 3))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
    sock.setsockopt(zmq.RCVHWM, queue_per_peer)


def _drain(sock: zmq.Socket, frame: zmq.Frame) -> None:
    """Read the rest of a message and drop it, frame by frame."""
    while frame.more:
        frame = sock.recv(copy=False)


def _user_id(frame: zmq.Frame) -> str:
    with contextlib.suppress(zmq.ZMQError):  # no CURVE: the connection has no User-Id
        return frame.get("User-Id")
    return ""


def receive(sock: zmq.Socket, limits: Limits, curve: bool = False, gated: bool = False) -> Received | None:
    """The next message on a ROUTER socket, decoded under `limits`; None if none is waiting.
    curve: the socket is a CURVE server, so each message carries its sender's public key.
    gated: the socket is the service's side of its gate (dph_async/gate.py), whose messages carry
    the sender's routing id and CURVE key as their first two frames."""
    try:
        first = sock.recv(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None
    peer = first.bytes
    user_id = ""
    if gated and first.more:
        key = sock.recv(copy=False)
        user_id, first = key.bytes.decode("ascii", "replace"), key
    if not first.more:
        return Received(peer, user_id, ProtocolError("frames", "empty message (no frames)"))
    frame = sock.recv(copy=False)
    if curve and not gated:
        user_id = _user_id(frame)
    try:
        header = read_header(frame, limits)
    except ProtocolError as e:
        _drain(sock, frame)
        return Received(peer, user_id, e)
    arrays: list[zmq.Frame] = []
    total = header.nbytes
    while frame.more:
        if len(arrays) == header.frames:
            _drain(sock, frame)
            error = f"{header.cls.__name__}: more array frames than the {header.frames} its header announces"
            return Received(peer, user_id, ProtocolError("frames", error))
        frame = sock.recv(copy=False)
        total += len(frame)
        if total > header.cap:
            _drain(sock, frame)
            error = f"{header.cls.__name__} of more than {header.cap} bytes (its limit) across its frames"
            return Received(peer, user_id, ProtocolError("size", error))
        arrays.append(frame)
    try:
        return Received(peer, user_id, decode_fields(header, arrays))
    except ProtocolError as e:
        return Received(peer, user_id, e)
