"""A gate in front of a service's ROUTER sockets: the one process whose memory a peer can grow.

libzmq hands over a multipart message only once its last frame has arrived, and bounds only each
frame (ZMQ_MAXMSGSIZE): a peer that sends frame after frame and never the last makes the process
that reads its socket hold them all. The gate takes that exposure out of the service. It is a
process of its own that binds the service's public endpoints (with the service's CURVE keys and
peer limits), reads each message, keeps no more of it than the endpoint's limits could accept, and
passes it to the service over a private ipc socket with the sender's routing id and CURVE key in
front; the service's replies come back the same way. The service still checks every message it
is given (dph_async/receive.py): what the gate cut short arrives too long in frames or bytes and is
refused as it would have been whole.

The gate runs under RLIMIT_DATA (its size at start plus `memory_mb`). A peer that floods it makes
its allocations fail: libzmq then drops that peer or aborts the process. The service polls its gate
and starts another on the same endpoints (`Gate.revive`); honest peers reconnect by themselves and
resend what was not acknowledged. Wire between the two, per endpoint:

    gate -> service   [routing id, CURVE key (z85, b"" without CURVE), header, arrays...]
    service -> gate   [routing id, reply frames...]

A reply the gate cannot deliver (its peer gone or not reading) is dropped and counted in a mapped
file beside the sockets (`Gate.replies_dropped`), which outlives a gate that is started again.

The directory holds a file the service keeps locked (flock) while it lives. A service and gate
killed together remove nothing; the next gate opened by this user removes every such directory
whose lock nobody holds (`sweep`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import mmap
import os
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import zmq

from dph_async.net import NetSecurity, bind, check_bind, stop_authenticator
from dph_async.protocol import Limits, MiB
from dph_async.receive import guard

log = logging.getLogger(__name__)

# Messages the gate holds for the service before it stops reading peers (backpressure).
INNER_HWM = 4
# Messages the gate reads ahead from each peer. 2, not 1: at 1, libzmq 4.3.5 never delivered the
# first message of a CURVE connection.
READ_AHEAD = 2
# Messages moved each way per wake-up.
BURST = 64
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 3.0
# How often the gate looks up from its sockets to see whether its service is still there, and the
# service whether its gate is.
PARENT_CHECK_MS = 200
CHECK_S = 0.2
# After a restart that failed (the port taken meanwhile): the next try, not a process a look.
RETRY_S = 5.0
# Once told to stop: how long to wait for more of the service's last replies (they were sent before
# the gate was told), and to send them on.
REPLY_DRAIN_MS = 50
REPLY_LINGER_MS = 500
# The gate's exit status when its link to the service broke: libzmq closes a link whose message it
# could not allocate (a reply larger than the memory left), and a gate that cannot reach its service
# must end so that the service starts another.
LINK_LOST = 3
PREFIX = "dph-gate-"
LOCK = "lock"  # held by the service while it lives (its kernel lock ends with the process, however it ends)


class GateError(OSError):
    """The gate process could not start (an address in use, unreadable keys, ...)."""


@dataclass(frozen=True)
class Route:
    """One endpoint: the public address peers reach, the service's private ipc address, and the
    endpoint's limits (bytes of a whole message, header bytes, array frames)."""

    public: str
    inner: str
    max_bytes: int
    max_header_bytes: int
    max_frames: int

    @classmethod
    def of(cls, public: str, inner: str, limits: Limits) -> Route:
        return cls(public, inner, limits.max_bytes, limits.max_header_bytes, limits.max_frames)


@dataclass(frozen=True)
class GateSpec:
    """What a gate process is told on its command line (as JSON)."""

    routes: list[Route]
    peer_timeout_s: float
    memory_mb: float
    reply_queue: int = 1000  # libzmq's default SNDHWM
    curve_keys: str | None = None
    insecure: bool = False
    parent_pid: int = field(default_factory=os.getpid)
    # A file of one little-endian uint64: replies the gate could not deliver (the peer gone, or not
    # reading), kept across restarts for the service to read.
    dropped_path: str = ""


class Counter:
    """A count in a file of one little-endian uint64, mapped: the gate writes it, the service reads it."""

    def __init__(self, path: str):
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 8)

    @property
    def value(self) -> int:
        return int.from_bytes(self._map[:8], "little")

    @value.setter
    def value(self, n: int) -> None:
        self._map[:8] = n.to_bytes(8, "little")


