"""Health and Prometheus metrics of a long-running process over HTTP: GET /health and GET /metrics.

    registry = process_registry()                       # RSS, open fds, threads, CPU of this process
    registry.register(MyCollector(...))                 # the process's own numbers, read at each scrape
    endpoint = MetricsEndpoint("learner", registry, health=lambda: {"version": 3}, host="127.0.0.1", port=0)
    endpoint.announce(run_dir / "endpoints")            # <run_dir>/endpoints/learner.json: where to find it
    ...
    endpoint.close()

Every long-running process (replay, learner, actors, scorer) serves one; `dph-async status` reads them.
The endpoint binds loopback by default and lets the OS choose the port; the announce file says which.
It only answers GETs of those two paths: no body is read, a request's line and headers are bounded by
the standard library (64 KiB, 100 headers), and a connection has `CLIENT_TIMEOUT_S` in all to send them
(a deadline for the whole request, not for each read). Connections are admitted as `dph_async.admission`
says: at most `MAX_CLIENTS` open, a new one closing the one that has waited longest for its headers
when all are taken, and `RESERVED` of them kept for requests carrying the run's access token
(`ACCESS_TOKEN_FILE` beside the announce files, which `dph-async status` sends); anonymous requests
beyond the rest get 503. /metrics is rendered at most once per `RENDER_INTERVAL_S`
(`CachedExposition`): a scrape loop costs the process bytes sent, not collections of its numbers.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dph_async.admission import Connections, Ticket, authorized
from dph_async.config import NetConfig
from dph_async.net import read_secret, secret_file

CLIENT_TIMEOUT_S = 5.0
MAX_CLIENTS = 16
RESERVED = 4
# Beside the announce files; grants nothing but the reserved connections of read-only endpoints.
ACCESS_TOKEN_FILE = "access.token"
RENDER_INTERVAL_S = 1.0
# How often the server thread looks at close()'s request: close() waits up to this long. socketserver's
# default (0.5 s) was most of a short run's end (two endpoints in the learner, one per actor).
SHUTDOWN_POLL_S = 0.05


class ThreadsCollector(Collector):
    """process_threads: threads of this process (ProcessCollector reports memory, fds and CPU)."""

    def collect(self) -> Iterator[Metric]:
        threads = threading.active_count()
        try:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith("Threads:"):
                    threads = int(line.split()[1])  # also the threads of native libraries
        except OSError:
            pass
        yield GaugeMetricFamily("process_threads", "Threads of this process", value=threads)


def process_registry() -> CollectorRegistry:
    """A registry with this process's resource metrics: process_resident_memory_bytes,
    process_open_fds, process_threads, process_cpu_seconds_total, ..."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    registry.register(ThreadsCollector())
    return registry


class CachedExposition:
    """A registry's Prometheus text, rendered at most once per `interval_s`; scrapes in between get the
    last rendering. Collecting reads every number of the process (the replay's stats, the learner's
    metrics): at the rate of a scrape loop it took 0.9 of a core and slowed the replay's acks 5x."""

    def __init__(self, registry: CollectorRegistry, interval_s: float = RENDER_INTERVAL_S) -> None:
        self.registry, self.interval_s = registry, interval_s
        self._lock = threading.Lock()  # concurrent scrapes wait for one rendering
        self._text, self._rendered_at = b"", -math.inf

    def text(self) -> bytes:
        with self._lock:
            now = time.monotonic()
            if now - self._rendered_at >= self.interval_s:
                self._text, self._rendered_at = generate_latest(self.registry), now
            return self._text


