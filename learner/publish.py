"""Weight publishing: versioned, bucketed, checksummed snapshots served to actors over ZeroMQ.

`publish(model, version)` copies the weights into CPU buckets (one model copy; the two newest
versions are kept, so an actor that started fetching version v can finish while v+1 appears).
A server thread answers `WeightsQuery` with the newest manifest and `WeightsRequest` with one
bucket at a time, so no message holds more than `bucket_bytes` of weights. It also pushes each new
manifest to every actor that has asked before, so actors learn of new weights without asking
between every engine step (a round trip to this process per step, waiting on its busy learner).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from dph_async import net, protocol
from dph_async.protocol import BucketInfo, ErrorReply, WeightsBucket, WeightsQuery, WeightsReady, WeightsRequest
from dph_async.weights import make_buckets, tensor_to_array
from learner.zero3 import full_state_dict

KEEP_VERSIONS = 2
# Peers the server pushes new manifests to (the most recent askers): a bound on what a flood of
# identities could make it hold.
MAX_SUBSCRIBERS = 1024


@dataclass
class PublishStats:
    version: int
    nbytes: int
    buckets: int
    seconds: float


class WeightServer:
    def __init__(self, addr: str, security: net.NetSecurity, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        self._versions: OrderedDict[int, list[tuple[BucketInfo, list[np.ndarray]]]] = OrderedDict()
        self._lock = threading.Lock()
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = net.bind(self._sock, addr, security)
        # publish() runs in the learner's thread, the ROUTER belongs to the server thread: a publish
        # wakes the server thread through this in-process pair, and the server does the pushing.
        self._wake_addr = f"inproc://weights-wake-{id(self)}"
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

    def publish(self, model: torch.nn.Module, version: int) -> PublishStats:
        """Snapshot `model`'s weights as `version` (checkpoint names, as vLLM's loader expects). Under
        ZeRO-3 the weights are gathered whole, a collective: every rank calls this."""
        start = time.perf_counter()
        named = [(name, *tensor_to_array(t)) for name, t in full_state_dict(model).items()]
        buckets = make_buckets(named, self.bucket_bytes)
        with self._lock:
            self._versions[version] = buckets
            while len(self._versions) > KEEP_VERSIONS:
                self._versions.popitem(last=False)
        nbytes = sum(info.nbytes for info, _ in buckets)
        self._wake_tx.send(b"")
        return PublishStats(version, nbytes, len(buckets), time.perf_counter() - start)

    def _answer(self, msg: protocol.Message) -> protocol.Message:
        with self._lock:
            if isinstance(msg, WeightsQuery):
                if not self._versions:
                    return ErrorReply("no weights published yet", kind="unavailable")
                version = next(reversed(self._versions))
                return WeightsReady(version, [info for info, _ in self._versions[version]])
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
            version = next(reversed(self._versions))
            frames = protocol.encode(WeightsReady(version, [info for info, _ in self._versions[version]]))
        for ident in self._subscribers:
            self._sock.send_multipart([ident, *frames], copy=False)

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
            if self._sock not in events:
                continue
            ident, *frames = self._sock.recv_multipart(copy=False)
            try:
                msg = protocol.decode(frames)
                reply = self._answer(msg)
            except protocol.ProtocolError as e:
                msg, reply = None, ErrorReply(str(e), kind=e.kind)
            if isinstance(msg, WeightsQuery):
                key = bytes(ident.buffer)
                self._subscribers[key] = None
                self._subscribers.move_to_end(key)
                while len(self._subscribers) > MAX_SUBSCRIBERS:
                    self._subscribers.popitem(last=False)
            self._sock.send_multipart([ident, *protocol.encode(reply)], copy=False)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._wake_rx.close(0)
        self._wake_tx.close(0)
