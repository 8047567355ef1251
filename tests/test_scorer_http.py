"""The scorer's HTTP server: under greedy local clients (every one of them 127.0.0.1), admission per
connection and per credential (dph_async/admission.py, dph_async/rewards/service_http.py) and bytes taken
as they arrive (dph_async/rewards/service.py); and its API fuzzed against its own OpenAPI schema
(schemathesis). Servers run in a thread of the test, on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from dph_async.config.rewards import RewardConfig
from dph_async.rewards.service import MiB, ServiceSettings, make_app
from dph_async.rewards.service_http import bind, server

TOKEN = "t0k3n-of-the-run"
WAIT_S = 30.0  # the most any poll below waits: a bound, not an expectation


@contextlib.contextmanager
def running(app: FastAPI, **limits) -> Iterator[str]:
    sock = bind("127.0.0.1", 0)
    srv = server(app, **limits)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_for(lambda: srv.started, "the server started")
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(WAIT_S)
        sock.close()


def wait_for(condition, what: str):
    deadline = time.monotonic() + WAIT_S
    while not (value := condition()):
        assert time.monotonic() < deadline, f"still not {what} after {WAIT_S:g} s"
        time.sleep(0.02)
    return value


def slow_app() -> tuple[FastAPI, dict]:
    """GET /slow holds its connection until state["release"] is set; GET /fast answers at once."""
    app, state = FastAPI(), {"inside": 0, "release": False}

    @app.get("/slow")
    async def slow() -> dict:
        state["inside"] += 1
        deadline = time.monotonic() + WAIT_S
        while not state["release"] and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return {"slow": True}

    @app.get("/fast")
    async def fast() -> dict:
        return {"fast": True}

    return app, state


def test_anonymous_requests_beyond_their_share_wait_and_the_run_s_own_are_served():
    """8 connections, 2 reserved: 6 anonymous requests in service take every anonymous slot. The 7th
    anonymous request is answered 503 with Retry-After; a request with the token is served, also when
    idle connections fill the rest (the one waiting longest is closed to make room). Answered, the six
    keep-alive connections wait again and hold no anonymous slot."""
    app, state = slow_app()
    with running(app, max_connections=8, reserved=2, token=TOKEN) as url:
        replies: list[int] = []
        clients = [httpx.Client(timeout=WAIT_S) for _ in range(6)]  # kept open after their answers
        threads = [threading.Thread(target=lambda c=c: replies.append(c.get(f"{url}/slow").status_code))
                   for c in clients]
        for t in threads:
            t.start()
        wait_for(lambda: state["inside"] == 6, "six anonymous requests in service")
        anonymous = httpx.get(f"{url}/fast", timeout=WAIT_S)
        assert anonymous.status_code == 503 and anonymous.headers["retry-after"] == "1"
        assert anonymous.json()["error"] == "overloaded"
        idle = [socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1]))) for _ in range(4)]
        try:
            for _ in range(3):
                own = httpx.get(f"{url}/fast", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=WAIT_S)
                assert own.status_code == 200 and own.json() == {"fast": True}
            wrong = httpx.get(f"{url}/fast", headers={"Authorization": "Bearer guess"}, timeout=WAIT_S)
            assert wrong.status_code == 503
        finally:
            for s in idle:
                s.close()
        state["release"] = True
        for t in threads:
            t.join(WAIT_S)
        assert replies == [200] * 6
        # Their connections stay open, waiting for a next request: anonymous requests fit again.
        assert httpx.get(f"{url}/fast", timeout=WAIT_S).status_code == 200
        assert [c.get(f"{url}/fast").status_code for c in clients] == [200] * 6  # on the same connections
        for c in clients:
            c.close()


def _greedy_upload(port: int) -> socket.socket:
    """A connection that claims the largest body and sends one byte of it."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n{" % (64 * MiB))
    return s


@pytest.mark.slow  # the whole scorer: its worker and parser processes start in ~5 s on two loaded cores
def test_the_scorer_serves_honest_clients_while_a_greedy_one_holds_256_connections_and_claims_256_mib():
    """A greedy client on 127.0.0.1 opens 256 idle connections and 4 uploads that each claim 64 MiB (all
    the service admits at once) and send one byte; 8 honest clients on 127.0.0.1 are all served. The
    service holds the 4 bytes that arrived, and nothing once the greedy client hangs up."""
    cfg = RewardConfig(workers=1, timeout_s=5.0)
    with running(make_app(cfg)) as url:
        port = int(url.rsplit(":", 1)[1])
        greedy = [socket.create_connection(("127.0.0.1", port)) for _ in range(256)]
        greedy += [_greedy_upload(port) for _ in range(4)]
        try:
            health = lambda: httpx.get(f"{url}/health", timeout=WAIT_S).json()  # noqa: E731
            wait_for(lambda: health()["queued_bytes"] == 4, "the greedy uploads' first bytes held")
            results: list[list[bool]] = []

            def honest(i: int) -> None:
                for j in range(3):
                    target = 2 * (i + j)
                    reply = httpx.post(f"{url}/v1/score", timeout=WAIT_S, json={"requests": [
                        {"data_source": "countdown", "response": f"<answer>{i + j} * 2</answer>",
                         "ground_truth": {"target": target, "numbers": [i + j, 2]}}]})
                    results.append([reply.status_code == 200 and r["correct"] for r in reply.json()["results"]])

            threads = [threading.Thread(target=honest, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(WAIT_S)
            assert results == [[True]] * 24
            assert health()["queued_bytes"] == 4
        finally:
            for s in greedy:
                s.close()
        wait_for(lambda: health()["queued_bytes"] == 0, "the greedy uploads' bytes given back")


@pytest.mark.parametrize("max_connections, reserved", [(8, 8), (8, 9)])
def test_a_server_that_would_leave_anonymous_clients_nothing_is_refused(max_connections, reserved):
    app, _ = slow_app()
    with pytest.raises(ValueError, match="reserved connections"):
        server(app, max_connections=max_connections, reserved=reserved)


@pytest.mark.slow  # the whole scorer (worker and parser processes), then 25 examples per operation
def test_the_scorer_api_answers_what_its_schema_says():
    """Every body its OpenAPI allows, and bodies it does not (schemathesis, from the running service):
    never a 500 or a dropped connection, and every answer a status code, content type and body that
    the schema declares. Bounded in count per operation; derandomised under CI (conftest.py)."""
    cfg = RewardConfig(workers=1, timeout_s=2.0)
    limits = ServiceSettings(max_queued_bytes=2 * MiB, max_body_bytes=MiB, max_items=64, max_budget_s=5.0)
    with running(make_app(cfg, limits)) as url:
        schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.label for op in operations} == {"POST /v1/score", "GET /health", "GET /metrics"}
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
            def answers(case) -> None:
                # A body the schema allows may still name a data_source no reward is registered for (a
                # plugin adds labels at start-up; the schema cannot list them): 400 is its answer.
                case.call_and_validate(timeout=WAIT_S, excluded_checks=[positive_data_acceptance])

            answers()
