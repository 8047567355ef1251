"""Fetching published weights: learn of the newest version, pull its buckets, verify, hand to the engine.

The weight server pushes each new manifest to actors that have asked once, so `newest` mostly reads
what already arrived on the socket, without a round trip; it asks again when nothing arrived for
`refresh_s` (the server restarted, or a push was lost while reconnecting).
"""

from __future__ import annotations

import time

import torch
import zmq

from dph_async import net, protocol
from dph_async.protocol import ErrorReply, WeightsBucket, WeightsQuery, WeightsReady, WeightsRequest
from dph_async.weights import array_to_tensor, checksum


class WeightFetchError(RuntimeError):
    """A bucket was missing, out of order or failed its checksum; nothing was loaded."""


class WeightClient:
    def __init__(self, addr: str, security: net.NetSecurity, actor_id: int, timeout_s: float = 30.0,
                 refresh_s: float = 2.0) -> None:
        self.addr, self.security, self.actor_id, self.timeout_s = addr, security, actor_id, timeout_s
        self.refresh_s = refresh_s
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._pushed: WeightsReady | None = None  # the newest manifest the server pushed
        self._heard = 0.0  # when the server last said anything (monotonic)
        self.bytes_fetched = 0
        self.fetch_seconds = 0.0
        self.checksum_seconds = 0.0  # of fetch_seconds: verifying the buckets (the rest is the transfer)
        self.checksum_cpu_seconds = 0.0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            net.connect(self._sock, self.addr, self.security)
        return self._sock

    def _keep_pushed(self, msg: protocol.Message) -> None:
        self._heard = time.monotonic()
        if isinstance(msg, WeightsReady) and (self._pushed is None or msg.version > self._pushed.version):
            self._pushed = msg

    def _call(self, msg: protocol.Message, timeout_s: float, reply_type: type) -> protocol.Message:
        """Send `msg` and return its reply (of `reply_type`, or an error); pushed manifests that
        arrive meanwhile are kept."""
        sock = self._socket()
        sock.send_multipart(protocol.encode(msg), copy=False)
        deadline = time.monotonic() + timeout_s
        while sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            reply = protocol.decode(sock.recv_multipart(copy=False))
            self._keep_pushed(reply)
            if isinstance(reply, (reply_type, ErrorReply)):
                return reply
        # A lost reply would otherwise arrive as the answer to the next request: start afresh.
        sock.close(0)
        self._sock = None
        raise TimeoutError(f"weight server {self.addr} did not answer within {timeout_s:.0f}s")

    def newest(self, have_version: int, timeout_s: float = 5.0) -> WeightsReady | None:
        """The newest published version's manifest if it is newer than `have_version`: from what the
        server pushed, or by asking when it has been silent for refresh_s (and the first time)."""
        sock = self._socket()
        while sock.poll(0):
            self._keep_pushed(protocol.decode(sock.recv_multipart(copy=False)))
        if time.monotonic() - self._heard > self.refresh_s:
            reply = self._call(WeightsQuery(self.actor_id, have_version), timeout_s, WeightsReady)
            if isinstance(reply, ErrorReply):
                if reply.kind == "unavailable":
                    return None
                raise WeightFetchError(reply.error)
        pushed = self._pushed
        return pushed if pushed is not None and pushed.version > have_version else None

    def fetch(self, ready: WeightsReady) -> list[tuple[str, torch.Tensor]]:
        """All tensors of `ready`, every bucket's checksum verified before anything is returned."""
        start = time.perf_counter()
        tensors: list[tuple[str, torch.Tensor]] = []
        for info in ready.buckets:
            reply = self._call(WeightsRequest(ready.version, info.index), self.timeout_s, WeightsBucket)
            if isinstance(reply, ErrorReply):
                raise WeightFetchError(f"version {ready.version} bucket {info.index}: {reply.error}")
            assert isinstance(reply, WeightsBucket)
            if reply.index != info.index or reply.names != info.names:
                raise WeightFetchError(f"version {ready.version}: bucket {info.index} does not match its manifest")
            verify, verify_cpu = time.perf_counter(), time.thread_time()
            if checksum(reply.arrays) != info.checksum or reply.checksum != info.checksum:
                raise WeightFetchError(f"version {ready.version}: bucket {info.index} failed its checksum")
            self.checksum_seconds += time.perf_counter() - verify
            self.checksum_cpu_seconds += time.thread_time() - verify_cpu
            for name, arr, tag, shape in zip(info.names, reply.arrays, info.dtypes, info.shapes, strict=True):
                tensors.append((name, array_to_tensor(arr, tag, shape)))
            self.bytes_fetched += info.nbytes
        self.fetch_seconds += time.perf_counter() - start
        return tensors

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