class HonestLoad:
    """What peers that behave could make a gate hold at once, from what the service has seen: `per_peer`
    of the largest message from each peer seen within WINDOW_S, plus INNER_HWM in transit. A gate
    with less memory drops honest peers when they all send at once (they resend, as under a flood),
    so the service warns, naming the setting: once, then each time the need doubles."""

    WINDOW_S = 600.0  # a peer that went quiet (or reconnected under another id) stops counting
    MAX_PEERS = 1 << 16  # a bound on what the record of peers may hold

    def __init__(self, limit_mb: float, per_peer: int, what: str):
        self.limit_mb = limit_mb
        self.per_peer = per_peer
        self.what = what
        self.largest = 0
        self._seen: dict[object, float] = {}  # peer -> when last seen, oldest first
        self._warned = 0

    @property
    def peers(self) -> int:
        return len(self._seen)

    @property
    def needed_bytes(self) -> int:
        return (self.per_peer * len(self._seen) + INNER_HWM) * self.largest

    def saw(self, peer: object, nbytes: int, now: float | None = None) -> str | None:
        """Count a message of `nbytes` from (or to) `peer`; returns a warning when the gate is too small."""
        now = time.monotonic() if now is None else now
        self._seen.pop(peer, None)
        self._seen[peer] = now
        while len(self._seen) > self.MAX_PEERS or next(iter(self._seen.values())) < now - self.WINDOW_S:
            del self._seen[next(iter(self._seen))]
        self.largest = max(self.largest, nbytes)
        need = self.needed_bytes
        if need <= self.limit_mb * MiB or need < 2 * self._warned:
            return None
        self._warned = need
        return (f"net.gate_memory_mb ({self.limit_mb:g}) is less than the {need / MiB:.0f} MB that {self.peers} "
                f"{self.what} of up to {self.largest / MiB:.2f} MB could make the gate hold at once ({self.per_peer} "
                f"per peer, {INNER_HWM} in transit): sent together, they are dropped and sent again; set "
                f"net.gate_memory_mb to at least {need / MiB:.0f}")


