"""Weight publishing: versioned, bucketed, checksummed snapshots served to actors over ZeroMQ.

`publish(model, version)` copies the weights into CPU buckets (one model copy; the two newest
versions are kept, so an actor that started fetching version v can finish while v+1 appears).
A server thread answers `WeightsQuery` with the newest manifest and `WeightsRequest` with one
bucket at a time, so no message holds more than `bucket_bytes` of weights. It also pushes each new
manifest to every actor that has asked before, so actors learn of new weights without asking
between every engine step (a round trip to this process per step, waiting on its busy learner).

With the shared-memory transport (`learner.weight_transport` auto or shm) a version is written once,
into a /dev/shm slot (learner/shm_slots.py); its manifest names the slot, so actors on this host
copy from it directly, and the buckets served over the socket are views of the same slot.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from dph_async import net, protocol
from dph_async import weights_shm as shm
from dph_async.gate import Gate, HonestLoad
from dph_async.learner.shm_slots import SlotWriter
from dph_async.learner.zero3 import full_state_dict
from dph_async.protocol import (
    BucketInfo,
    ErrorReply,
    ShmSegment,
    WeightsBucket,
    WeightsQuery,
    WeightsReady,
    WeightsRequest,
)
from dph_async.receive import Received, guard, receive
from dph_async.refusals import RefusalLog
from dph_async.weight_buckets import make_buckets, tensor_to_array

log = logging.getLogger(__name__)

KEEP_VERSIONS = 2
# Peers the server pushes new manifests to (the most recent askers): a bound on what a flood of
# identities could make it hold.
MAX_SUBSCRIBERS = 1024
# What a peer may send: a query or a bucket request, a header of a few dozen bytes and no array. A
# larger frame gets its connection dropped before libzmq buffers it; anything else is refused before
# a field is built (dph_async/receive.py).
REQUEST_LIMITS = protocol.Limits(max_bytes=4096, max_header_bytes=4096, max_frames=0,
                                 accept=frozenset({WeightsQuery, WeightsRequest}))
PEER_TIMEOUT_S = 30.0
QUEUE_PER_PEER = 64  # requests held per connection; an honest actor has one out at a time
# Replies (buckets of up to learner.weight_bucket_mb) the gate holds for a peer that does not read:
# they are copies in the gate's memory, where without a gate they were views of a held version.
REPLIES_PER_PEER = 2
REFUSALS_LOGGED_PER_MIN = 10
TRANSPORTS = ("auto", "tcp", "shm")


@dataclass
class PublishStats:
    version: int
    nbytes: int
    buckets: int
    seconds: float


class WeightServer:
    """transport: "tcp" publishes into buckets of its own memory; "shm" into shared-memory slots (an
    error where they cannot be made); "auto" into slots where it can, else as "tcp"."""

    def __init__(self, addr: str, security: net.NetSecurity, bucket_bytes: int, transport: str = "auto") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"weight transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        self.bucket_bytes = bucket_bytes
        self.transport = transport
        self._slots: SlotWriter | None = None
        if transport != "tcp":
            shm.remove_stale()  # segments of learners that died without closing
            try:
                self._slots = SlotWriter(KEEP_VERSIONS)
            except shm.ShmUnavailable as e:
                self._no_shm(e)
        self._versions: OrderedDict[int, list[tuple[BucketInfo, list[np.ndarray]]]] = OrderedDict()
        self._segments: dict[int, ShmSegment] = {}
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._gate: Gate | None = None
        self.gate_restarts = 0
        self._dropped = 0  # replies this process could not send (the gate counts its own)
        # What honest actors fetching over TCP could make the gate hold (REPLIES_PER_PEER buckets each).
        self.gate_load = HonestLoad(security.gate_memory_mb, REPLIES_PER_PEER, "actors fetching weight buckets")
        security.require_gate_room(bucket_bytes / 2**20, "learner.weight_bucket_mb")  # buckets pass through it
        if security.gate:  # peers are read by a gate process (dph_async/gate.py)
            self._gate, (self._sock,) = Gate.open(self._ctx, [(addr, REQUEST_LIMITS)], security, PEER_TIMEOUT_S,
                                                  QUEUE_PER_PEER, reply_queue=REPLIES_PER_PEER)  # fmt: skip
            self.address = self._gate.endpoints[0]
        else:
            self._sock = self._ctx.socket(zmq.ROUTER)
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a peer that is gone is counted
            guard(self._sock, REQUEST_LIMITS, PEER_TIMEOUT_S, QUEUE_PER_PEER)
            self.address = net.bind(self._sock, addr, security)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Replies a peer does not read are dropped past QUEUE_PER_PEER (they are views of held versions,
        # but a peer that never reads should not pin them): by the ROUTER here, or by the gate's, whose
        # one pipe from here must hold a push to every subscriber at once.
        self._sock.setsockopt(zmq.SNDHWM, MAX_SUBSCRIBERS + QUEUE_PER_PEER if self._gate else QUEUE_PER_PEER)
        self._keys = net.curve_keys(security.curve_keys) if security.curve_keys else None
        self.refused: Counter[str] = Counter()  # refused requests, by ProtocolError kind
        self._refusals = RefusalLog(log, REFUSALS_LOGGED_PER_MIN, service="weight server")
        # publish() runs in the learner's thread, the ROUTER belongs to the server thread: a publish
        # wakes the server thread through this in-process pair, and the server does the pushing.
        # A fresh name: id(self) can repeat once an earlier server is freed, while its socket (never
        # closed) still holds the name in the shared context.
        self._wake_addr = f"inproc://weights-wake-{uuid.uuid4().hex}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(self._wake_addr)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.connect(self._wake_addr)
        self._subscribers: OrderedDict[bytes, None] = OrderedDict()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="weight-server", daemon=True)
        self._thread.start()
        self.bytes_served = 0

    @property
    def latest(self) -> int:
        with self._lock:
            return next(reversed(self._versions)) if self._versions else -1

    def _no_shm(self, e: OSError) -> None:
        if self.transport == "shm":
            raise shm.ShmUnavailable(f"learner.weight_transport=shm, but {e}") from None
        log.warning("weights go over TCP only (learner.weight_transport=auto): %s", e)
        if self._slots is not None:
            self._slots.close()
        self._slots = None

    @property
    def segment_names(self) -> list[str]:
        """The shared-memory files this server holds now."""
        return self._slots.names if self._slots is not None else []

    def _drop_oldest(self, keep: int) -> None:
        with self._lock:
            while len(self._versions) > keep:
                old, _ = self._versions.popitem(last=False)
                self._segments.pop(old, None)

    def publish(self, weights: torch.nn.Module | Mapping[str, torch.Tensor], version: int) -> PublishStats:
        """Snapshot the weights (a model, or its whole state dict: checkpoint names, as vLLM's loader
        expects) as `version`. A partitioned ZeRO-3 model is gathered whole here, a collective: with
        several ranks, pass `Trainer.whole_state()` instead."""
        start = time.perf_counter()
        state = list((full_state_dict(weights) if isinstance(weights, torch.nn.Module) else weights).items())
        segment, checksums = None, None
        if self._slots is not None:
            # The slot to be rewritten must serve nothing meanwhile: the version it holds goes first.
            self._drop_oldest(KEEP_VERSIONS - 1)
            try:
                with self._lock:
                    held = set(self._versions)
                segment, named, checksums = self._slots.write(state, version, held, self.bucket_bytes)
            except shm.ShmUnavailable as e:
                self._no_shm(e)
        if segment is None:
            named = [(name, *tensor_to_array(t)) for name, t in state]
        buckets = make_buckets(named, self.bucket_bytes, checksums)
        with self._lock:
            self._versions[version] = buckets
            if segment is not None:
                self._segments[version] = segment
        self._drop_oldest(KEEP_VERSIONS)
        nbytes = sum(info.nbytes for info, _ in buckets)
        self._wake_tx.send(b"")
        return PublishStats(version, nbytes, len(buckets), time.perf_counter() - start)

    def _manifest(self, version: int) -> WeightsReady:
        return WeightsReady(version, [info for info, _ in self._versions[version]], self._segments.get(version))

    def _answer(self, msg: protocol.Message) -> protocol.Message:
        with self._lock:
            if isinstance(msg, WeightsQuery):
                if not self._versions:
                    return ErrorReply("no weights published yet", kind="unavailable")
                return self._manifest(next(reversed(self._versions)))
            if isinstance(msg, WeightsRequest):
                buckets = self._versions.get(msg.version)
                if buckets is None:
                    return ErrorReply(f"weights version {msg.version} is no longer held", kind="gone")
                if not 0 <= msg.bucket < len(buckets):
                    return ErrorReply(f"bucket {msg.bucket} out of range (0..{len(buckets) - 1})", kind="value")
                info, arrays = buckets[msg.bucket]
                self.bytes_served += info.nbytes
                return WeightsBucket(msg.version, info.index, info.names, arrays, info.checksum, info.dtypes)
        return ErrorReply(f"the weight server does not answer {type(msg).__name__}", kind="type")

    def _push_newest(self) -> None:
        """Send the newest manifest to every subscriber (dropped by ZeroMQ for one that is gone)."""
        with self._lock:
            if not self._versions:
                return
            frames = protocol.encode(self._manifest(next(reversed(self._versions))))
        for ident in self._subscribers:
            self._send([ident, *frames])

    @property
    def gated(self) -> bool:
        return self._gate is not None

    @property
    def replies_dropped(self) -> int:
        """Replies and pushes not delivered: past SNDHWM, or to a peer that is gone (here or in the gate)."""
        return self._dropped + (self._gate.replies_dropped if self._gate is not None else 0)

    def _send(self, frames: list) -> None:
        # A reply is dropped, never waited on: the peer asks again.
        try:
            self._sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._dropped += 1

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            if self._wake_rx in events:
                while self._wake_rx.poll(0):
                    self._wake_rx.recv()
                self._push_newest()
            self._refusals.tick()
            if self._gate is not None and (code := self._gate.revive()) is not None:
                self.gate_restarts += 1
                log.warning("weight server: the gate process ended (status %s); another was started", code)
            if self._sock not in events:
                continue
            gated, curve = self._gate is not None, self._keys is not None
            while (received := receive(self._sock, REQUEST_LIMITS, curve, gated)) is not None:
                self._reply(received)

    def _reply(self, received: Received) -> None:
        msg = received.message
        if self._keys is not None and not self._keys.allows(received.user_id):
            # A key removed from authorized/ while its connection stayed open.
            msg = protocol.ProtocolError("unauthorized", "the sender's CURVE key is no longer authorized")
        if isinstance(msg, protocol.ProtocolError):
            self.refused[msg.kind] += 1
            self._refusals.refused(str(msg))
            reply: protocol.Message = ErrorReply(str(msg), kind=msg.kind)
        else:
            reply = self._answer(msg)
            if self._gate is not None and isinstance(reply, WeightsBucket) and (
                    warning := self.gate_load.saw(received.peer, sum(a.nbytes for a in reply.arrays))):  # fmt: skip
                log.warning("weight server: %s", warning)
        if isinstance(msg, WeightsQuery):
            self._subscribers[received.peer] = None
            self._subscribers.move_to_end(received.peer)
            while len(self._subscribers) > MAX_SUBSCRIBERS:
                self._subscribers.popitem(last=False)
        self._send([received.peer, *protocol.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._wake_rx.close(0)
        self._wake_tx.close(0)
        if self._gate is not None:
            self._gate.close()
        with self._lock:
            self._versions.clear()
            self._segments.clear()
        if self._slots is not None:
            self._slots.close()
