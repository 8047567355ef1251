"""The scorer service's edges (dph_async/rewards/service.py): the byte budget at its exact fit and one
past, for any sequence of uploads (hypothesis); both upload styles at the body limit; the deadline each
batch gets; what /health, /metrics and /openapi.json say during and after batches of different sizes.
The reward pool is a stand-in here (no worker processes; the pool has its own tests), the body parser
the real one."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import threading
import time
from contextlib import ExitStack

import pytest
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from test_scorer_service import _asgi_scope, scrape

from dph_async.config.rewards import RewardConfig
from dph_async.rewards import service
from dph_async.rewards.registry import UnknownDataSource, get_reward_fn
from dph_async.rewards.result import RewardResult
from dph_async.rewards.service import ServiceSettings, _Admission, _read_body, _Refused, make_app

# The deadlines the tests with this mark wait for are under a second: a minute is a hang (a deadline
# lost), not a slow machine.
HUNG = pytest.mark.timeout(60)
TOKEN = "edge-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SETTINGS = ServiceSettings(max_queued_bytes=4000, max_body_bytes=2000, max_items=8, max_budget_s=30,
                           body_timeout_s=0.25, parsers=1, token=TOKEN)


class StandInPool:
    """The reward pool's interface: scores every request 0.5 ("ok"), and runs `during` (if set) while
    a batch is being scored, to look at the service then."""

    def __init__(self, workers: int, timeout_s: float, memory_limit_mb: int, config: RewardConfig) -> None:
        self.made_with = (workers, timeout_s, memory_limit_mb, config)
        self.restarts, self.warm, self.closed = 0, False, False
        self.during = None
        self.calls: list[tuple[float, int, str]] = []  # (deadline, requests, thread) of each batch

    def warm_up(self) -> None:
        self.warm = True

    def score_many(self, requests: list, deadline: float) -> list[RewardResult]:
        self.calls.append((deadline, len(requests), threading.current_thread().name))
        if self.during is not None:
            self.during()
        return [RewardResult(0.5, False, latency_s=0.01) for _ in requests]

    def close(self) -> None:
        self.closed = True


CFG = RewardConfig(workers=3, timeout_s=2.5)


@contextlib.contextmanager
def serving(settings: ServiceSettings = SETTINGS, while_parsing=lambda parser: None):
    """The app with a stand-in pool, started: (client, pool, the threads each parse ran on). Made per
    test, not per module: the app is one function to a mutation tool, and only the tests that make
    one count as its tests."""
    pools: list[StandInPool] = []
    parsed_on: list[str] = []

    class Parser(service.BodyParser):
        def parse(self, body: bytes):
            parsed_on.append(threading.current_thread().name)
            while_parsing(self)
            return super().parse(body)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service, "RewardPool", lambda *a, **kw: pools.append(StandInPool(*a, **kw)) or pools[-1])
        mp.setattr(service, "BodyParser", Parser)
        with TestClient(make_app(CFG, settings)) as client:
            assert pools[0].warm
            yield client, pools[0], parsed_on
    assert pools[0].closed


@pytest.fixture
def served():
    with serving() as (client, pool, _):
        yield client, pool


def item(i: int) -> dict:
    return {"data_source": "countdown", "response": f"<answer>{i}</answer>", "ground_truth": {"target": i}}


def post(client: TestClient, n: int, **batch) -> tuple[int, dict]:
    reply = client.post("/v1/score", json={"requests": [item(i) for i in range(n)], **batch}, headers=AUTH)
    return reply.status_code, reply.json()


# ---------------------------------------------------------------------------------------------
# The byte budget.


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(-1, 1100)), max_size=30))
def test_the_bytes_held_are_what_each_request_holds_and_a_request_holds_at_most_what_it_leaves(ops):
    """For any sequence of requests growing (n >= 0) or ending (n = -1): the service holds the sum of
    what each request holds; a request grows to n when 2n fits in what the others leave, and is
    refused (holding what it held) when it does not; asking for no more than it holds changes nothing."""
    limit = 1000
    admission = _Admission(limit)
    model = [0, 0, 0]
    with ExitStack() as stack:
        ends = [ExitStack() for _ in model]
        live = [ends[i].enter_context(admission.reservation()) for i in range(3)]
        for e in ends:
            stack.enter_context(e)
        for i, n in ops:
            if n < 0:
                ends[i].close()
                model[i] = 0
                ends[i] = ExitStack()
                stack.enter_context(ends[i])
                live[i] = ends[i].enter_context(admission.reservation())
            elif n <= model[i] or 2 * n <= limit - (sum(model) - model[i]):
                live[i].grow_to(n)
                model[i] = max(model[i], n)
            else:
                held = admission.held
                with pytest.raises(_Refused) as refused:
                    live[i].grow_to(n)
                assert (refused.value.code, refused.value.error, refused.value.detail) == (
                    503, "overloaded", f"{held} bytes of requests in the service; retry later")
            assert admission.held == sum(model)
    assert admission.held == 0


def test_asking_for_no_more_than_it_holds_is_never_refused_when_the_others_grew():
    admission = _Admission(1000)
    with admission.reservation() as first, admission.reservation() as second:
        first.grow_to(400)
        second.grow_to(300)  # first's share is now (1000 - 300) / 2 = 350, below what it holds
        first.grow_to(400)
        first.grow_to(399)
        assert admission.held == 700


@pytest.mark.parametrize(("queued", "body", "fits"), [(100, 50, True), (101, 50, True), (99, 50, False)])
def test_settings_fit_a_lone_largest_body_exactly(queued, body, fits):
    if fits:
        assert ServiceSettings(max_queued_bytes=queued, max_body_bytes=body).max_body_bytes == body
    else:
        with pytest.raises(ValueError, match=rf"max_queued_bytes \({queued}\) must be at least twice"):
            ServiceSettings(max_queued_bytes=queued, max_body_bytes=body)


# ---------------------------------------------------------------------------------------------
# Reading a body: both styles, at the limit and one past.


async def _read(chunks: list[bytes], declared: str | None, settings: ServiceSettings) -> tuple[bytes, int, int]:
    """(the body read, the chunks the service asked for, the bytes held at the end of the read)."""
    headers = [] if declared is None else [(b"content-length", declared.encode())]
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    asked = 0

    async def receive() -> dict:
        nonlocal asked
        asked += 1
        return messages.pop(0)

    admission = _Admission(settings.max_queued_bytes)
    with admission.reservation() as reservation:
        try:
            body = await _read_body(Request(_asgi_scope("POST", "/v1/score", headers), receive), settings, reservation)
        finally:
            held = admission.held
    return body, asked, held


LIMIT = ServiceSettings(max_queued_bytes=1000, max_body_bytes=500)


@pytest.mark.parametrize("style", ["content-length", "chunked", "content-length that lies"])
def test_a_body_of_exactly_the_limit_is_read_and_held_whole(style):
    chunks = [b"a" * 200, b"b" * 300]
    declared = {"content-length": "500", "chunked": None, "content-length that lies": "7"}[style]
    assert asyncio.run(_read(chunks, declared, LIMIT)) == (b"a" * 200 + b"b" * 300, 2, 500)


@pytest.mark.parametrize("style", ["chunked", "content-length that lies", "content-length that is no number"])
def test_one_byte_past_the_limit_is_refused_at_the_chunk_that_passes_it(style):
    chunks = [b"a" * 200, b"b" * 301, b"c"]
    declared = {"chunked": None, "content-length that lies": "7", "content-length that is no number": "5e2"}[style]
    with pytest.raises(_Refused) as refused:
        asyncio.run(_read(chunks, declared, LIMIT))
    assert (refused.value.code, refused.value.error, refused.value.detail) == (
        413, "too_large", "body over 500 bytes; send smaller batches")


def test_a_content_length_one_past_the_limit_is_refused_before_a_byte_is_read():
    body = b"a" * 500

    async def read(declared: int) -> tuple[int, _Refused | None]:
        asked = 0

        async def receive() -> dict:
            nonlocal asked
            asked += 1
            return {"type": "http.request", "body": body, "more_body": False}

        with _Admission(1000).reservation() as reservation:
            try:
                await _read_body(Request(_asgi_scope("POST", "/v1/score",
                                                     [(b"content-length", str(declared).encode())]), receive),
                                 LIMIT, reservation)
            except _Refused as e:
                return asked, e
        return asked, None

    assert asyncio.run(read(500)) == (1, None)
    asked, refused = asyncio.run(read(501))
    assert asked == 0 and (refused.code, refused.error, refused.detail) == (
        413, "too_large", "body over 500 bytes; send smaller batches")


@HUNG
def test_a_body_that_stops_arriving_is_refused_in_its_time_and_closes_the_connection():
    settings = ServiceSettings(max_queued_bytes=1000, max_body_bytes=500, body_timeout_s=0.125)

    async def stalled() -> None:
        async def receive() -> dict:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

        with _Admission(1000).reservation() as reservation:
            await _read_body(Request(_asgi_scope("POST", "/v1/score", []), receive), settings, reservation)

    start = time.monotonic()
    with pytest.raises(_Refused) as refused:
        asyncio.run(stalled())
    assert time.monotonic() - start >= 0.125
    assert (refused.value.code, refused.value.error, refused.value.detail, refused.value.headers) == (
        408, "timeout", "body not received within 0.125 s", {"Connection": "close"})


# ---------------------------------------------------------------------------------------------
# The app around a stand-in pool.


def test_the_pool_is_made_from_the_reward_config_warmed_before_serving_and_closed_after():
    with serving() as (client, pool, parsed_on):
        assert pool.made_with == (3, 2.5, CFG.memory_limit_mb, CFG)
        assert post(client, 1)[0] == 200
        assert [t.split("_")[0] for t in parsed_on] == ["scorer-parse"]  # parsed off the event loop


def test_bodies_are_parsed_on_as_many_threads_as_there_are_parser_children():
    """With one parser child, a second body waits for the first's parse to end, rather than taking a
    thread of its own to wait for the child in."""
    lock, inside, most = threading.Lock(), [0], [0]
    both = threading.Event()

    def while_parsing(parser) -> None:
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] == 2:
                both.set()
        both.wait(0.5)  # time for a second parse to start beside this one, if it could
        with lock:
            inside[0] -= 1

    with serving(while_parsing=while_parsing) as (client, _, parsed_on):
        answers: list[int] = []
        uploads = [threading.Thread(target=lambda: answers.append(post(client, 1)[0])) for _ in range(2)]
        for u in uploads:
            u.start()
        for u in uploads:
            u.join()
    assert answers == [200, 200] and most[0] == 1 and len(parsed_on) == 2


def test_the_gauges_read_the_pool_and_the_service_and_say_what_they_count():
    app = make_app(CFG, SETTINGS)  # not started yet: no pool
    gauges = {"dph_scorer_in_flight": "Requests being scored or waiting for a worker",
              "dph_scorer_queued_bytes": "Bytes of request bodies admitted and not yet answered",
              "dph_scorer_worker_restarts": "Reward workers replaced after a kill or a crash",
              "dph_scorer_workers": "Reward worker processes"}
    found = {f.name: (f.documentation, f.samples[0].value)
             for f in text_string_to_metric_families(TestClient(app).get("/metrics").text) if f.name in gauges}
    assert found == {name: (doc, 3.0 if name == "dph_scorer_workers" else 0.0) for name, doc in gauges.items()}
    with serving() as (client, pool, _):
        pool.restarts = 4
        found = scrape(client.get("/metrics").text)
        assert (found[("dph_scorer_worker_restarts", ())], found[("dph_scorer_workers", ())]) == (4.0, 3.0)


@HUNG
def test_a_body_the_parser_does_not_answer_in_time_is_refused_naming_its_limits():
    def stop_the_child(parser) -> None:  # it takes the body and never answers
        child = parser._children.get()
        os.kill(child.proc.pid, signal.SIGSTOP)
        parser._children.put(child)

    settings = dataclasses.replace(SETTINGS, parse_timeout_s=0.0625, parser_memory_mb=700)
    with serving(settings, stop_the_child) as (client, _, _):
        reply = client.post("/v1/score", json={"requests": [item(1)]}, headers=AUTH)
        assert (reply.status_code, reply.json()) == (413, {
            "error": "too_large", "detail": "body could not be parsed within 0.0625 s and 700 MB"})


def test_health_reports_the_pool_and_nothing_held_between_batches(served):
    client, pool = served
    pool.restarts = 4
    try:
        assert client.get("/health").json() == {"status": "ok", "workers": 3, "in_flight": 0, "queued_bytes": 0,
                                                 "restarts": 4, "timeout_s": 2.5}
    finally:
        pool.restarts = 0


def test_while_a_batch_is_scored_its_requests_are_in_flight_and_its_bytes_held(served):
    """Batches of different sizes, one after another: each counts its own requests and bytes, and
    each gives them all back."""
    client, pool = served
    seen: list[dict] = []
    pool.during = lambda: seen.append(client.get("/health").json())
    try:
        sizes = []
        for n in (1, 4, 2):
            body = {"requests": [item(i) for i in range(n)]}
            sizes.append(len(client.post("/v1/score", json=body, headers=AUTH).request.content))
            assert client.get("/health").json()["in_flight"] == 0
    finally:
        pool.during = None
    assert [(h["in_flight"], h["queued_bytes"]) for h in seen] == list(zip((1, 4, 2), sizes, strict=True))
    assert client.get("/health").json()["queued_bytes"] == 0


def test_batches_in_the_pool_at_once_are_all_in_flight():
    both = threading.Barrier(2, timeout=30)
    seen: list[int] = []
    with serving() as (client, pool, _):

        def during() -> None:
            both.wait()  # both batches in the pool
            seen.append(client.get("/health").json()["in_flight"])
            both.wait()  # neither leaves before both have looked

        pool.during = during
        batches = [threading.Thread(target=post, args=(client, n)) for n in (1, 3)]
        for b in batches:
            b.start()
        for b in batches:
            b.join()
        assert client.get("/health").json()["in_flight"] == 0
    assert seen == [4, 4]


def test_a_batch_s_deadline_is_its_budget_at_most_the_service_s_counted_from_its_arrival(served):
    client, pool = served
    for budget_s, allowed in [(None, 30), (5, 5), (30, 30), (31, 30), (1e9, 30), (0.5, 0.5)]:
        start = time.monotonic()
        answer = client.post("/v1/score", headers=AUTH, json={
            "requests": [item(1), item(2)], **({} if budget_s is None else {"budget_s": budget_s})})
        end = time.monotonic()
        deadline, n, thread = pool.calls[-1]
        assert answer.status_code == 200 and n == 2 and start + allowed <= deadline <= end + allowed, budget_s
        assert thread.startswith("scorer-batch_") and answer.headers["content-type"] == "application/json"
        assert answer.json() == {"results": [{"score": 0.5, "correct": False, "format_ok": True, "status": "ok",
                                      "latency_s": 0.01, "detail": ""}] * 2}


def test_every_answer_is_counted_by_its_code(served):
    client, _ = served
    codes = {"200": 0, "400": 0, "401": 0, "413": 0, "499": 0}

    def totals() -> dict[str, float]:
        found = scrape(client.get("/metrics").text)
        return {c: found.get(("dph_scorer_batches_total", (("code", c),)), 0.0) for c in codes}

    before = totals()
    assert post(client, 3)[0] == 200
    codes["200"] += 1
    unknown = client.post("/v1/score", json={"requests": [item(1), {**item(2), "data_source": "nope_ds"}]},
                          headers=AUTH)
    with pytest.raises(UnknownDataSource) as says:
        get_reward_fn("nope_ds")
    assert (unknown.status_code, unknown.json()) == (400, {"error": "unknown_data_source", "detail": str(says.value),
                                                           "data_source": "nope_ds"})
    assert client.post("/v1/score", content=b"{", headers=AUTH).status_code == 400
    codes["400"] += 2
    assert client.post("/v1/score", json={"requests": [item(1)]}).status_code == 401
    assert client.post("/v1/score", json={"requests": [item(1)]},
                       headers={"Authorization": f"Bearer {TOKEN}x"}).status_code == 401
    codes["401"] += 2
    assert post(client, 9)[0] == 413
    codes["413"] += 1
    assert asyncio.run(_gone_mid_upload(client.app)) == 499
    codes["499"] += 1
    want = {c: before[c] + k for c, k in codes.items()}
    deadline = time.monotonic() + 30
    while (after := totals()) != want:  # rendered at most once a second
        assert time.monotonic() < deadline, f"the metrics show {after}, not {want}"
        time.sleep(0.1)


def test_an_unauthorized_request_is_refused_before_its_body_is_read(served):
    client, _ = served
    refused = client.post("/v1/score", content=b"x" * 5000)
    assert (refused.status_code, refused.json()) == (401, {"error": "unauthorized",
                                                           "detail": "missing or wrong bearer token"})


async def _gone_mid_upload(app) -> int:
    """The status the app answers a client that hung up after its first chunk."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": b'{"requests": [', "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    await app(_asgi_scope("POST", "/v1/score", [(b"authorization", AUTH["Authorization"].encode())]), receive, send)
    return sent[0]["status"]


