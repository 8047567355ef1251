"""Which connections an HTTP service serves when it cannot serve them all: the run's own clients first,
then every connection alike. Shared by the /health and /metrics endpoints (`dph_async/metrics_endpoint.py`)
and the scorer (`dph_async/rewards/service_http.py`).

On one machine every client is 127.0.0.1, so an address tells nothing about who asks: a connection
is the unit, and a credential (the run's token as "Authorization: Bearer <token>") marks the run's
own clients.

    connections = Connections(limit=16, reserved=4)
    ticket = connections.open(close=shut)      # on accept; None: every slot is in use
    if not connections.serve(ticket, authorized(token, request_authorization)):
        ...                                     # answer 503 and close
    connections.idle(ticket)                    # a keep-alive connection's response went out
    connections.close(ticket)                   # however it ends (idempotent)

The rules: at most `limit` connections are open. A connection is *waiting* from its opening, and
after each response, until its request's headers are in; when every slot is taken, a new connection
closes the one that has waited longest (a waiting connection holds nothing its client cannot send
again, and an honest client sends its headers at once). A request with the credential is served; an
anonymous one only while fewer than `limit - reserved` anonymous requests are being served, so the
last `reserved` slots are always the run's own or waiting (and so free for the run's own to take).
"""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable

WAITING, ANONYMOUS, TRUSTED, CLOSED = "waiting", "anonymous", "trusted", "closed"


def authorized(token: str | None, authorization: str | bytes | None) -> bool:
    """Whether an Authorization header carries `token` (never, without a token). Constant time."""
    if not token or authorization is None:
        return False
    # http.server decodes headers as latin-1: encoding them back gives the bytes the client sent.
    given = authorization.encode("latin-1", "replace") if isinstance(authorization, str) else authorization
    return hmac.compare_digest(given, f"Bearer {token}".encode())


def bearer(token: str | None) -> dict[str, str]:
    """The header a client sends to be served as the run's own (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


class Ticket:
    """One open connection: how to close it, and what it is doing."""

    __slots__ = ("close", "state")

    def __init__(self, close: Callable[[], None]) -> None:
        self.close, self.state = close, WAITING


class Connections:
    """The connections of one server (thread-safe: the telemetry server accepts and serves on
    different threads)."""

    def __init__(self, limit: int, reserved: int) -> None:
        if not 0 <= reserved < limit:
            raise ValueError(f"reserved connections ({reserved}) must be at least 0 and fewer than the limit ({limit})")
        self.limit, self.reserved = limit, reserved
        self._lock = threading.Lock()
        self._waiting: dict[Ticket, None] = {}  # in the order they began to wait: the first is the oldest
        self.open_count = self.anonymous = 0

    def open(self, close: Callable[[], None]) -> Ticket | None:
        """A new connection's ticket, or None (close it unanswered) when every slot is served."""
        with self._lock:
            oldest = None
            if self.open_count >= self.limit:
                if not self._waiting:
                    return None
                oldest = next(iter(self._waiting))
                self._end(oldest)
            ticket = Ticket(close)
            self._waiting[ticket] = None
            self.open_count += 1
        if oldest is not None:
            oldest.close()  # outside the lock: closing may call back into close()
        return ticket

    def serve(self, ticket: Ticket, trusted: bool) -> bool:
        """Whether to serve the request whose headers just arrived on `ticket`'s connection."""
        with self._lock:
            if ticket.state == CLOSED:
                return False
            if ticket.state == WAITING:
                if not trusted and self.anonymous >= self.limit - self.reserved:
                    return False
                del self._waiting[ticket]
                ticket.state = TRUSTED if trusted else ANONYMOUS
                self.anonymous += not trusted
            return True  # a connection that showed the credential once keeps it: it is the same peer

    def idle(self, ticket: Ticket) -> None:
        """The response went out and the connection stays open: an anonymous one waits again."""
        with self._lock:
            if ticket.state == ANONYMOUS:
                self.anonymous -= 1
                ticket.state = WAITING
                self._waiting[ticket] = None

    def close(self, ticket: Ticket) -> None:
        with self._lock:
            self._end(ticket)

    def _end(self, ticket: Ticket) -> None:
        if ticket.state == CLOSED:
            return
        self._waiting.pop(ticket, None)
        self.anonymous -= ticket.state == ANONYMOUS
        self.open_count -= 1
        ticket.state = CLOSED
