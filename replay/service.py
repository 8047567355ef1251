"""The replay service: ReplayCore behind two ZeroMQ ROUTER sockets, driven by one thread.

    ingest endpoint (actors, DEALER):   RolloutGroup -> Ack, TicketRequest -> TicketGrant,
                                        ResumeRequest -> ResumeInfo, StatsRequest -> Stats
    batch endpoint (learner, DEALER):   BatchRequest -> Batch, StatsRequest -> Stats,
                                        Control -> ControlReply

Runs as its own process (`dph-async serve replay`) or in a thread of the learner's process
(`start_in_thread()`), same code. Ingest is group-committed: every group that arrived together is
logged with one write, then all are acknowledged. A message that does not decode is answered with
an error Ack (ingest) or ErrorReply (batch), counted under rejected:<kind>, and nothing else changes.
Batch and ticket requests that cannot be answered yet are parked until they can or their wait ends.
A failed log write stops the service (fail-stop): its state must never run ahead of its log.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import pyarrow as pa
import zmq

from dph_async.config.replay import ReplayConfig
from dph_async.net import NetSecurity, bind, stop_authenticator
from dph_async.protocol import (
    Ack,
    BatchRequest,
    Control,
    ControlReply,
    ErrorReply,
    Limits,
    Message,
    ProtocolError,
    ResumeRequest,
    RolloutGroup,
    Stats,
    StatsRequest,
    TicketRequest,
    decode,
    encode,
)
from replay.core import ReplayCore
from replay.reference_pool import ReferencePool
from replay.state import ReplayStateError
from replay.wal import WriteAheadLog

log = logging.getLogger(__name__)
MiB = 1 << 20
CONTROL_LIMITS = Limits(max_bytes=MiB)
# Wake at least this often to answer parked requests at their deadline and to notice stop().
TICK_S = 0.05


@dataclass
class _Parked:
    identity: bytes
    request: BatchRequest | TicketRequest
    deadline: float


class ReplayService:
    def __init__(
        self,
        cfg: ReplayConfig,
        ingest_addr: str,
        batch_addr: str,
        groups_per_batch: int,
        reference_path: str | None = None,
        wal_dir: str | None = None,
        security: NetSecurity | None = None,
        seed: int = 0,
    ):
        """wal_dir: the log directory, already resolved against the run directory (None: no log, a
        restart loses everything). Port 0 in a tcp address picks a free port; see the *_endpoint
        attributes for what was bound."""
        self.cfg = cfg
        reference = ReferencePool.load(reference_path, seed, cfg.logprob_tolerance) if reference_path else None
        wal = WriteAheadLog(wal_dir, cfg.wal_fsync, int(cfg.wal_segment_mb * MiB)) if wal_dir else None
        self.core = ReplayCore(cfg, groups_per_batch, reference, wal)
        if self.core.recovered:
            log.info("replay recovered %d log records: %d groups held", self.core.recovered, len(self.core.store))
        self._ingest_limits = Limits(max_bytes=int(cfg.max_group_mb * MiB))
        self._ctx = zmq.Context()
        security = security or NetSecurity()
        try:
            self._ingest = self._router(int(4 * cfg.max_group_mb * MiB))
            self.ingest_endpoint = bind(self._ingest, ingest_addr, security)
            self._batch = self._router(CONTROL_LIMITS.max_bytes * 4)
            self.batch_endpoint = bind(self._batch, batch_addr, security)
        except BaseException:
            self._close()
            raise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._parked_batch: _Parked | None = None
        self._parked_tickets: dict[int, _Parked] = {}

    def _router(self, max_frame: int) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable peer is an error, not a silent drop
        sock.setsockopt(zmq.LINGER, 1000)
        # libzmq drops the connection of a peer sending a frame past this, before buffering it all:
        # a memory bound. Messages below it but over the protocol caps get an error reply instead.
        sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
        return sock

    # ----------------------------------------------------------------------------- running

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._ingest, zmq.POLLIN)
        poller.register(self._batch, zmq.POLLIN)
        log.info("replay serving: ingest %s, batch %s", self.ingest_endpoint, self.batch_endpoint)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms()))
                if self._ingest in events:
                    self._drain_ingest()
                if self._batch in events:
                    self._drain_batch()
                self._serve_parked()
        except OSError:
            log.critical("replay: write-ahead log write failed; stopping so state never runs ahead of the log")
            raise
        finally:
            self._close()

    def start_in_thread(self) -> threading.Thread:
        self._thread = threading.Thread(target=self.serve_forever, name="replay-service", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to finish (safe from any thread or a signal handler); waits for the thread if
        started with start_in_thread()."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _poll_ms(self) -> int:
        deadlines = [p.deadline for p in self._parked_tickets.values()]
        if self._parked_batch is not None:
            deadlines.append(self._parked_batch.deadline)
        wait = min([TICK_S, *(d - time.monotonic() for d in deadlines)])
        return max(0, int(wait * 1000))

    def _close(self) -> None:
        for name in ("_ingest", "_batch"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        stop_authenticator(self._ctx)
        self._ctx.term()
        if self.core.wal is not None:
            self.core.wal.close()

    def _send(self, sock: zmq.Socket, identity: bytes, msg: Message) -> None:
        try:
            sock.send_multipart([identity, *encode(msg)], copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # the peer stopped reading; it retries and gets the same answer again
            self.core.metrics.count("replies_dropped")
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self.core.metrics.count("replies_dropped")  # the peer is gone (reconnected or exited)

    def _recv(self, sock: zmq.Socket, limits: Limits) -> tuple[bytes, Message | ProtocolError] | None:
        """The next message on a socket, decoded, or the error that says why it is not a message."""
        try:
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        identity = frames[0].bytes
        try:
            return identity, decode(frames[1:], limits)
        except ProtocolError as e:
            self.core.metrics.count(f"rejected:{e.kind}")
            log.warning("replay: refused a message: %s", e)
            return identity, e

    # ----------------------------------------------------------------------------- actors

    def _drain_ingest(self) -> None:
        groups: list[tuple[bytes, RolloutGroup]] = []
        for _ in range(self.cfg.ingest_batch):
            received = self._recv(self._ingest, self._ingest_limits)
            if received is None:
                break
            identity, msg = received
            if isinstance(msg, RolloutGroup):
                groups.append((identity, msg))
                continue
            # Anything else waits for the groups before it: a ticket request must see them counted.
            self._commit(groups)
            groups = []
            if isinstance(msg, ProtocolError):
                self._send(self._ingest, identity, Ack([], "error", f"message refused: {msg}"))
            else:
                self._actor_request(identity, msg)
        self._commit(groups)

    def _commit(self, groups: list[tuple[bytes, RolloutGroup]]) -> None:
        if not groups:
            return
        verdicts = self.core.ingest([g for _, g in groups])
        acks: dict[tuple[bytes, str, str], list[tuple[int, int]]] = defaultdict(list)
        for (identity, _), verdict in zip(groups, verdicts, strict=True):
            acks[identity, verdict.status, verdict.error].append(verdict.group_id)
        for (identity, status, error), ids in acks.items():
            self._send(self._ingest, identity, Ack(ids, status, error))

    def _actor_request(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, TicketRequest):
            grant = self.core.tickets(msg)
            if grant.granted == 0 and msg.want > 0 and msg.wait_s > 0:
                self._parked_tickets[msg.actor_id] = _Parked(identity, msg, time.monotonic() + msg.wait_s)
            else:
                self._send(self._ingest, identity, grant)
        elif isinstance(msg, ResumeRequest):
            self._parked_tickets.pop(msg.actor_id, None)
            self._send(self._ingest, identity, self.core.resume(msg.actor_id))
        elif isinstance(msg, StatsRequest):
            self._send(self._ingest, identity, Stats(self.stats()))
        else:
            self._send(
                self._ingest,
                identity,
                ErrorReply(f"{type(msg).__name__} is not served on the ingest endpoint"),
            )

    # ----------------------------------------------------------------------------- learner

    def _drain_batch(self) -> None:
        while (received := self._recv(self._batch, CONTROL_LIMITS)) is not None:
            identity, msg = received
            if isinstance(msg, ProtocolError):
                self._send(self._batch, identity, ErrorReply(f"message refused: {msg}", msg.kind))
            elif isinstance(msg, BatchRequest):
                self._parked_batch = None  # a new request (or a retry) replaces a parked one
                before = self.core.version
                batch = self.core.request(msg)
                if self.core.version > before:
                    self._release_outdated_tickets()
                if batch is None:
                    self._parked_batch = _Parked(identity, msg, time.monotonic() + msg.wait_s)
                else:
                    self._send(self._batch, identity, batch)
            elif isinstance(msg, StatsRequest):
                self._send(self._batch, identity, Stats(self.stats()))
            elif isinstance(msg, Control):
                self._send(self._batch, identity, self._control(msg))
            else:
                self._send(
                    self._batch,
                    identity,
                    ErrorReply(f"{type(msg).__name__} is not served on the batch endpoint"),
                )

    def _control(self, msg: Control) -> ControlReply:
        if msg.command == "shutdown":
            self._stop.set()
            return ControlReply(True, "replay shutting down")
        if not msg.path:
            return ControlReply(False, f"{msg.command} needs a path")
        try:
            if msg.command == "snapshot":
                return ControlReply(True, self.core.snapshot(msg.path, msg.version))
            self._parked_batch = None  # a restore rewinds the learner: its old request is void
            return ControlReply(True, self.core.restore(msg.path))
        except (ReplayStateError, OSError, pa.ArrowException) as e:
            return ControlReply(False, f"{msg.command} failed: {e}")

    def _release_outdated_tickets(self) -> None:
        """The learner asked at a new version, so it has published those weights: answer now the parked
        ticket requests of actors on older weights that got nothing, so they fetch the new weights
        instead of waiting out their request (staleness would refuse them tickets until they do)."""
        for actor, parked in list(self._parked_tickets.items()):
            assert isinstance(parked.request, TicketRequest)
            if 0 <= parked.request.weights_version < self.core.version:
                del self._parked_tickets[actor]
                self._send(self._ingest, parked.identity, self.core.tickets(parked.request))

    def _serve_parked(self) -> None:
        now = time.monotonic()
        parked = self._parked_batch
        if parked is not None:
            assert isinstance(parked.request, BatchRequest)
            batch = self.core.serve(parked.request, final=now >= parked.deadline)
            if batch is not None:
                self._parked_batch = None
                self._send(self._batch, parked.identity, batch)
        for actor, parked in list(self._parked_tickets.items()):
            assert isinstance(parked.request, TicketRequest)
            grant = self.core.tickets(parked.request)
            if grant.granted or now >= parked.deadline:
                del self._parked_tickets[actor]
                self._send(self._ingest, parked.identity, grant)

    def stats(self) -> dict:
        stats = self.core.stats()
        stats["endpoints"] = {"ingest": self.ingest_endpoint, "batch": self.batch_endpoint}
        stats["parked"] = {"batch": self._parked_batch is not None, "tickets": len(self._parked_tickets)}
        return stats
