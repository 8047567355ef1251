"""Clients of the replay service: `RolloutSender` for actors, `ReplayClient` for the learner.

They live in the shared core because actors/ and learner/ may not import replay/. Both speak the
wire protocol over a DEALER socket that reconnects by itself; what they add is delivery:

- RolloutSender keeps every group until the replay acknowledges it, and resends whatever is not
  acknowledged when the connection is re-established (the replay restarted) or after
  `reply_timeout_s` without an answer. The replay drops duplicates, so each group is accepted
  exactly once. `send` never blocks unless `max_unacked` groups are waiting for acks.
- ReplayClient gives every batch request an id and repeats it until the batch arrives; the replay
  answers a repeated id with the same batch, so a lost reply costs time, not data. It speaks as the
  control identity (the CURVE control key, or the control token), which batch requests and commands
  need; snapshot paths travel as names relative to the replay's data directory.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from dph_async.net import NetSecurity, connect
from dph_async.protocol import (
    Ack,
    Batch,
    BatchRequest,
    Control,
    ControlReply,
    ErrorReply,
    Message,
    ProtocolError,
    ResumeInfo,
    ResumeRequest,
    RolloutGroup,
    Stats,
    StatsRequest,
    TicketGrant,
    TicketRequest,
    decode,
    encode,
)
from dph_async.replay_stats import ReplayStats

log = logging.getLogger(__name__)

_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class ReplayUnavailable(TimeoutError):
    """The replay did not answer in time, across reconnects and retries."""


class ReplayError(RuntimeError):
    """The replay answered, refusing the request; the message is its reason."""


# A group the replay defers ("retry": a budget is full) goes out again after this long, doubling while
# it stays full.
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 8.0

# A reply on the replay's local socket to a client of the same process: the message itself waits in
# the client's inbox, and this empty frame says so (an encoded message never starts with one).
LOCAL_REPLY = b""


class LocalInbox(NamedTuple):
    """What a client in the replay's own process is handed replies through: its routing id on the
    local socket, and the queue the replay appends the reply objects to."""

    routing_id: bytes
    replies: deque[Message]


class _Channel:
    """One DEALER connection to a replay endpoint, with its connection events."""

    def __init__(
        self,
        addr: str,
        security: NetSecurity | None,
        context: zmq.Context | None,
        on_connect: Callable[[], None] | None = None,
        identity: str = "client",
        inbox: LocalInbox | None = None,
    ):
        self.addr = addr
        self.sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.inbox = inbox
        if inbox is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, inbox.routing_id)
        # Not ZMQ_IMMEDIATE: with it libzmq drops the connection's pipe when the peer goes away,
        # and with the pipe any reply not yet read (the answer to "shutdown" was lost that way).
        # Without it, what is sent while the replay is down waits in the pipe (up to the
        # high-water mark) and goes out on reconnect; anything lost on the way is resent.
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)  # notice a dead peer even without a TCP reset
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        self.monitor = self.sock.get_monitor_socket(_EVENTS)
        self.on_connect = on_connect
        self.refused = ""  # why the last handshake failed (a CURVE key the replay does not accept)
        self._connected_once = False
        connect(self.sock, addr, security or NetSecurity(), identity)

    def events(self) -> bool:
        """Handle pending connection events; True if a connection was re-established. Not on the first:
        what was sent before it waited in the pipe and went out with it, and a request sent twice that
        takes longer than a poll to answer (a snapshot) is done twice, its second reply read as the next
        request's."""
        connected = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                connected, self.refused, self._connected_once = self._connected_once, "", True
            elif event & _FAILED:
                self.refused = f"handshake with {self.addr} refused (wrong or unauthorized CURVE key?)"
        if connected and self.on_connect is not None:
            self.on_connect()
        return connected

    def send(self, frames: list) -> bool:
        try:
            self.sock.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:  # the queue to the replay is full: the caller keeps the message and retries
            return False

    def recv(self, timeout_s: float) -> Message | None:
        """The next reply within timeout_s, or None. A reply that does not decode is logged and skipped."""
        if not self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            return None
        frames = self.sock.recv_multipart(copy=False)
        if self.inbox is not None and len(frames) == 1 and frames[0].bytes == LOCAL_REPLY:
            return self.inbox.replies.popleft()
        try:
            return decode(frames)
        except ProtocolError as e:
            log.error("reply from %s refused: %s", self.addr, e)
            return None

    def call(
        self,
        msg: Message,
        accept: Callable[[Message], bool],
        wait_s: float,
        timeout_s: float,
        reply_timeout_s: float,
        on_other: Callable[[Message], None] = lambda m: None,
    ) -> Message:
        """Send `msg` and return the first reply `accept`ed, resending it after a reconnect or when
        no answer came within wait_s + reply_timeout_s. Raises ReplayUnavailable after timeout_s."""
        frames = encode(msg)
        deadline = time.monotonic() + timeout_s
        sent_at = None
        while (now := time.monotonic()) < deadline:
            if self.events() or sent_at is None or now - sent_at > wait_s + reply_timeout_s:
                sent_at = now if self.send(frames) else None
            reply = self.recv(min(0.05, deadline - now))
            if reply is None:
                continue
            if isinstance(reply, ErrorReply):
                raise ReplayError(reply.error)
            if accept(reply):
                return reply
            on_other(reply)
        why = f": {self.refused}" if self.refused else ""
        raise ReplayUnavailable(
            f"no answer to {type(msg).__name__} from {self.addr} within {timeout_s:.0f}s{why}"
        )

    def close(self, linger_ms: int = 0) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


