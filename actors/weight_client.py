"""Fetching published weights: learn of the newest version, pull its buckets, verify, hand to the engine.

The weight server pushes each new manifest to actors that have asked once, so `newest` mostly reads
what already arrived on the socket, without a round trip; it asks again when nothing arrived for
`refresh_s` (the server restarted, or a push was lost while reconnecting).

`tensors(ready)` is how a version is read: from the learner's shared-memory segment when the manifest
names one on this host (mapped read-only, verified, and copied from by the caller while a reader's
lock keeps the learner from rewriting it), else, or when the segment cannot be opened, over the
socket (`fetch`). The manifest is untrusted: the segment's name, size and every tensor's bytes are
checked against it, and the file against what a learner of this user makes, before anything is read.
"""

from __future__ import annotations

import contextlib
import logging
import math
import mmap
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch
import zmq

from dph_async import net, protocol
from dph_async import weights_shm as shm
from dph_async.protocol import ErrorReply, ShmSegment, WeightsBucket, WeightsQuery, WeightsReady, WeightsRequest
from dph_async.weight_buckets import array_to_tensor, checksum, tag_dtype

log = logging.getLogger(__name__)

# Segments kept mapped: the learner's slots (two) and one it replaced while this actor read it.
MAX_MAPPED = 3


class WeightFetchError(RuntimeError):
    """A bucket was missing, out of order or failed its checksum, the version was no longer held, or
    its manifest was refused; nothing was loaded."""


class WeightServerSilent(WeightFetchError):
    """The weight server did not answer in time: its gate process was started again and the request
    was lost with the old one, or the learner is busy. Nothing was loaded; the next request goes out
    on a new connection."""


class WeightTransportError(RuntimeError):
    """learner.weight_transport=shm, and the shared-memory segment cannot be used here."""


