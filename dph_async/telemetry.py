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
the standard library (64 KiB, 100 headers), a client has `CLIENT_TIMEOUT_S` to send them, and at most
`MAX_CLIENTS` connections are served at once (more are closed unanswered).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dph_async.config import NetConfig

CLIENT_TIMEOUT_S = 5.0
MAX_CLIENTS = 16


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


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.clients = threading.BoundedSemaphore(MAX_CLIENTS)
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:  # type: ignore[override]
        if not self.clients.acquire(blocking=False):  # too many at once: close, do not queue
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.clients.release()


class MetricsEndpoint:
    """An HTTP server thread answering /health (JSON from `health()`) and /metrics (from `registry`)."""

    def __init__(self, name: str, registry: CollectorRegistry, health: Callable[[], dict],
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.name = name
        self.announced: Path | None = None  # the file announce() wrote

        class Handler(BaseHTTPRequestHandler):
            timeout = CLIENT_TIMEOUT_S  # for the request line and headers of a slow client

            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)
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

        self._server = _Server((host, port), Handler)
        bound_host, bound_port = self._server.server_address[:2]
        self.url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"metrics-{name}", daemon=True)
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
    `directory`. Port: the OS's choice when `net.metrics_port` is 0, else metrics_port + offset."""
    if not net.metrics:
        return None
    registry = process_registry()
    for collector in collectors:
        registry.register(collector)
    port = 0 if net.metrics_port == 0 else net.metrics_port + offset
    endpoint = MetricsEndpoint(name, registry, health, net.metrics_host, port)
    endpoint.announce(directory)
    return endpoint