class RolloutSender:
    """An actor's connection to the replay's ingest endpoint.

    sender = RolloutSender("tcp://127.0.0.1:5555", actor_id=0, token=service.actor_token)
    done = sender.resume()                     # which shard positions are already accepted
    n = sender.tickets(want=16)                # admission: start at most n new prompts
    sender.send(group)                         # non-blocking; kept until acknowledged
    sender.flush(timeout_s=30); sender.close()
    """

    def __init__(
        self,
        addr: str,
        actor_id: int,
        security: NetSecurity | None = None,
        reply_timeout_s: float = 10.0,
        request_timeout_s: float = 300.0,
        max_unacked: int = 4096,
        context: zmq.Context | None = None,
        token: bytes = b"",
    ):
        """token: the replay's actor token (without CURVE): without it the actor is anonymous, granted
        tickets only from what is left once a batch of them is kept for the run's own actors. A str
        is the hex text `serve replay` keeps in actor.token (`Path.read_text()` of it)."""
        self.actor_id = actor_id
        # A str token was refused by the replay's decoder, and the request waited out request_timeout_s.
        self.token = token.strip().encode("ascii") if isinstance(token, str) else token
        self.reply_timeout_s = reply_timeout_s
        self.request_timeout_s = request_timeout_s
        self.max_unacked = max_unacked
        self._unacked: dict[tuple[int, int], list] = {}  # group id -> encoded frames, oldest first
        self._backlog: deque[tuple[int, int]] = deque()  # ids to (re)send
        self._last_progress = time.monotonic()
        self.held = 0  # tickets granted and not yet used by a send
        self._unclaimed = 0  # tickets granted to a request we had stopped waiting for (or never waited on)
        self._parked_until = 0.0  # a ticket request left parked at the replay may be answered until then
        self.accepted = 0
        self.duplicates = 0
        self.rejected: list[tuple[tuple[int, int] | None, str]] = []  # (group id or None, error)
        self.deferred = 0  # groups the replay answered "retry" (a budget was full), counted per answer
        self._retry_at: dict[tuple[int, int], float] = {}  # deferred group id -> when to send it again
        self._retry_delay_s = RETRY_FIRST_S / 2
        self._chan = _Channel(addr, security, context, on_connect=self._requeue)

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def _requeue(self) -> None:
        """After a (re)connect everything unacknowledged goes out again; the replay drops duplicates."""
        queued = set(self._backlog)
        self._backlog.extend(gid for gid in self._unacked if gid not in queued)
        self._retry_at.clear()
        self._last_progress = time.monotonic()

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Ack):
            if msg.status == "retry":
                self._defer(msg.group_ids, msg.error)
                return
            if msg.status == "error":
                self.rejected += [(gid, msg.error) for gid in msg.group_ids] or [(None, msg.error)]
                log.error("replay rejected %s: %s", msg.group_ids or "a message", msg.error)
            for gid in msg.group_ids:
                if self._unacked.pop(gid, None) is not None:
                    self.accepted += msg.status == "ok"
                    self.duplicates += msg.status == "duplicate"
                    self._retry_at.pop(gid, None)
            if msg.status == "ok":
                self._retry_delay_s = RETRY_FIRST_S / 2
            self._last_progress = time.monotonic()
        elif isinstance(msg, TicketGrant):
            self.held += msg.granted
            self._unclaimed += msg.granted
            self._parked_until = 0.0
        elif isinstance(msg, ErrorReply):
            log.error("replay error: %s", msg.error)

    def _defer(self, group_ids: list[tuple[int, int]], budget: str) -> None:
        """The replay's budget is full: send these again after a while (doubling while it stays full)."""
        self.deferred += len(group_ids)
        self._retry_delay_s = min(self._retry_delay_s * 2, RETRY_MAX_S)
        due = time.monotonic() + self._retry_delay_s
        for gid in group_ids:
            if gid in self._unacked:
                self._retry_at[gid] = due
        self._last_progress = time.monotonic()  # an answer: the replay is not silent
        log.info("replay deferred %d groups (%s full): resending in %.1fs", len(group_ids), budget,
                 self._retry_delay_s)

    def _requeue_due(self) -> None:
        now = time.monotonic()
        due = [gid for gid, t in self._retry_at.items() if t <= now]
        for gid in due:
            del self._retry_at[gid]
            self._backlog.append(gid)

    def poll(self, timeout_s: float = 0.0) -> None:
        """Send what is queued, take in the acks that arrived (waiting up to timeout_s for one), and
        resend everything unacknowledged if the replay has been silent for reply_timeout_s."""
        self._chan.events()
        if self._retry_at:
            self._requeue_due()
        while self._backlog:
            gid = self._backlog[0]
            if gid in self._unacked and not self._chan.send(self._unacked[gid]):
                break
            self._backlog.popleft()
        wait = timeout_s
        while (msg := self._chan.recv(wait)) is not None:
            self._handle(msg)
            wait = 0.0
        if self._unacked and time.monotonic() - self._last_progress > self.reply_timeout_s:
            log.warning(
                "replay silent for %.0fs: resending %d groups", self.reply_timeout_s, len(self._unacked)
            )
            self._requeue()

    def send(self, group: RolloutGroup) -> None:
        """Queue a group and send it without waiting (raises ProtocolError if it is malformed)."""
        frames = encode(group)
        while len(self._unacked) >= self.max_unacked:  # backpressure: the only time send waits
            self.poll(0.05)
        if not self._unacked:
            self._last_progress = time.monotonic()
        self._unacked[group.group_id] = frames
        self._backlog.append(group.group_id)
        self.held = max(0, self.held - 1)
        self.poll(0.0)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every sent group is acknowledged; False if some are not after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while self._unacked and time.monotonic() < deadline:
            self.poll(min(0.05, max(0.0, deadline - time.monotonic())))
        return not self._unacked

    def _call(self, msg: Message, reply_type: type, wait_s: float = 0.0) -> Any:
        return self._chan.call(
            msg,
            lambda m: isinstance(m, reply_type),
            wait_s,
            self.request_timeout_s,
            self.reply_timeout_s,
            on_other=self._handle,
        )

    def resume(self) -> ResumeInfo:
        """Which seqs of this actor are already accepted; voids tickets held from before."""
        info = self._call(ResumeRequest(self.actor_id, self.token), ResumeInfo)
        self.held = self._unclaimed = 0
        return info

    def tickets(self, want: int, wait_s: float = 0.0, weights_version: int = -1, block: bool = True) -> int:
        """Ask for up to `want` admission tickets, waiting up to wait_s for capacity; returns how
        many new prompts the actor may start (including tickets from earlier requests that arrived
        late). weights_version: the version the actor generates with.

        block=False (for an actor whose engine has work): never wait. Claim what was granted so far,
        and if no request is out, leave one parked at the replay for wait_s; the replay answers it as
        soon as it has capacity, and a later call claims the grant. One message per grant instead of
        a round trip per engine step."""
        self.poll(0.0)
        if self._unclaimed:
            claimed, self._unclaimed = min(self._unclaimed, want), max(0, self._unclaimed - want)
            return claimed
        request = TicketRequest(self.actor_id, want, self.held, weights_version, wait_s, self.token)
        if not block:
            if time.monotonic() >= self._parked_until and self._chan.send(encode(request)):
                # A lost answer (reconnect) is given up on a little after the replay would have sent it.
                self._parked_until = time.monotonic() + wait_s + self.reply_timeout_s
            return 0
        grant = self._call(request, TicketGrant, wait_s)
        self.held += grant.granted
        return grant.granted

    def close(self, flush_timeout_s: float = 0.0) -> None:
        """Flush (up to flush_timeout_s), give back unused tickets, and close."""
        if flush_timeout_s > 0:
            self.flush(flush_timeout_s)
        if self.held:
            self._chan.send(encode(TicketRequest(self.actor_id, 0, 0, token=self.token)))
        self._chan.close(linger_ms=200)


