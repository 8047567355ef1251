"""The scorer service: a worker pool behind HTTP, for actors on other machines (`dph-async serve scorer`).

Endpoints:
- POST /v1/score: a batch (see `wire`); 200 with one result per request, in order. 400 for a malformed
  body or an unknown data_source (the body names it), 401 without the shared token when one is set,
  408 for a body that does not arrive within `body_timeout_s`, 413 for a body over `max_body_bytes`
  or with more than `max_items` requests, 503 with Retry-After when the bytes that arrived do not fit
  (`_Admission`; the client backs off and retries).
- GET /health: {"status": "ok", workers, in_flight, queued_bytes, restarts, timeout_s}.
- GET /metrics: Prometheus text (items by data_source and status, latency histogram, HTTP codes (499:
  the client hung up before its answer), process memory and file descriptors), rendered at most once a
  second.

What the service trusts of a peer: nothing but the token. The event loop only reads bytes (bounded,
timed, admitted as they arrive: a Content-Length is a claim, checked against `max_body_bytes`, never
reserved) and answers; bodies are parsed
in killable child processes (`body`), ground truths built only inside the reward workers, and scoring
waits in threads. Every byte admitted is given back however its request ends (answered, refused, timed
out, the client gone mid-upload, the task cancelled). Every batch has a deadline (its `budget_s`, at
most `max_budget_s`) that includes waiting for a worker: the answer always comes by then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import msgspec
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect

from dph_async.admission import authorized
from dph_async.config.rewards import RewardConfig
from dph_async.metrics_endpoint import CachedExposition
from dph_async.rewards.body import BodyParser, BodyRefused
from dph_async.rewards.plugins import load_plugins
from dph_async.rewards.pool import RewardPool
from dph_async.rewards.registry import UnknownDataSource, get_reward_fn
from dph_async.rewards.service_metrics import ServiceMetrics
from dph_async.rewards.wire import ScoreBatch, ScoreReply

MiB = 2**20


@dataclass(frozen=True)
class ServiceSettings:
    # Bytes of request bodies admitted at once (being read, parsed, queued or scored); more gets 503.
    max_queued_bytes: int = 256 * MiB
    max_body_bytes: int = 64 * MiB
    # Requests in one batch (the client sends 64 by default).
    max_items: int = 4096
    # The longest a batch may take, whatever budget the client asks for.
    max_budget_s: float = 600.0
    # A body must arrive within this long after its headers (slow or stalled senders are cut off).
    body_timeout_s: float = 60.0
    # Parser children, their memory cap and deadline per body.
    parsers: int = 2
    parser_memory_mb: int = 1024
    parse_timeout_s: float = 10.0
    # Shared secret required as "Authorization: Bearer <token>" on /v1/score; None: no check. Never shown.
    token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.max_body_bytes * 2 > self.max_queued_bytes:  # else a lone body of the largest size never fits
            raise ValueError(f"max_queued_bytes ({self.max_queued_bytes}) must be at least twice max_body_bytes "
                             f"({self.max_body_bytes}): a request holds at most half of what the others leave free")


class _Refused(Exception):
    def __init__(self, code: int, error: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.code, self.error, self.detail, self.headers = code, error, detail, headers or {}


class _Admission:
    """Bytes of bodies in the service, taken as they arrive and given back when the request ends. One
    request may hold at most as many bytes as it leaves free for the others: no single upload can fill
    the service, and the more uploads a client runs at once, the less each may hold."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0

    @contextmanager
    def reservation(self) -> Iterator[_Reservation]:
        """A request's share, given back however the request ends: answered, refused, timed out, the
        client gone mid-upload (Starlette's ClientDisconnect), the task cancelled, or any error."""
        reservation = _Reservation(self)
        try:
            yield reservation
        finally:
            self.held -= reservation.taken
            reservation.taken = 0


class _Reservation:
    def __init__(self, admission: _Admission) -> None:
        self.admission, self.taken = admission, 0

    def grow_to(self, n: int) -> None:
        """Hold `n` bytes in all (no-op if already held); 503 when that is more than this request's share."""
        more = n - self.taken
        if more <= 0:
            return
        a = self.admission
        others = a.held - self.taken
        if 2 * n > a.limit - others:
            raise _Refused(503, "overloaded", f"{a.held} bytes of requests in the service; retry later",
                           {"Retry-After": "1"})
        a.held += more
        self.taken = n


