"""Serving the scorer app over HTTP (uvicorn), with the limits a hostile peer needs.

uvicorn times out idle keep-alive connections, but not a client that never finishes its headers: a
connection that sends nothing, or a byte a second, is held for ever (200 of them held 20 s and more,
all open). `TimedH11Protocol` closes a connection whose request headers are not complete within
`header_timeout_s` of its opening or of the previous response; the app bounds the body
(`ServiceSettings.body_timeout_s`). Connections are admitted as `dph_async.admission` says, per
connection and per credential, never per address (on one machine every client is 127.0.0.1): at most
`MAX_CONNECTIONS` open, a new one closing the one that has waited longest for its headers when all are
taken, and `RESERVED` of them kept for requests carrying the token; an anonymous request beyond the
rest is answered 503 with Retry-After.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from typing import ClassVar

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from dph_async.admission import Connections, authorized

HEADER_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024
RESERVED = 64
_BUSY = b'{"error": "overloaded", "detail": "every connection for anonymous clients is serving; retry later"}'


class TimedH11Protocol(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S
    admission: ClassVar[Connections]  # of one server: each server() makes its own subclass
    token: ClassVar[str | None] = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._ticket = self.admission.open(close=transport.close)
        if self._ticket is None:  # every connection is serving a request
            transport.close()
            return
        app = self.app
        self.app = lambda scope, receive, send: self._admitted(app, scope, receive, send)
        self._arm()

    async def _admitted(self, app, scope, receive, send) -> None:
        """Run `app` for a request this connection may be served for; else 503 and close."""
        trusted = authorized(self.token, dict(scope["headers"]).get(b"authorization"))
        if self._ticket is not None and self.admission.serve(self._ticket, trusted):
            await app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                                (b"connection", b"close"), (b"content-length", str(len(_BUSY)).encode())]})
        await send({"type": "http.response.body", "body": _BUSY})

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
        if self._ticket is not None:
            self.admission.idle(self._ticket)
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets the same time for its headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._ticket is not None:
            self.admission.close(self._ticket)
        super().connection_lost(exc)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 lets the OS choose (see `getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def server(app: FastAPI, header_timeout_s: float = HEADER_TIMEOUT_S, max_connections: int = MAX_CONNECTIONS,
           reserved: int = RESERVED, token: str | None = None) -> uvicorn.Server:
    """A uvicorn server for `app` with these limits (run it with `.run(sockets=[sock])`). token: what a
    request's "Authorization: Bearer" carries to use the `reserved` connections."""
    protocol = type("Protocol", (TimedH11Protocol,), {"header_timeout_s": header_timeout_s, "token": token,
                                                     "admission": Connections(max_connections, reserved)})
    # No limit_concurrency: uvicorn's answers 503 to everyone, the run's own clients too, once the
    # connections reach it; the protocol's admission holds the connections instead.
    config = uvicorn.Config(app, http=protocol, log_level="warning", timeout_keep_alive=5)
    return uvicorn.Server(config)


def serve(app: FastAPI, sock: socket.socket, header_timeout_s: float = HEADER_TIMEOUT_S,
          max_connections: int = MAX_CONNECTIONS, token: str | None = None) -> None:
    """Serve `app` on `sock` until SIGINT/SIGTERM, then return: a requested stop is a clean exit."""
    # uvicorn shuts down gracefully on these signals, then re-raises each to the handler that was in
    # place before it ran; with the default ones the process would die of the signal (exit -15) after
    # a clean shutdown. Handlers that do nothing turn the re-raise into a return.
    if threading.current_thread() is threading.main_thread():  # uvicorn captures signals only there
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    server(app, header_timeout_s, max_connections, token=token).run(sockets=[sock])
