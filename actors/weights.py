"""Fetching published weights: ask for the newest version, pull its buckets, verify, hand to the engine."""

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
    def __init__(self, addr: str, security: net.NetSecurity, actor_id: int, timeout_s: float = 30.0) -> None:
        self.addr, self.security, self.actor_id, self.timeout_s = addr, security, actor_id, timeout_s
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self.bytes_fetched = 0
        self.fetch_seconds = 0.0

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            net.connect(self._sock, self.addr, self.security)
        return self._sock

    def _call(self, msg: protocol.Message, timeout_s: float) -> protocol.Message:
        sock = self._socket()
        sock.send_multipart(protocol.encode(msg), copy=False)
        if not sock.poll(int(timeout_s * 1000)):
            # A lost reply would otherwise arrive as the answer to the next request: start afresh.
            sock.close(0)
            self._sock = None
            raise TimeoutError(f"weight server {self.addr} did not answer within {timeout_s:.0f}s")
        return protocol.decode(sock.recv_multipart(copy=False))

    def newest(self, have_version: int, timeout_s: float = 5.0) -> WeightsReady | None:
        """The newest published version's manifest if it is newer than `have_version`."""
        reply = self._call(WeightsQuery(self.actor_id, have_version), timeout_s)
        if isinstance(reply, ErrorReply):
            if reply.kind == "unavailable":
                return None
            raise WeightFetchError(reply.error)
        assert isinstance(reply, WeightsReady)
        return reply if reply.version > have_version else None

    def fetch(self, ready: WeightsReady) -> list[tuple[str, torch.Tensor]]:
        """All tensors of `ready`, every bucket's checksum verified before anything is returned."""
        start = time.perf_counter()
        tensors: list[tuple[str, torch.Tensor]] = []
        for info in ready.buckets:
            reply = self._call(WeightsRequest(ready.version, info.index), self.timeout_s)
            if isinstance(reply, ErrorReply):
                raise WeightFetchError(f"version {ready.version} bucket {info.index}: {reply.error}")
            assert isinstance(reply, WeightsBucket)
            if reply.index != info.index or reply.names != info.names:
                raise WeightFetchError(f"version {ready.version}: bucket {info.index} does not match its manifest")
            if checksum(reply.arrays) != info.checksum or reply.checksum != info.checksum:
                raise WeightFetchError(f"version {ready.version}: bucket {info.index} failed its checksum")
            for name, arr, tag, shape in zip(info.names, reply.arrays, info.dtypes, info.shapes, strict=True):
                tensors.append((name, array_to_tensor(arr, tag, shape)))
            self.bytes_fetched += info.nbytes
        self.fetch_seconds += time.perf_counter() - start
        return tensors

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