class Gate:
    """The service's handle on its gate process: start it, start another if it died, stop it."""

    def __init__(self, spec: GateSpec, directory: Path):
        self.spec = spec
        self.directory = directory
        self.endpoints: list[str] = []
        self._proc: subprocess.Popen | None = None
        self._checked = 0.0
        self._ended: int | None = None  # how the last gate ended while none runs (a start failed)
        self._closed = False
        self._lock = threading.Lock()  # revive (the service's thread) against close (any thread)
        self._dropped = Counter(spec.dropped_path) if spec.dropped_path else None
        self._lock_fd: int | None = None

    @classmethod
    def open(cls, ctx: zmq.Context, endpoints: list[tuple[str, Limits]], security: NetSecurity, peer_timeout_s: float,
             queue: int, reply_queue: int = 1000) -> tuple[Gate, list[zmq.Socket]]:  # fmt: skip
        """The service's side of a gate: for each (public address, limits) a DEALER socket bound in a
        new directory only this user can enter, and the gate bound to the public addresses in front
        of them. The gate reads READ_AHEAD messages ahead per peer; queue: messages the service's socket
        holds from the gate (all peers together); reply_queue: replies the gate holds per peer.
        Returns the gate (see `endpoints`) and the sockets, in the order given."""
        for addr, _ in endpoints:
            check_bind(addr, security)  # here, so a refusal is the same error as without a gate
        sweep()
        directory = Path(tempfile.mkdtemp(prefix=PREFIX))
        dropped = directory / "dropped"
        dropped.write_bytes(bytes(8))
        keys = str(Path(security.curve_keys).resolve()) if security.curve_keys is not None else None
        gate = cls(GateSpec([], peer_timeout_s, security.gate_memory_mb, reply_queue, keys,
                            security.insecure, dropped_path=str(dropped)), directory)  # fmt: skip
        gate._lock_fd = _hold_lock(directory)
        socks: list[zmq.Socket] = []
        try:
            for i, (addr, limits) in enumerate(endpoints):
                sock = ctx.socket(zmq.DEALER)  # its one peer is the gate; messages carry the routing id
                socks.append(sock)
                sock.setsockopt(zmq.LINGER, 1000)
                guard(sock, limits, peer_timeout_s, queue)
                inner = f"ipc://{directory / str(i)}"
                sock.bind(inner)
                gate.spec.routes.append(Route.of(addr, inner, limits))
            gate.start()
        except BaseException:
            for sock in socks:
                sock.close(0)
            gate.close()
            raise
        return gate, socks

    def start(self) -> list[str]:
        """Start the gate; returns the public endpoints it bound (a tcp port 0 resolved). A restart
        binds the same endpoints again, so peers reconnect to where they were."""
        spec = self.spec
        if self.endpoints:
            routes = [replace(r, public=e) for r, e in zip(spec.routes, self.endpoints, strict=True)]
            spec = replace(spec, routes=routes)
        # Its errors go to this process's stderr; its one line of stdout says where it listens.
        proc = subprocess.Popen([sys.executable, "-m", "dph_async.gate", json.dumps(asdict(spec))],
                                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)  # fmt: skip
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        answer = json.loads(proc.stdout.readline() or "null") if ready else None
        if not isinstance(answer, list):
            proc.kill()
            proc.wait()
            proc.stdout.close()
            why = answer["error"] if isinstance(answer, dict) else f"no answer (exit status {proc.returncode})"
            raise GateError(f"the gate process could not start: {why}")
        self._proc = proc
        self.endpoints = answer
        return self.endpoints

    def revive(self) -> int | None:
        """If the gate has ended (a peer exhausted its memory, or its link to the service broke), start
        another on the same endpoints and return how the last one ended (exit status; minus the signal
        number if killed). A start that fails (the port taken meanwhile) is logged and tried again
        RETRY_S later. Looks at most every CHECK_S; None when nothing was started."""
        now = time.monotonic()
        if now - self._checked < CHECK_S:
            return None
        self._checked = now
        with self._lock:
            if self._closed:
                return None
            if self._proc is not None:
                if (code := self._proc.poll()) is None:
                    return None
                self._stop()
                self._ended = code
            try:
                self.start()
            except GateError as e:
                log.error("%s; trying again in %g s", e, RETRY_S)
                self._checked = time.monotonic() + RETRY_S - CHECK_S
                return None
            code, self._ended = self._ended, None
            return code

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def replies_dropped(self) -> int:
        """Replies the gate could not deliver since it was opened (all its processes)."""
        return self._dropped.value if self._dropped is not None else 0

    def stop(self) -> None:
        """End the gate once it has passed on the replies it holds (the service's answer to a
        shutdown command among them); kill it if it takes longer than STOP_TIMEOUT_S."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()

    def close(self) -> None:
        """Stop the gate and remove its directory (call after closing the service's sockets, so their
        last replies reach it first). No gate is started after this."""
        with self._lock:
            self._closed = True
            self._stop()
        shutil.rmtree(self.directory, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _hold_lock(directory: Path) -> int:
    """Lock a new file and only then give it the name `sweep` looks for, so that a sweep running
    meanwhile never finds this directory's lock free."""
    fd = os.open(directory / f"{LOCK}.new", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(directory / f"{LOCK}.new", directory / LOCK)
    return fd


def sweep(parent: str | None = None) -> list[Path]:
    """Remove the gate directories of this user under `parent` (the temporary directory) whose service
    has died: their lock is free. Directories of other users, without a lock file (being made), or
    whose lock is held are left alone. Returns those removed."""
    removed = []
    uid = os.getuid()
    for directory in Path(parent or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            st = directory.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:
                continue
            fd = os.open(directory / LOCK, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its service lives
        else:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
        finally:
            os.close(fd)
    return removed


# ------------------------------------------------------------------------------ the gate process


def _forward(front: zmq.Socket, back: zmq.Socket, route: Route, curve: bool) -> None:
    """Pass one message from a peer to the service: the routing id, the CURVE key, and the frames
    the endpoint's limits could accept plus one (header and arrays up to max_frames + 1 array
    frames, bytes until the first frame past max_bytes); the rest is read and dropped."""
    first = front.recv(zmq.NOBLOCK, copy=False)
    out: list = [first.bytes, b""]
    total, frame = 0, first
    while frame.more:
        frame = front.recv(copy=False)
        if curve and len(out) == 2:
            out[1] = frame.get("User-Id").encode("ascii")
        if len(out) - 2 <= route.max_frames + 1 and total <= route.max_bytes:
            out.append(frame)
            total += len(frame)
    back.send_multipart(out, copy=False)


def _reply(back: zmq.Socket, front: zmq.Socket, dropped: Counter) -> None:
    frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
    try:
        front.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
    except zmq.ZMQError as e:  # the peer stopped reading or is gone: the service's answer is lost
        if e.errno not in (zmq.EAGAIN, zmq.EHOSTUNREACH):
            raise
        dropped.value += 1


def _pump(front: zmq.Socket, back: zmq.Socket, route: Route, curve: bool, dropped: Counter) -> None:
    """Up to BURST replies to peers, then up to BURST messages to the service while it takes them."""
    with contextlib.suppress(zmq.Again):
        for _ in range(BURST):
            _reply(back, front, dropped)
    with contextlib.suppress(zmq.Again):
        for _ in range(BURST):
            if not back.get(zmq.EVENTS) & zmq.POLLOUT:
                break
            _forward(front, back, route, curve)


def _limit_memory(memory_mb: float) -> None:
    """RLIMIT_DATA at the process's data size now plus memory_mb."""
    status = Path("/proc/self/status").read_text().splitlines()
    data_kb = next(int(line.split()[1]) for line in status if line.startswith("VmData:"))
    limit = data_kb * 1024 + int(memory_mb * (1 << 20))
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def _open(ctx: zmq.Context, spec: GateSpec, pairs: list[tuple[zmq.Socket, zmq.Socket, Route]]) -> list[str]:
    """Bind each route's public ROUTER and connect its DEALER to the service (appended to `pairs`);
    returns the bound endpoints."""
    security = NetSecurity(curve_keys=spec.curve_keys, insecure=spec.insecure)
    endpoints = []
    for route in spec.routes:
        front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        pairs.append((front, back, route))
        front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        front.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.SNDHWM, spec.reply_queue)  # replies a peer does not read are dropped past it
        # READ_AHEAD messages per peer, not the service's queue_per_peer: while the service is slow
        # the rest waits in the peer's TCP stream, not in the gate's memory.
        guard(front, Limits(route.max_bytes, route.max_header_bytes, route.max_frames), spec.peer_timeout_s,
              READ_AHEAD)  # fmt: skip
        try:
            endpoints.append(bind(front, route.public, security))
        except zmq.ZMQError as e:
            raise GateError(f"{route.public}: {e}") from None
        back.setsockopt(zmq.LINGER, 0)
        back.setsockopt(zmq.SNDHWM, INNER_HWM)
        back.connect(route.inner)
    return endpoints


def serve(spec: GateSpec) -> int:
    """The gate process: bind, say where (one JSON line on stdout: the endpoints, or {"error": ...}),
    then move messages until the service that started it is gone or its link to it breaks (returns
    LINK_LOST, else 0)."""
    # Ctrl-C reaches the service's whole process group; the service decides when its gate stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    curve = spec.curve_keys is not None
    lost = False
    monitors: list[zmq.Socket] = []
    dropped = Counter(spec.dropped_path)
    ctx = zmq.Context()
    pairs: list[tuple[zmq.Socket, zmq.Socket, Route]] = []
    poller = zmq.Poller()
    try:
        try:
            endpoints = _open(ctx, spec, pairs)
        except (OSError, ValueError) as e:
            print(json.dumps({"error": str(e)}), flush=True)
            return 0
        monitors += [back.get_monitor_socket(zmq.EVENT_DISCONNECTED) for _, back, _ in pairs]
        for monitor in monitors:
            poller.register(monitor, zmq.POLLIN)
        _limit_memory(spec.memory_mb)
        stopping = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stopping.set())
        print(json.dumps(endpoints), flush=True)
        while os.getppid() == spec.parent_pid and not stopping.is_set() and not lost:
            # Peers are read only while the service takes what they send: a slow service slows them.
            for front, back, _ in pairs:
                writable = bool(back.get(zmq.EVENTS) & zmq.POLLOUT)
                poller.register(front, zmq.POLLIN if writable else 0)
                poller.register(back, zmq.POLLIN if writable else zmq.POLLIN | zmq.POLLOUT)
            if events := dict(poller.poll(PARENT_CHECK_MS)):
                lost = any(monitor in events for monitor in monitors)
                for front, back, route in pairs:
                    _pump(front, back, route, curve, dropped)
        # Told to stop: the service's last replies are passed on, and given time to leave. One wait
        # for all routes: a wait per route made every run's end wait REPLY_DRAIN_MS for each.
        drain = zmq.Poller()
        for _, back, _ in pairs:
            drain.register(back, zmq.POLLIN)
        while events := dict(drain.poll(REPLY_DRAIN_MS)):
            for front, back, _ in pairs:
                if back in events:
                    _reply(back, front, dropped)
        for front, _, _ in pairs:
            front.setsockopt(zmq.LINGER, REPLY_LINGER_MS)
    finally:
        for monitor in monitors:
            monitor.close(0)
        for front, back, _ in pairs:
            front.close()
            back.close()
        stop_authenticator(ctx)
        ctx.term()
    if os.getppid() != spec.parent_pid:  # the service died without closing: its directory goes too
        for route in spec.routes:
            shutil.rmtree(Path(route.inner.removeprefix("ipc://")).parent, ignore_errors=True)
    return LINK_LOST if lost else 0


def main() -> None:
    raw = json.loads(sys.argv[1])
    raw["routes"] = [Route(**r) for r in raw["routes"]]
    sys.exit(serve(GateSpec(**raw)))


if __name__ == "__main__":
    main()