async def _read_body(request: Request, settings: ServiceSettings, reservation: _Reservation) -> bytes:
    """The body, admitted as it arrives (a Content-Length over the limit is refused before reading,
    but a size claimed is never reserved: it costs the claimant nothing to claim); the bytes stay held
    in `reservation` until it is given back."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > settings.max_body_bytes:
        raise _Refused(413, "too_large", f"body over {settings.max_body_bytes} bytes; send smaller batches")
    chunks: list[bytes] = []

    async def receive() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise _Refused(413, "too_large", f"body over {settings.max_body_bytes} bytes; send smaller batches")
            reservation.grow_to(size)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), settings.body_timeout_s)
    except asyncio.TimeoutError:
        raise _Refused(408, "timeout", f"body not received within {settings.body_timeout_s:g} s",
                       {"Connection": "close"}) from None
    return b"".join(chunks)


def _error(e: _Refused | BodyRefused, **extra: object) -> JSONResponse:
    headers = getattr(e, "headers", None)
    return JSONResponse({"error": e.error, "detail": e.detail, **extra}, status_code=e.code, headers=headers)


_ERROR = {"type": "object", "required": ["error", "detail"],
          "properties": {"error": {"type": "string"}, "detail": {"type": "string"}}}
# The body is read by hand (admitted as it arrives, parsed in a child), so FastAPI cannot infer its
# schema: /openapi.json states it from the msgspec structs both ends use.
_SCORE_OPERATION = {
    "requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ScoreBatch"}}}},
    "responses": {
        "200": {"description": "one result per request, in order",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ScoreReply"}}}},
        **{str(code): {"description": what, "content": {"application/json": {"schema": _ERROR}}}
           for code, what in [(400, "a malformed batch or an unknown data_source"), (401, "without the token"),
                              (408, "the body did not arrive in time"), (413, "too many bytes or requests"),
                              (503, "overloaded: retry after Retry-After")]},
    },
}


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, components = msgspec.json.schema_components([ScoreBatch, ScoreReply],
                                                        ref_template="#/components/schemas/{name}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        app.openapi_schema = schema
    return app.openapi_schema


def _lifespan(cfg: RewardConfig, parser: BodyParser, pools: list[RewardPool], executor: ThreadPoolExecutor,
              parse_threads: ThreadPoolExecutor) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: the worker pool and the parsers warm before the first request, closed after."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = RewardPool(cfg.workers, cfg.timeout_s, cfg.memory_limit_mb, config=cfg)
        await asyncio.get_running_loop().run_in_executor(executor, pool.warm_up)
        await asyncio.get_running_loop().run_in_executor(parse_threads, parser.warm_up)
        pools.append(pool)
        try:
            yield
        finally:
            pool.close()
            parser.close()
            executor.shutdown(wait=False, cancel_futures=True)
            parse_threads.shutdown(wait=False, cancel_futures=True)

    return lifespan


def _unknown_source(sources: list[str]) -> JSONResponse | None:
    """A 400 naming the first data_source no reward is registered for, or None."""
    for source in dict.fromkeys(sources):
        try:
            get_reward_fn(source)
        except UnknownDataSource as e:
            return _error(_Refused(400, "unknown_data_source", str(e)), data_source=source)
    return None


def make_app(cfg: RewardConfig, settings: ServiceSettings | None = None) -> FastAPI:
    """The service app; its pool of `cfg.workers` processes lives as long as the app runs."""
    settings = settings or ServiceSettings()
    load_plugins(cfg.plugins)  # a broken plugin stops the service before it listens
    admission = _Admission(settings.max_queued_bytes)
    state = {"in_flight": 0}
    pools: list[RewardPool] = []
    parser = BodyParser(settings.parsers, settings.parser_memory_mb, settings.max_items, settings.parse_timeout_s)
    metrics = ServiceMetrics({
        "in_flight": ("Requests being scored or waiting for a worker", lambda: state["in_flight"]),
        "queued_bytes": ("Bytes of request bodies admitted and not yet answered", lambda: admission.held),
        "worker_restarts": ("Reward workers replaced after a kill or a crash",
                            lambda: pools[0].restarts if pools else 0),
        "workers": ("Reward worker processes", lambda: cfg.workers),
    })
    exposition = CachedExposition(metrics.registry)
    # Threads that wait on the pool; batches beyond them queue here, already admitted.
    executor = ThreadPoolExecutor(max_workers=32, thread_name_prefix="scorer-batch")
    parse_threads = ThreadPoolExecutor(max_workers=settings.parsers, thread_name_prefix="scorer-parse")

    app = FastAPI(title="dph-async scorer", lifespan=_lifespan(cfg, parser, pools, executor, parse_threads))
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]

    @app.post("/v1/score", openapi_extra=_SCORE_OPERATION)
    async def score(request: Request) -> Response:
        if settings.token is not None and not authorized(settings.token, request.headers.get("authorization")):
            metrics.record_batch(401)
            return _error(_Refused(401, "unauthorized", "missing or wrong bearer token"))
        arrived = time.monotonic()  # the budget counts from here: reading and parsing come out of it
        with admission.reservation() as reservation:
            try:
                return await _score(request, reservation, arrived)
            except ClientDisconnect:  # gone mid-upload: nobody to answer; the reservation is given back
                metrics.record_batch(499)
                return Response(status_code=499)

    async def _score(request: Request, reservation: _Reservation, arrived: float) -> Response:
        loop = asyncio.get_running_loop()
        try:
            body = await _read_body(request, settings, reservation)
            budget_s, requests = await loop.run_in_executor(parse_threads, parser.parse, body)
            del body
        except (_Refused, BodyRefused) as e:
            metrics.record_batch(e.code)
            return _error(e)
        sources = [r.data_source for r in requests]
        if (unknown := _unknown_source(sources)) is not None:
            metrics.record_batch(400)
            return unknown
        deadline = arrived + min(budget_s or settings.max_budget_s, settings.max_budget_s)
        state["in_flight"] += len(requests)
        try:
            results = await loop.run_in_executor(executor, pools[0].score_many, requests, deadline)
        finally:
            state["in_flight"] -= len(requests)
        metrics.record_batch(200, sources, results)
        return Response(msgspec.json.encode(ScoreReply(results)), media_type="application/json")

    @app.get("/health")
    async def health() -> dict:
        pool = pools[0]
        return {"status": "ok", "workers": cfg.workers, "in_flight": state["in_flight"],
                "queued_bytes": admission.held, "restarts": pool.restarts, "timeout_s": cfg.timeout_s}

    @app.get("/metrics", response_class=PlainTextResponse)  # the schema then says text/plain, as Prometheus's is
    async def metrics_text() -> Response:
        return Response(exposition.text(), media_type=CONTENT_TYPE_LATEST)

    return app
