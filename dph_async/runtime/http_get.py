"""One HTTP GET bounded in time and bytes, for asking an endpoint that may be hostile.

    status, body = http_get("http://127.0.0.1:40123/metrics", deadline=time.monotonic() + 3, max_bytes=8 << 20)

`deadline` is for the whole request: every socket operation waits only until it, so a server that
trickles a byte a second is cut off there (a per-read timeout would wait for ever). A body, declared
or sent, longer than `max_bytes` is refused once that many bytes have come, so a 300 MB answer costs
at most `max_bytes` of memory. h11 parses the answer (lengths, chunks, a header section bounded at
`MAX_HEADER_BYTES`). Any failure is a FetchError whose message says why in a few words.
"""

from __future__ import annotations

import socket
import ssl
import time
from urllib.parse import urlsplit

import h11

MAX_HEADER_BYTES = 16 << 10
_CHUNK = 64 << 10


class FetchError(Exception):
    """The GET gave no answer that can be used; the message says why."""


def _left(deadline: float, what: str) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchError(f"timeout: {what} not complete by the deadline")
    return left


def _connect(url: str, deadline: float) -> tuple[socket.socket, str, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchError(f"{url}: not an http:// or https:// URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    sock = socket.create_connection((parts.hostname, port), timeout=_left(deadline, "connect"))
    if parts.scheme == "https":
        sock = ssl.create_default_context().wrap_socket(sock, server_hostname=parts.hostname)
    return sock, parts.netloc, (parts.path or "/") + (f"?{parts.query}" if parts.query else "")


def http_get(url: str, *, deadline: float, max_bytes: int, headers: dict[str, str] | None = None
             ) -> tuple[int, bytes]:
    """(status code, body) of GET `url`, complete before `deadline` (time.monotonic()) and at most
    `max_bytes` long; FetchError otherwise. `headers`: sent besides Host, Connection and Accept-Encoding."""
    try:
        sock, host, target = _connect(url, deadline)
        with sock:
            return _exchange(sock, host, target, deadline, max_bytes, headers or {})
    except TimeoutError:  # socket.timeout, ssl's too
        raise FetchError("timeout: no complete answer by the deadline") from None
    except h11.ProtocolError as e:
        raise FetchError(f"not an HTTP answer: {e}") from None
    except OSError as e:  # refused, reset, unreachable, TLS
        raise FetchError(f"{type(e).__name__}: {e.strerror or e}") from None
    except ValueError as e:  # an URL from a stranger's announce file: port past 65535, bad IPv6, a label IDNA refuses
        raise FetchError(f"{url}: not a usable URL: {e}") from None


def _exchange(sock: socket.socket, host: str, target: str, deadline: float, max_bytes: int,
              headers: dict[str, str]) -> tuple[int, bytes]:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEADER_BYTES)
    request = h11.Request(method="GET", target=target,
                          headers=[("Host", host), ("Connection", "close"), ("Accept-Encoding", "identity"),
                                   *headers.items()])
    sock.settimeout(_left(deadline, "request"))
    sock.sendall(conn.send(request) + conn.send(h11.EndOfMessage()))
    status, body = 0, bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            sock.settimeout(_left(deadline, "answer"))
            conn.receive_data(sock.recv(_CHUNK))
        elif isinstance(event, h11.Response):
            status = event.status_code
            declared = dict(event.headers).get(b"content-length")
            if declared is not None and int(declared) > max_bytes:
                raise FetchError(f"answer of {int(declared)} bytes refused: more than {max_bytes}")
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_bytes:
                raise FetchError(f"answer refused: more than {max_bytes} bytes")
        elif isinstance(event, h11.EndOfMessage):
            return status, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            raise FetchError("the connection closed before the answer was complete")
