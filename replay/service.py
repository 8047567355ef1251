"""The replay service: ReplayCore behind three ZeroMQ ROUTER sockets, driven by one thread.

    ingest endpoint (actors, DEALER):   RolloutGroup -> Ack, TicketRequest -> TicketGrant,
                                        ResumeRequest -> ResumeInfo, StatsRequest -> Stats
    batch endpoint (learner, DEALER):   BatchRequest -> Batch, Control -> ControlReply (both from
                                        the control identity only), StatsRequest -> Stats
    local batch endpoint (inproc):      the same, for a learner in this process (`local_client`)

Runs as its own process (`dph-async serve replay`) or in a thread of the learner's process
(`start_in_thread()`), same code. There, the learner takes its batches through an inproc socket of
the service's own context: no network and no gate between them (through the gate, a batch's
hundreds of frames crossed the gate's process twice, on the learner's critical path). Ingest is
group-committed: every group that arrived together is logged with one write, then all are
acknowledged. Every peer is assumed hostile
(docs/data_plane.md, "Hostile peers"): messages are read within each endpoint's limits
(dph_async/receive.py); one that is refused is answered with an error Ack (ingest) or ErrorReply
(batch), counted under refused, logged within a rate limit, and nothing else changes. Batch requests
and control commands are obeyed only from the control identity, and snapshots stay inside the data
directory. Batch and ticket requests that cannot be answered yet are parked, within per-connection
and overall limits, until they can or their wait ends. A failed log write stops the service
(fail-stop): its state must never run ahead of its log.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import secrets
import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import zmq

from dph_async.config.replay import ReplayConfig
from dph_async.gate import READ_AHEAD, Gate, HonestLoad
from dph_async.net import CurveKeys, NetSecurity, bind, curve_keys, stop_authenticator
from dph_async.protocol import (
    Ack,
    Batch,
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
    encode,
)
from dph_async.receive import Received, guard, receive
from dph_async.refusals import RefusalLog
from dph_async.replay.core import ReplayCore
from dph_async.replay.reference_pool import ReferencePool
from dph_async.replay.state import ReplayStateError
from dph_async.replay.wal import WriteAheadLog
from dph_async.replay_client import LOCAL_REPLY, LocalInbox, ReplayClient
from dph_async.replay_stats import ReplayStats

log = logging.getLogger(__name__)
MiB = 1 << 20
# The learner's requests and commands are small: nothing larger is read on the batch endpoint.
BATCH_LIMITS = Limits(
    max_bytes=64 * 1024,
    max_header_bytes=64 * 1024,
    max_frames=0,
    accept=frozenset({BatchRequest, StatsRequest, Control}),
)
# An honest actor whose groups outgrow the limits learns which settings hold them.
_LIMIT_HINT = " (the replay's limits: replay.max_group_mb, replay.max_header_kb, replay.max_frames)"
# Wake at least this often to answer parked requests at their deadline and to notice stop().
TICK_S = 0.05


def ingest_limits(cfg: ReplayConfig) -> Limits:
    return Limits(
        max_bytes=int(cfg.max_group_mb * MiB),
        max_header_bytes=int(cfg.max_header_kb * 1024),
        max_frames=cfg.max_frames,
        accept=frozenset({RolloutGroup, TicketRequest, ResumeRequest, StatsRequest}),
    )


class ControlPathError(ValueError):
    """A snapshot name that is absolute, leaves the data directory or points into the log."""


def resolve_name(data_dir: Path, name: str, wal_dir: Path | None = None) -> Path:
    """A snapshot name from the wire as a path inside `data_dir` (symbolic links followed), or
    ControlPathError: names never reach the filesystem as given."""
    root = data_dir.resolve()
    if not name or Path(name).is_absolute():
        raise ControlPathError(f"snapshot name {name[:200]!r} must be a relative name inside the data directory")
    if "\0" in name:  # os.path.realpath raises ValueError on it, which ended the service
        raise ControlPathError(f"snapshot name {name[:200]!r} holds a NUL byte")
    target = (root / name).resolve()
    if target == root or not target.is_relative_to(root):
        raise ControlPathError(f"snapshot name {name[:200]!r} leaves the data directory")
    if wal_dir is not None and target.is_relative_to(wal_dir.resolve()):
        raise ControlPathError(f"snapshot name {name[:200]!r} points into the write-ahead log")
    return target


def _read_only(batch: Batch) -> Batch:
    """A batch handed over in process, its arrays read-only as decoded ones are: they are the replay's
    own (a group may be served again, or written to a snapshot), so a write must fail, not reach them."""
    for item in (*batch.groups, *(c for g in batch.groups for c in g.completions), *batch.reference):
        for name, _ in item.ARRAYS:
            getattr(item, name).flags.writeable = False
    return batch


@dataclass
class _Parked:
    peer: bytes
    request: BatchRequest | TicketRequest
    deadline: float
    sock: zmq.Socket | None = None  # where a batch request came from (the batch or the local socket)
    arrived: float = 0.0  # time.monotonic() when the request came (a batch's waited_s)
    cycle_s: float = 0.0  # a batch request's time since the previous batch was answered


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
        data_dir: str | None = None,
        control_token: bytes | None = None,
        actor_token: bytes | None = None,
    ):
        """wal_dir: the log directory, already resolved against the run directory (None: no log, a
        restart loses everything). data_dir: where snapshots are written and read (a Control names
        them relative to it; None: snapshot and restore are refused). control_token: what a batch
        request or command must carry without CURVE (None: a random one, `self.control_token`, for
        whoever starts the service to hand to the learner's client). actor_token: what the run's
        actors' ticket requests carry without CURVE (None: a random one, `self.actor_token`); a request
        without it is anonymous and is never granted the last batch of tickets. Port 0 in a tcp address picks
        a free port; see the *_endpoint attributes for what was bound."""
        self.cfg = cfg
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.wal_dir = Path(wal_dir) if wal_dir is not None else None
        self.control_token = control_token if control_token is not None else secrets.token_bytes(32)
        self.actor_token = actor_token if actor_token is not None else secrets.token_bytes(32)
        # An empty token would trust every request that carries none; a str one fails the first
        # comparison in the service's thread; the same for both hands the actors the control.
        for name, token in (("control_token", self.control_token), ("actor_token", self.actor_token)):
            if not isinstance(token, bytes) or len(token) < 16:
                size = f" of {len(token)}" if isinstance(token, bytes) else ""
                raise ValueError(f"ReplayService: {name} must be bytes, at least 16 of them (got {type(token).__name__}"
                                 f"{size})")
        if hmac.compare_digest(self.control_token, self.actor_token):
            raise ValueError("ReplayService: the actor token must not be the control token (actors would "
                             "command the replay); remove one of the token files to make a new one")
        self._actor_token_text = self.actor_token.hex().encode()
        reference = ReferencePool.load(reference_path, seed, cfg.logprob_tolerance) if reference_path else None
        wal = WriteAheadLog(wal_dir, cfg.wal_fsync, int(cfg.wal_segment_mb * MiB)) if wal_dir else None
        self.core = ReplayCore(cfg, groups_per_batch, reference, wal)
        if self.core.recovered:
            log.info("replay recovered %d log records: %d groups held", self.core.recovered, len(self.core.store))
        self._ingest_limits = ingest_limits(cfg)
        security = security or NetSecurity()
        self._keys: CurveKeys | None = curve_keys(security.curve_keys) if security.curve_keys else None
        self._refusals = RefusalLog(log, cfg.refusal_log_per_min)
        self._ctx = zmq.Context()
        self._gate: Gate | None = None
        self._gate_dropped = 0  # the gate's count of undelivered replies, as last added to ours
        # What honest actors could make the gate hold (READ_AHEAD + 1 groups each: two read ahead and
        # one in libzmq's decoder); warned about when it passes the gate's memory.
        self._gate_load = HonestLoad(security.gate_memory_mb, READ_AHEAD + 1, "actors sending groups")
        try:
            if security.gate:
                security.require_gate_room(cfg.max_group_mb, "replay.max_group_mb")
                self._gate, (self._ingest, self._batch) = Gate.open(
                    self._ctx, [(ingest_addr, self._ingest_limits), (batch_addr, BATCH_LIMITS)], security,
                    cfg.peer_timeout_s, cfg.queue_per_peer)  # fmt: skip
                self.ingest_endpoint, self.batch_endpoint = self._gate.endpoints
            else:
                self._ingest = self._router(self._ingest_limits)
                self.ingest_endpoint = bind(self._ingest, ingest_addr, security)
                self._batch = self._router(BATCH_LIMITS)
                self.batch_endpoint = bind(self._batch, batch_addr, security)
            # Reachable only from this process (inproc, this context): no hostile peer, so no gate;
            # requests still carry the control token.
            self._local = self._router(BATCH_LIMITS)
            self.local_batch_endpoint = f"inproc://replay-batch-{secrets.token_hex(8)}"
            self._local.bind(self.local_batch_endpoint)
        except BaseException:
            self._close()
            raise
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._parked_batch: _Parked | None = None
        self._last_batch_sent: float | None = None  # time.monotonic() of the latest batch answer
        # Ticket requests waiting for capacity, oldest first, keyed by (connection, actor id): a
        # repeated request replaces its predecessor, and no connection holds more than its share.
        self._parked_tickets: dict[tuple[bytes, int], _Parked] = {}
        self._parked_per_peer: Counter[bytes] = Counter()
        self._inboxes: dict[bytes, LocalInbox] = {}  # local_client()'s, by routing id on the local socket

    def _router(self, limits: Limits) -> zmq.Socket:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unreachable peer is an error, not a silent drop
        sock.setsockopt(zmq.LINGER, 1000)
        guard(sock, limits, self.cfg.peer_timeout_s, self.cfg.queue_per_peer)
        return sock

    def _watch_gate(self) -> None:
        """Start another gate if this one died (a peer exhausted its memory); count the replies it
        could not deliver with those this process could not send."""
        if self._gate is None:
            return
        if (code := self._gate.revive()) is not None:
            self.core.metrics.count("gate_restarts")
            self._refusals.refused(f"the gate process ended (status {code}); another was started")
        if (dropped := self._gate.replies_dropped) > self._gate_dropped:
            self.core.metrics.count("replies_dropped", dropped - self._gate_dropped)
            self._gate_dropped = dropped

    # ----------------------------------------------------------------------------- running

    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self._ingest, zmq.POLLIN)
        poller.register(self._batch, zmq.POLLIN)
        poller.register(self._local, zmq.POLLIN)
        log.info("replay serving: ingest %s, batch %s", self.ingest_endpoint, self.batch_endpoint)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_ms()))
                if self._ingest in events:
                    self._drain_ingest()
                if self._batch in events:
                    self._drain_batch(self._batch)
                if self._local in events:
                    self._drain_batch(self._local)
                self._serve_parked()
                self._watch_gate()
                self._refusals.tick()
        except OSError:
            log.critical("replay: write-ahead log write failed; stopping so state never runs ahead of the log")
            raise
        finally:
            self._close()

    def local_client(self) -> ReplayClient:
        """The learner's client in this process, on the local socket (no network, no gate), with the
        control token and this service's data directory. Its replies are handed over as objects
        through its inbox, not encoded (a batch's groups are the replay's own, read-only arrays
        included). Close it before the service stops: the service's context waits for its sockets."""
        inbox = LocalInbox(secrets.token_bytes(16), deque())
        self._inboxes[inbox.routing_id] = inbox
        return ReplayClient(self.local_batch_endpoint, token=self.control_token, context=self._ctx,
                            data_dir=self.data_dir, inbox=inbox)

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
        for name in ("_ingest", "_batch", "_local"):
            sock = getattr(self, name, None)
            if sock is not None:
                sock.close()
        stop_authenticator(self._ctx)
        self._ctx.term()  # waits (LINGER) until the last replies are with the gate
        if self._gate is not None:
            self._gate.close()
        if self.core.wal is not None:
            self.core.wal.close()

    def _send(self, sock: zmq.Socket, peer: bytes, msg: Message) -> None:
        # A client of this process on the local socket takes the reply object from its inbox: no
        # encode and decode, nor hundreds of frames for a batch.
        inbox = self._inboxes.get(peer) if sock is self._local else None
        if inbox is not None:
            inbox.replies.append(_read_only(msg) if isinstance(msg, Batch) else msg)
        try:
            sock.send_multipart([peer, LOCAL_REPLY] if inbox else [peer, *encode(msg)], copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if inbox is not None:
                inbox.replies.pop()  # no word of it went out: the client will not look for it
            if not isinstance(e, zmq.Again) and e.errno != zmq.EHOSTUNREACH:
                raise
            # zmq.Again: the peer stopped reading (it retries and gets the same answer again);
            # EHOSTUNREACH: the peer is gone (reconnected or exited)
            self.core.metrics.count("replies_dropped")

    def _refuse(self, kind: str, detail: str) -> None:
        self.core.metrics.count(f"rejected:{kind}")
        self._refusals.refused(detail)

    def _recv(self, sock: zmq.Socket, limits: Limits) -> Received | None:
        """The next message on a socket, or the ProtocolError that says why it is not one (counted)."""
        outside = sock is not self._local
        received = receive(sock, limits, curve=outside and self._keys is not None,
                           gated=outside and self._gate is not None)
        if received is None:
            return None
        if outside and self._keys is not None and not self._keys.allows(received.user_id):
            # A key removed from authorized/ while its connection stayed open.
            received.message = ProtocolError("unauthorized", "the sender's CURVE key is no longer authorized")
        if isinstance(received.message, ProtocolError):
            self._refuse(received.message.kind, str(received.message))
        return received

    # ----------------------------------------------------------------------------- actors

    def _drain_ingest(self) -> None:
        groups: list[tuple[bytes, RolloutGroup]] = []
        for _ in range(self.cfg.ingest_batch):
            received = self._recv(self._ingest, self._ingest_limits)
            if received is None:
                break
            msg = received.message
            if isinstance(msg, RolloutGroup):
                groups.append((received.peer, msg))
                continue
            # Anything else waits for the groups before it: a ticket request must see them counted.
            self._commit(groups)
            groups = []
            if isinstance(msg, ProtocolError):
                hint = _LIMIT_HINT if msg.kind in ("size", "frames") else ""
                self._send(self._ingest, received.peer, Ack([], "error", f"message refused: {msg}{hint}"))
            else:
                self._actor_request(received.peer, msg)
        self._commit(groups)

    def _commit(self, groups: list[tuple[bytes, RolloutGroup]]) -> None:
        if not groups:
            return
        verdicts = self.core.ingest([g for _, g in groups])
        acks: dict[tuple[bytes, str, str], list[tuple[int, int]]] = defaultdict(list)
        for (peer, group), verdict in zip(groups, verdicts, strict=True):
            acks[peer, verdict.status, verdict.error].append(verdict.group_id)
            if verdict.status == "error":
                self._refusals.refused(f"group {verdict.group_id} of actor {group.actor_id}: {verdict.error}")
            if self._gate is not None and verdict.status == "ok" and (
                    warning := self._gate_load.saw(group.actor_id, group.nbytes)):  # fmt: skip
                log.warning("replay: %s", warning)
        for (peer, status, error), ids in acks.items():
            self._send(self._ingest, peer, Ack(ids, status, error))

    def _trusted(self, msg: TicketRequest | ResumeRequest) -> bool:
        """Whether an actor's request comes from the run's own actors: with CURVE, every key the
        replay lets in is one; without, the request carries the actor token."""
        # The file `serve replay` keeps holds the token in hex: its text, as read, is accepted too.
        return (self._keys is not None or hmac.compare_digest(msg.token, self.actor_token)
                or hmac.compare_digest(msg.token.strip(), self._actor_token_text))

    def _actor_request(self, peer: bytes, msg: Message) -> None:
        if isinstance(msg, TicketRequest):
            grant = self.core.tickets(msg, self._trusted(msg))
            if grant.granted == 0 and msg.want > 0 and msg.wait_s > 0 and self._park_ticket(peer, msg):
                return
            self._send(self._ingest, peer, grant)
        elif isinstance(msg, ResumeRequest):
            self._unpark_ticket((peer, msg.actor_id))
            self._send(self._ingest, peer, self.core.resume(msg.actor_id, self._trusted(msg)))
        else:
            assert isinstance(msg, StatsRequest)  # the ingest limits accept nothing else
            self._send(self._ingest, peer, Stats(self.stats()))

    def _park_ticket(self, peer: bytes, msg: TicketRequest) -> bool:
        """Hold a ticket request until capacity frees up or its wait ends; False if the limits say to
        answer it now (too many parked in all, or from this connection)."""
        key = (peer, msg.actor_id)
        replacing = key in self._parked_tickets
        if not replacing and (
            len(self._parked_tickets) >= self.cfg.max_parked
            or self._parked_per_peer[peer] >= self.cfg.max_parked_per_peer
        ):
            self.core.metrics.count("tickets_not_parked")
            return False
        self._unpark_ticket(key)
        self._parked_tickets[key] = _Parked(peer, msg, time.monotonic() + msg.wait_s)
        self._parked_per_peer[peer] += 1
        return True

    def _unpark_ticket(self, key: tuple[bytes, int]) -> None:
        if self._parked_tickets.pop(key, None) is not None:
            self._parked_per_peer[key[0]] -= 1
            if not self._parked_per_peer[key[0]]:
                del self._parked_per_peer[key[0]]

    # ----------------------------------------------------------------------------- learner

    def _authorized(self, received: Received, msg: BatchRequest | Control, local: bool) -> bool:
        """Whether a batch request or command comes from the control identity: the CURVE control
        key, or without CURVE (and always on the local socket, which has no CURVE) the control token."""
        if self._keys is not None and not local:
            return self._keys.is_control(received.user_id)
        return hmac.compare_digest(msg.token, self.control_token)

    def _drain_batch(self, sock: zmq.Socket) -> None:
        """Requests on the batch socket or the local one; each is answered on the socket it came on."""
        while (received := self._recv(sock, BATCH_LIMITS)) is not None:
            peer, msg = received.peer, received.message
            if isinstance(msg, ProtocolError):
                self._send(sock, peer, ErrorReply(f"message refused: {msg}", msg.kind))
            elif isinstance(msg, StatsRequest):
                self._send(sock, peer, Stats(self.stats()))
            elif not self._authorized(received, msg, local=sock is self._local):
                what = f"Control {msg.command!r}" if isinstance(msg, Control) else "BatchRequest"
                self._refuse("unauthorized", f"{what} from a peer without the control identity")
                self._send(sock, peer, ErrorReply(f"{what} needs the control identity", "unauthorized"))
            elif isinstance(msg, BatchRequest):
                self._parked_batch = None  # a new request (or a retry) replaces a parked one
                now = time.monotonic()
                cycle_s = 0.0 if self._last_batch_sent is None else now - self._last_batch_sent
                before = self.core.version
                batch = self.core.request(msg)
                if self.core.version > before:
                    self._release_outdated_tickets()
                if batch is None:
                    self._parked_batch = _Parked(peer, msg, now + msg.wait_s, sock, now, cycle_s)
                else:
                    self._send_batch(sock, peer, batch, 0.0, cycle_s)
            else:
                self._send(sock, peer, self._control(msg))

    def _send_batch(self, sock: zmq.Socket, peer: bytes, batch: Batch, waited_s: float, cycle_s: float) -> None:
        """Answer a batch request, with how long it waited and the learner's time since the last answer."""
        batch.waited_s, batch.cycle_s = waited_s, cycle_s
        self._send(sock, peer, batch)
        self._last_batch_sent = time.monotonic()

    def _control(self, msg: Control) -> ControlReply:
        if msg.command == "shutdown":
            self._stop.set()
            return ControlReply(True, "replay shutting down")
        if msg.command == "set_staleness":
            try:
                return ControlReply(True, self.core.set_max_staleness(msg.max_staleness))
            except ValueError as e:
                return ControlReply(False, f"set_staleness refused: {e}")
        if self.data_dir is None:
            return ControlReply(False, f"{msg.command} refused: this replay has no data directory")
        try:
            path = resolve_name(self.data_dir, msg.path, self.wal_dir)
            if msg.command == "snapshot":
                return ControlReply(True, self.core.snapshot(path, msg.version))
            self._parked_batch = None  # a restore rewinds the learner: its old request is void
            return ControlReply(True, self.core.restore(path))
        except ControlPathError as e:
            self._refuse("path", str(e))
            return ControlReply(False, f"{msg.command} refused: {e}")
        except (ReplayStateError, OSError, pa.ArrowException) as e:
            return ControlReply(False, f"{msg.command} failed: {e}")

    def _release_outdated_tickets(self) -> None:
        """The learner asked at a new version, so it has published those weights: answer now the parked
        ticket requests of actors on older weights that got nothing, so they fetch the new weights
        instead of waiting out their request (staleness would refuse them tickets until they do)."""
        for key, parked in list(self._parked_tickets.items()):
            assert isinstance(parked.request, TicketRequest)
            if 0 <= parked.request.weights_version < self.core.version:
                self._unpark_ticket(key)
                self._send(self._ingest, parked.peer, self.core.tickets(parked.request, self._trusted(parked.request)))

    def _serve_parked(self) -> None:
        now = time.monotonic()
        parked = self._parked_batch
        if parked is not None:
            assert isinstance(parked.request, BatchRequest)
            batch = self.core.serve(parked.request, final=now >= parked.deadline)
            if batch is not None:
                self._parked_batch = None
                self._send_batch(parked.sock, parked.peer, batch, now - parked.arrived, parked.cycle_s)
        # Each check is O(1) and the parked requests are bounded (replay.max_parked), so a crowd of
        # them costs little; with no capacity left, only the expired ones are looked at.
        open_capacity = self.core.admission.capacity(self.core.version, self.core.admitted) > 0
        for key, parked in list(self._parked_tickets.items()):
            if not open_capacity and now < parked.deadline:
                continue
            assert isinstance(parked.request, TicketRequest)
            grant = self.core.tickets(parked.request, self._trusted(parked.request))
            if grant.granted or now >= parked.deadline:
                self._unpark_ticket(key)
                self._send(self._ingest, parked.peer, grant)

    def stats(self) -> ReplayStats:
        stats = self.core.stats()
        stats.refused = dataclasses.replace(
            stats.refused, logged=self._refusals.logged, unlogged=self._refusals.unlogged
        )
        stats.tickets.parked = len(self._parked_tickets)
        stats.ingest_endpoint, stats.batch_endpoint = self.ingest_endpoint, self.batch_endpoint
        stats.batch_parked = self._parked_batch is not None
        if self._gate is not None:
            stats.gate_memory_mb = self._gate_load.limit_mb
            stats.gate_memory_needed_mb = self._gate_load.needed_bytes / MiB
        return stats