@HUNG
def test_refusals_through_the_app_carry_their_headers():
    """A second upload that does not fit beside a first one gets 503 with Retry-After; an upload that
    stops arriving gets 408 and the connection closed."""
    with serving() as (client, _, _):
        app = client.app
        auth = [(b"authorization", AUTH["Authorization"].encode())]

        async def uploads() -> tuple[dict, dict]:
            first_in = asyncio.Event()
            answers: dict[str, dict] = {}

            def upload(name: str, first: bytes):
                sent = [{"type": "http.request", "body": first, "more_body": True}]

                async def receive() -> dict:
                    if sent:
                        first_in.set()
                        return sent.pop()
                    await asyncio.Event().wait()  # the rest never comes
                    raise AssertionError("unreachable")

                async def send(message: dict) -> None:
                    if message["type"] == "http.response.start":
                        answers[name] = {"status": message["status"], **{k.decode(): v.decode()
                                                                        for k, v in message["headers"]}}

                return app(_asgi_scope("POST", "/v1/score", auth), receive, send)

            first = asyncio.create_task(upload("first", b" " * 1500))
            await first_in.wait()
            await upload("second", b" " * 1500)  # 2 x 1500 > 4000 - 1500
            await first  # its body never completes: 408 after body_timeout_s
            return answers["first"], answers["second"]

        first, second = asyncio.run(uploads())
        assert (second["status"], second["retry-after"]) == (503, "1")
        assert (first["status"], first["connection"]) == (408, "close")
        assert client.get("/health").json()["queued_bytes"] == 0


def test_a_client_gone_mid_upload_is_answered_499_and_holds_nothing(served):
    client, _ = served
    assert asyncio.run(_gone_mid_upload(client.app)) == 499
    assert client.get("/health").json()["queued_bytes"] == 0


def test_the_api_schema_states_the_batch_the_reply_and_every_refusal():
    app = make_app(CFG, SETTINGS)  # not started: the schema needs no pool
    schema = TestClient(app).get("/openapi.json").json()
    assert schema["info"]["title"] == "dph-async scorer"
    components = schema["components"]["schemas"]
    assert {"ScoreBatch", "ScoreReply", "ScoreItem", "RewardResult"} <= set(components)
    # msgspec's own references point into the components too, where the schema keeps them.
    assert components["ScoreBatch"]["properties"]["requests"]["items"] == {"$ref": "#/components/schemas/ScoreItem"}
    operation = schema["paths"]["/v1/score"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ScoreBatch"}
    responses = operation["responses"]
    assert responses["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ScoreReply"}
    for code in ("400", "401", "408", "413", "503"):
        error = responses[code]["content"]["application/json"]["schema"]
        assert error["required"] == ["error", "detail"] and set(error["properties"]) == {"error", "detail"}
    assert app.openapi() is app.openapi()  # made once