class ReplayClient:
    """The learner's connection to the replay's batch endpoint.

    token: the replay's control token (`ReplayService.control_token`, or the file
        `dph_async.net.control_token` reads); not needed with CURVE, where the client connects with
        the control key pair instead.
    data_dir: the replay's data directory as seen here, so `snapshot` and `restore` also take paths
        inside it (they travel as names relative to it).
    inbox: for a client in the replay's own process, on its local socket
        (`ReplayService.local_client`): replies are handed over as objects, not encoded.
    """

    def __init__(
        self,
        addr: str,
        security: NetSecurity | None = None,
        reply_timeout_s: float = 10.0,
        request_timeout_s: float = 600.0,
        context: zmq.Context | None = None,
        token: bytes = b"",
        data_dir: str | os.PathLike | None = None,
        inbox: LocalInbox | None = None,
    ):
        self.reply_timeout_s = reply_timeout_s
        self.request_timeout_s = request_timeout_s
        self.token = token
        self.data_dir = Path(data_dir).resolve() if data_dir is not None else None
        self._chan = _Channel(addr, security, context, identity="control", inbox=inbox)

    def _call(self, msg: Message, accept: Callable[[Message], bool], wait_s: float = 0.0) -> Any:
        return self._chan.call(msg, accept, wait_s, self.request_timeout_s, self.reply_timeout_s)

    def get_batch(self, version: int, num_groups: int, wait_s: float) -> Batch:
        """Fresh groups for the learner at `version` (optimizer steps applied), within about wait_s;
        fewer or none if not enough arrived. Also tells the replay that the previous batch arrived."""
        request_id = secrets.randbits(62) + 1
        request = BatchRequest(version, num_groups, wait_s, request_id, self.token)
        return self._call(request, lambda m: isinstance(m, Batch) and m.request_id == request_id, wait_s)

    def stats(self) -> ReplayStats:
        return self._call(StatsRequest(), lambda m: isinstance(m, Stats)).replay

    def _name(self, path: str | os.PathLike) -> str:
        """A snapshot path as its name relative to the replay's data directory."""
        p = Path(path)
        if not p.is_absolute():
            return str(p)
        if self.data_dir is None or not p.resolve().is_relative_to(self.data_dir):
            raise ValueError(f"{p} is not inside the replay's data directory ({self.data_dir})")
        return str(p.resolve().relative_to(self.data_dir))

    def _control(self, command: str, path: str | os.PathLike = "", version: int = -1, max_staleness: int = -1) -> str:
        name = self._name(path) if path else ""
        reply = self._call(Control(command, name, version, self.token, max_staleness),
                           lambda m: isinstance(m, ControlReply))
        if not reply.ok:
            raise ReplayError(reply.detail)
        return reply.detail

    def snapshot(self, path: str | os.PathLike, version: int = -1) -> str:
        """Have the replay write its whole state under `path` (a directory; a name relative to the
        replay's data directory, or a path inside it) for a checkpoint taken by the learner at
        `version`: the replay may have heard only of the previous version (its last batch request),
        and a restore measures what to rewind from the checkpoint's version."""
        return self._control("snapshot", path, version)

    def restore(self, path: str | os.PathLike) -> str:
        """Return the replay to a snapshot (see ReplayCore.restore for what is kept)."""
        return self._control("restore", path)

    def set_staleness(self, eta: int) -> str:
        """Set the replay's staleness bound (replay.max_staleness=auto; ReplayCore.set_max_staleness)."""
        return self._control("set_staleness", max_staleness=eta)

    def shutdown(self) -> None:
        self._control("shutdown")

    def close(self) -> None:
        self._chan.close()
