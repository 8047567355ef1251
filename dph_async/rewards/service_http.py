"""Serving the scorer app over HTTP (uvicorn), with the limits a hostile peer needs.

uvicorn times out idle keep-alive connections, but not a client that never finishes its headers: a
connection that sends nothing, or a byte a second, is held for ever (200 of them held 20 s and more,
all open). `TimedH11Protocol` closes a connection whose request headers are not complete within
`header_timeout_s` of its opening or of the previous response; the app bounds the body
(`ServiceSettings.body_timeout_s`), and `limit_concurrency` bounds connections. One address may hold at
most `MAX_PER_CLIENT` of them (more are closed unanswered), so that one client cannot take every
connection the service allows and leave others nothing but 503.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from collections import Counter
from typing import ClassVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024
MAX_PER_CLIENT = 256


class TimedH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    max_per_client = MAX_PER_CLIENT
    clients: ClassVar[Counter[str]] = Counter()  # connections per address: one per server (see serve())

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        peer = transport.get_extra_info("peername")
        self._client: str | None = str(peer[0] if isinstance(peer, tuple) else peer)
        if self.clients[self._client] >= self.max_per_client:
            self._client = None
            transport.close()
            return
        self.clients[self._client] += 1
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_overdue)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request's headers are complete
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets the same time for its headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._client is not None:
            self.clients[self._client] -= 1
            if not self.clients[self._client]:
                del self.clients[self._client]
        super().connection_lost(exc)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 lets the OS choose (see `getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def serve(app: FastAPI, sock: socket.socket, header_timeout_s: float = HEADER_TIMEOUT_S,
          max_connections: int = MAX_CONNECTIONS) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM, then return: a requested stop is a clean exit."""
    # uvicorn shuts down gracefully on these signals, then re-raises each to the handler that was in
    # place before it ran; with the default ones the process would die of the signal (exit -15) after
    # a clean shutdown. Handlers that do nothing turn the re-raise into a return.
    if threading.current_thread() is threading.main_thread():  # uvicorn captures signals only there
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    protocol = type("Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s, "clients": Counter()})
    config = uvicorn.Config(app, http=protocol, log_level="warning", limit_concurrency=max_connections,
                            timeout_keep_alive=5)
    uvicorn.Server(config).run(sockets=[sock])