class WeightClient:
    def __init__(self, addr: str, security: net.NetSecurity, actor_id: int, timeout_s: float = 30.0,
                 refresh_s: float = 2.0, transport: str = "auto") -> None:
        if transport not in ("auto", "tcp", "shm"):
            raise ValueError(f"weight transport {transport!r} is not one of auto, tcp, shm")
        self.addr, self.security, self.actor_id, self.timeout_s = addr, security, actor_id, timeout_s
        self.refresh_s = refresh_s
        self.transport = transport
        self._host = shm.host_identity()
        self._mapped: OrderedDict[str, tuple[int, mmap.mmap]] = OrderedDict()  # segment name -> (fd, map)
        self._leases: set[int] = set()  # descriptors whose read locks the engine's weights rest on
        self.leased = False  # inside a leased `tensors` block over shared memory
        self.loads = {"shm": 0, "tcp": 0}  # versions read, by transport
        self.shm_fallbacks = 0  # versions that named a segment this actor could not open: read over TCP
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
        raise WeightServerSilent(f"weight server {self.addr} did not answer within {timeout_s:.0f}s")

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

    @contextlib.contextmanager
    def tensors(self, ready: WeightsReady, lease: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """All tensors of `ready`, verified. Over shared memory they are read-only views of the
        learner's segment, valid inside the block: the reader's lock keeps the learner from rewriting
        it. With `lease`, a block left without an exception keeps that lock until the next leased
        read has ended (or `release`), so the engine may keep the views as its weights; inside the
        block `leased` says whether it may (False over TCP, where the tensors are this process's
        own memory and the engine copies them). A leased block left by an exception keeps its lock
        as well as the earlier lease, until then: the load may have installed some views first."""
        start = time.perf_counter()
        views = self._from_shm(ready) if self.transport != "tcp" else None
        if views is None:
            tensors = self.fetch(ready)
            self.loads["tcp"] += 1
            self.leased = False
            yield tensors
            return
        fd, named = views
        self.fetch_seconds += time.perf_counter() - start
        self.loads["shm"] += 1
        self.leased = lease
        kept = False
        try:
            yield named
            kept = lease
        finally:
            self.leased = False
            if kept:  # the engine's weights are views of this slot now, and of no other
                self._unlock_leases(but=fd)  # (one descriptor holds one lock: the same slot read again keeps it)
                self._leases.add(fd)
            elif lease:  # a load that failed part way may have left views of this slot in the engine too
                self._leases.add(fd)
            elif fd not in self._leases:
                shm.unlock(fd)

    def release(self) -> None:
        """Give back the lease on the segment whose views the engine held: it now holds others (or
        its own copies), and the learner may rewrite that slot."""
        self._unlock_leases()

    def _unlock_leases(self, but: int | None = None) -> None:
        for fd in self._leases - {but}:
            shm.unlock(fd)
        self._leases &= {but}

    def _segment(self, seg: ShmSegment) -> tuple[int, mmap.mmap]:
        """The segment's descriptor and read-only map, opened once and kept (a fresh map of a large
        segment costs page faults on every read; a kept one costs them once)."""
        if seg.name in self._mapped:
            self._mapped.move_to_end(seg.name)
            fd, mm = self._mapped[seg.name]
            if len(mm) != seg.size:  # a file's size never changes: the manifest is wrong
                raise ValueError(f"{seg.name} holds {len(mm)} bytes, the manifest says {seg.size}")
            return fd, mm
        fd = shm.open_for_reading(seg.name, seg.size)
        try:
            mm = mmap.mmap(fd, seg.size, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError as e:
            os.close(fd)
            raise shm.ShmUnavailable(f"cannot map {seg.name}: {e.strerror}") from None
        self._mapped[seg.name] = (fd, mm)
        while len(self._mapped) > MAX_MAPPED:
            oldest = next(name for name, (fd, _) in self._mapped.items() if fd not in self._leases)
            old_fd, _ = self._mapped.pop(oldest)
            os.close(old_fd)  # the map itself goes with the last view of it
        return fd, mm

    def _unavailable(self, ready: WeightsReady, why: str) -> None:
        """The segment cannot be read here: an error under transport=shm, else TCP (logged once,
        then at every power of two)."""
        if self.transport == "shm":
            raise WeightTransportError(f"learner.weight_transport=shm, but version {ready.version}: {why}")
        n = self.shm_fallbacks = self.shm_fallbacks + 1
        if n & (n - 1) == 0:
            log.warning("actor %d: weights over TCP (%d so far): %s", self.actor_id, n, why)

    def _from_shm(self, ready: WeightsReady) -> tuple[int, list[tuple[str, torch.Tensor]]] | None:
        """(descriptor, tensors) of `ready` from its segment, read-locked and verified; None where the
        segment cannot be read here (then TCP)."""
        seg = ready.shm
        if seg is None:
            self._unavailable(ready, "the learner published no shared-memory segment")
            return None
        try:
            ready.validate()  # decoding did too, but a manifest may come from elsewhere than decode
        except ValueError as e:
            raise WeightFetchError(f"version {ready.version}: manifest refused: {e}") from None
        if not self._host or seg.host != self._host:
            self._unavailable(ready, f"the segment is on host {seg.host!r}, this is {self._host!r}")
            return None
        try:
            fd, mm = self._segment(seg)
        except shm.ShmUnavailable as e:
            self._unavailable(ready, str(e))
            return None
        except ValueError as e:
            raise WeightFetchError(f"version {ready.version}: segment refused: {e}") from None
        if not shm.try_lock(fd, exclusive=False):
            raise WeightFetchError(f"version {ready.version} is being replaced in shared memory")
        try:
            try:
                held = shm.read_header(mm)
            except ValueError as e:
                raise WeightFetchError(f"version {ready.version}: segment {seg.name} refused: {e}") from None
            if held != ready.version:
                raise WeightFetchError(f"weights version {ready.version} is no longer held (its slot holds {held})")
            named: list[tuple[str, torch.Tensor]] = []
            offsets = iter(seg.offsets)
            # One tensor over the whole map, every weight a view of it: views of one storage, so the
            # engine can take stacked shards lying back to back as one (actors/inplace_weights.py).
            whole_np = np.frombuffer(mm, np.uint8)
            with warnings.catch_warnings():  # read-only on purpose: the engine copies out of it
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                whole = torch.from_numpy(whole_np)
            verify, verify_cpu = time.perf_counter(), time.thread_time()
            for info in ready.buckets:
                arrays, tensors = [], []
                for tag, shape in zip(info.dtypes, info.shapes, strict=True):
                    start = next(offsets)
                    end = start + protocol.storage_dtype(tag).itemsize * math.prod(shape)
                    arrays.append(whole_np[start:end])
                    tensors.append(whole[start:end].view(tag_dtype(tag)).view(shape))
                if checksum(arrays) != info.checksum:
                    raise WeightFetchError(f"version {ready.version}: bucket {info.index} failed its checksum "
                                           "in shared memory")
                named.extend(zip(info.names, tensors, strict=True))
                self.bytes_fetched += info.nbytes
            self.checksum_seconds += time.perf_counter() - verify
            self.checksum_cpu_seconds += time.thread_time() - verify_cpu
        except BaseException:
            if fd not in self._leases:  # the engine's weights still rest on that lock
                shm.unlock(fd)
            raise
        return fd, named

    def close(self) -> None:
        self.release()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        for fd, _ in self._mapped.values():
            os.close(fd)
        self._mapped.clear()
