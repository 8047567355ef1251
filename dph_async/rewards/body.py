"""The scorer service's request bodies, parsed in killable child processes, never in the service.

    parser = BodyParser(processes=2, memory_limit_mb=1024, max_items=4096, timeout_s=10)
    budget_s, requests = parser.parse(body)     # or BodyRefused(code, error, detail)

Parsing a body costs time and memory the sender chooses: 60 MB of tiny items are 1.7 M objects (a
second of CPU holding the interpreter lock, and hundreds of MB kept afterwards), a ground truth of
nested `{}` builds gigabytes. So the service only reads the bytes; a child (`Child`, with an
address-space cap and a deadline) decodes the envelope with msgspec, skipping over each
ground_truth and extra_info without building them, refuses more than `max_items` requests, and
sends back compact (data_source, response, ground_truth JSON, extra_info JSON) records. The service
then holds at most `max_items` small records per batch, and ground truths are built only by the
reward worker that scores them, under its own memory limit.
"""

from __future__ import annotations

import json
import queue
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

import msgspec

from dph_async.rewards.child import Child, limit_resources
from dph_async.rewards.wire import ScoreBatch
from dph_async.rewards.worker import JsonText, ScoreRequest

MODULE = "dph_async.rewards.body"
STARTUP_TIMEOUT_S = 60.0


class Parsed(msgspec.Struct, array_like=True, tag=True):
    budget_s: float | None
    items: list[tuple[str, str, bytes, bytes]]


class Refusal(msgspec.Struct, array_like=True, tag=True):
    code: int
    error: str
    detail: str


@dataclass
class BodyRefused(Exception):
    """The body is not a batch the service will take: answer `code` with `error` and `detail`."""

    code: int
    error: str
    detail: str


def parse_batch(body: bytes, max_items: int) -> Parsed | Refusal:
    """In the child: the body's batch as compact records, or why it is refused."""
    try:
        batch = msgspec.json.decode(body, type=ScoreBatch)
    except msgspec.ValidationError as e:
        return Refusal(400, "bad_request", str(e)[:2000])
    except msgspec.DecodeError as e:
        return Refusal(400, "bad_request", f"body is not JSON: {e}"[:2000])
    except RecursionError:
        return Refusal(400, "bad_request", "body nested too deep (a ground_truth or extra_info deeper than "
                                           f"{sys.getrecursionlimit()} levels)")
    except MemoryError:
        return Refusal(413, "too_large", "body too large to parse within the parser's memory limit")
    if len(batch.requests) > max_items:
        return Refusal(413, "too_large", f"{len(batch.requests)} requests in one batch; the limit is {max_items}")
    items = [(r.data_source, r.response, bytes(r.ground_truth), bytes(r.extra_info)) for r in batch.requests]
    return Parsed(batch.budget_s, items)


def serve(conn: Connection, memory_limit_mb: int) -> None:
    """The child's loop: settings {"max_items"}, then one body in, one Parsed or Refusal out."""
    max_items = int(json.loads(conn.recv_bytes())["max_items"])
    limit_resources(memory_limit_mb)
    conn.send_bytes(b"ready")
    encoder = msgspec.msgpack.Encoder()
    while True:
        try:
            body = conn.recv_bytes()
        except EOFError:
            return
        try:
            reply = parse_batch(body, max_items)
        except MemoryError:
            reply = Refusal(413, "too_large", "body too large to parse within the parser's memory limit")
        del body
        conn.send_bytes(encoder.encode(reply))


class BodyParser:
    """`processes` parser children, each used by one caller at a time, restarted when killed."""

    def __init__(self, processes: int, memory_limit_mb: int, max_items: int, timeout_s: float) -> None:
        self.memory_limit_mb, self.max_items, self.timeout_s = memory_limit_mb, max_items, timeout_s
        self._children: queue.SimpleQueue[Child | None] = queue.SimpleQueue()
        for _ in range(processes):
            self._children.put(None)  # started on first use
        self._processes = processes
        self._decoder = msgspec.msgpack.Decoder(Parsed | Refusal)
        self.restarts = 0

    def warm_up(self) -> None:
        """Start every child now rather than on first use (a service does this before serving)."""
        children = [self._children.get() for _ in range(self._processes)]
        for child in children:
            try:
                child = child or self._start()
            except RuntimeError:
                child = None  # tried again on first use, where the failure becomes a 503
            self._children.put(child)

    def _start(self) -> Child:
        hello = json.dumps({"max_items": self.max_items}).encode()
        return Child(MODULE, self.memory_limit_mb, hello, STARTUP_TIMEOUT_S)

    def parse(self, body: bytes) -> tuple[float | None, list[ScoreRequest]]:
        """The batch's budget and requests; raises BodyRefused. Blocks: call it off the event loop."""
        child = self._children.get()
        try:
            if child is None:
                child = self._start()
            child.conn.send_bytes(body)
            raw = child.recv() if child.conn.poll(self.timeout_s) else None
            if raw is None:  # overran or died (memory): this body is the sender's problem
                child.kill()
                child = None
                self.restarts += 1
                raise BodyRefused(413, "too_large", f"body could not be parsed within {self.timeout_s:g} s and "
                                                    f"{self.memory_limit_mb} MB")
        except RuntimeError as e:  # the parser could not start: the service's problem
            raise BodyRefused(503, "unavailable", str(e)) from e
        finally:
            self._children.put(child)
        reply = self._decoder.decode(raw)
        if isinstance(reply, Refusal):
            raise BodyRefused(reply.code, reply.error, reply.detail)
        requests = [ScoreRequest(source, response, JsonText(truth), JsonText(extra))
                    for source, response, truth, extra in reply.items]
        return reply.budget_s, requests

    def close(self) -> None:
        for _ in range(self._processes):
            child = self._children.get()
            if child is not None:
                child.stop()


if __name__ == "__main__":
    # python -m dph_async.rewards.body <socket fd> <memory limit MB>
    # Run the package's copy of this module, not __main__'s, so pickled classes are the same ones.
    from dph_async.rewards.body import serve as _serve

    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]))