class _DeadlineReader(io.RawIOBase):
    """A socket's bytes until a deadline for the whole request: a client sending a byte every few
    seconds is cut off like a silent one (a timeout per read would hold its slot for ever)."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock, self._deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not received within {CLIENT_TIMEOUT_S:g} s")
        self._sock.settimeout(left)
        return self._sock.recv_into(buffer)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.connections = Connections(MAX_CLIENTS, RESERVED)
        self.tickets: dict[socket.socket, Ticket] = {}  # by the connection's socket, for its handler
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:  # type: ignore[override]
        ticket = self.connections.open(close=lambda: _shut(request))
        if ticket is None:  # every slot is serving a request: close, do not queue
            self.shutdown_request(request)
            return
        self.tickets[request] = ticket
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connections.close(self.tickets.pop(request))

    def handle_error(self, request, client_address) -> None:  # type: ignore[override]
        """A client that hung up or was cut off is no error of the process's: socketserver would print
        a traceback to stderr for each, a log any client could flood."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def _shut(sock: socket.socket) -> None:
    """End a connection from another thread: its handler's read returns at once, and it closes."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class MetricsEndpoint:
    """An HTTP server thread answering /health (JSON from `health()`) and /metrics (from `registry`)."""

    def __init__(self, name: str, registry: CollectorRegistry, health: Callable[[], dict],
                 host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        """token: what a request's "Authorization: Bearer" must carry to use the reserved connections."""
        self.name = name
        self.announced: Path | None = None  # the file announce() wrote
        exposition = CachedExposition(registry)

        class Handler(BaseHTTPRequestHandler):
            def setup(self) -> None:
                super().setup()
                self.rfile.close()
                self.rfile = io.BufferedReader(_DeadlineReader(self.connection, time.monotonic() + CLIENT_TIMEOUT_S))

            def do_GET(self) -> None:
                trusted = authorized(token, self.headers.get("Authorization"))
                if not server.connections.serve(server.tickets[self.request], trusted):
                    self.close_connection = True
                    self._reply(503, b"too many requests being served; retry\n", "text/plain")
                elif self.path == "/metrics":
                    self._reply(200, exposition.text(), CONTENT_TYPE_LATEST)
                elif self.path == "/health":
                    try:
                        body = {"status": "ok", "name": name, "pid": os.getpid(), **health()}
                        code = 200
                    except Exception as e:  # the process is unwell: say so rather than not answer
                        body, code = {"status": "error", "name": name, "detail": f"{type(e).__name__}: {e}"}, 503
                    self._reply(code, json.dumps(body).encode(), "application/json")
                else:
                    self._reply(404, b"GET /health or /metrics\n", "text/plain")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # no line per scrape
                pass

        self._server = server = _Server((host, port), Handler)
        bound_host, bound_port = self._server.server_address[:2]
        self.url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": SHUTDOWN_POLL_S},
                                        name=f"metrics-{name}", daemon=True)
        self._thread.start()

    def announce(self, directory: Path) -> Path:
        """Write `<directory>/<name>.json` ({"name", "url", "pid"}) for `dph-async status` to find."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.name}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"name": self.name, "url": self.url, "pid": os.getpid()}))
        tmp.replace(path)
        self.announced = path
        return path

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def start_endpoint(name: str, collectors: list[Collector], health: Callable[[], dict], net: NetConfig,
                   offset: int, directory: Path) -> MetricsEndpoint | None:
    """Serve a process's metrics as `net` says (None when `net.metrics` is off) and announce the URL in
    `directory`, beside the run's access token (made by the first endpoint). Port: the OS's choice when
    `net.metrics_port` is 0, else metrics_port + offset."""
    if not net.metrics:
        return None
    registry = process_registry()
    for collector in collectors:
        registry.register(collector)
    port = 0 if net.metrics_port == 0 else net.metrics_port + offset
    token = secret_file(directory / ACCESS_TOKEN_FILE).hex()
    endpoint = MetricsEndpoint(name, registry, health, net.metrics_host, port, token)
    endpoint.announce(directory)
    return endpoint


def access_token(directory: Path) -> str | None:
    """The access token of the endpoints announced in `directory`, for a reader such as `status`; None
    when there is none or it is not one (the reader is then served as anyone else)."""
    try:
        token = read_secret(directory / ACCESS_TOKEN_FILE)
    except (OSError, ValueError):
        return None
    return None if token is None else token.hex()
